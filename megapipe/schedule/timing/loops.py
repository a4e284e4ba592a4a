"""The schedule layer's two hot loops, one source for two ways to run them.

``sweep`` is the engine's round robin (``engine`` says what it computes); ``in_sequence`` is the
retiming in a finished timing's sequence (``retime``). Both are written in the subset of Python that
numba compiles: flat columns in, results written into columns passed in, no dicts, no objects, no
helper functions (compiled code cannot call plain Python ones; so ``sweep`` is one long function).
The engine runs them as plain Python on lists, or,
where numba is installed (``pip install megapipe[fast]``) and a schedule has at least
``COMPILED_FROM_ACTIONS`` actions, compiled on numpy arrays (``compiled_loops``;
``MEGAPIPE_NO_NUMBA=1`` keeps them in Python): the same float operations in the same order, so
the same bits either way (``tests/schedule/test_loops.py`` runs golden sweep cases through
both). Compiled code is cached on disk (numba's ``cache=True``): the first use on a machine
compiles it (about 1.5 s), a process loads it once (about 0.35 s).

The round robin's ranks to run this sweep and the next are two flag columns (``now``,
``later``) scanned upward: within a sweep the next rank to run always comes after the last one.
A rank that waits is parked on the product it waits for in a linked list (``park_head[p]``, the
first rank parked on product p; ``park_next[r]``, the next one after rank r; ``parked_on[r]``,
the product rank r waits for, so that it is never listed twice) and woken when p is made.
"""

from __future__ import annotations

import functools
import os

import numpy as np

# Loading the compiled loops costs a process about 0.35 s (numba's import and the cached machine
# code), as long as the Python loops take for about 400k actions; a schedule runs them a few times.
COMPILED_FROM_ACTIONS = 200_000


@functools.cache
def _compiled():
    try:
        import numba
    except ImportError:
        return None
    jit = numba.njit(cache=True, nogil=True)
    return jit(sweep), jit(in_sequence)


def compiled_loops(actions: int):
    """``(sweep, in_sequence)`` compiled, for a timing of ``actions`` actions; None where numba is
    not installed, ``MEGAPIPE_NO_NUMBA=1`` is set, or the timing is too short to gain from it."""
    if actions < COMPILED_FROM_ACTIONS or os.environ.get("MEGAPIPE_NO_NUMBA") == "1":
        return None
    return _compiled()


def warm_up() -> bool:
    """Load the compiled loops now (compile them, the first time on a machine) by running each
    on one action, rather than inside the first large timing; False where they are not used
    (``compiled_loops``)."""
    found = compiled_loops(COMPILED_FROM_ACTIONS)
    if found is None:
        return False
    none, one = np.full(1, -1, dtype=np.int64), np.ones(1)
    columns = (np.array([0, 1], dtype=np.int64), none, none, none, np.zeros(1, np.int64), none)
    found[0](
        *columns,
        one,
        1,
        np.zeros(0),
        np.zeros(0, np.bool_),
        np.zeros(0, np.int64),
        None,
        None,
        np.zeros(1, np.int64),
        np.zeros(1),
        np.ones(1),
        np.ones(1),
        none.copy(),
        np.full(3, -1.0),
        none.copy(),
        none.copy(),
        none.copy(),
        np.ones(1, np.bool_),
        np.zeros(1, np.bool_),
    )
    found[1](
        np.zeros(1, np.int64),
        np.zeros(1, np.int64),
        *columns[1:],
        one,
        0.0,
        1,
        np.zeros(1),
        np.zeros(1),
        np.zeros(1),
        np.full(3, -1.0),
    )
    return True


def sweep(
    offsets,
    need0,
    need1,
    need2,
    make0,
    make1,
    duration,
    space,
    delay,
    watched,
    first_maker,
    end_of,
    made_at,
    cursor,
    free,
    start,
    end,
    sweep_of,
    arrive,
    park_head,
    park_next,
    parked_on,
    now,
    later,
):
    """Run the round robin from ``cursor``/``free`` (updated in place) until no rank can move,
    writing ``start``, ``end``, ``sweep_of`` and ``arrive``. ``delay`` (per product, empty:
    none) and ``watched`` (per product, empty: none) are the rarer parts of making a product;
    ``end_of``/``made_at`` (None, or callables: Python only) time an action from its start.
    Returns ``(action, first maker, product)`` of the first watched product made twice, at which
    the timing stopped, else ``(-1, -1, -1)``."""
    has_delay, has_watch = len(delay) > 0, len(watched) > 0
    n_now, n_later, t, pos = len(offsets) - 1, 0, 0, 0
    while n_now > 0 or n_later > 0:
        if n_now == 0:
            now, later = later, now
            n_now, n_later, t, pos = n_later, 0, t + 1, 0
        while not now[pos]:
            pos += 1
        r = pos
        now[r] = False
        n_now -= 1
        k, stop, f = cursor[r], offsets[r + 1], free[r]
        while k < stop:
            s, wait = f, -1
            for a in (need0[k], need1[k], need2[k]):  # packed: the first -1 ends them
                if a < 0:
                    break
                x = arrive[a]
                if x < 0.0:
                    wait = a
                    break
                s = x if x > s else s
            if wait >= 0:
                p = wait - space if wait >= space else wait
                if parked_on[r] != p:
                    parked_on[r], park_next[r], park_head[p] = p, park_head[p], r
                break
            if end_of is None:
                f = s + duration[k]
            else:
                f = end_of(k, s)
            start[k], end[k], sweep_of[k] = s, f, t
            p, q = make0[k], make1[k]
            if made_at is None:
                fp, fq = f, f
            else:
                fp, fq = made_at(k, s, f)
            if has_watch or has_delay:
                for h in range(2):
                    product, when = (p, fp) if h == 0 else (q, fq)
                    if product < 0:
                        break
                    if has_watch and watched[product]:
                        if first_maker[product] >= 0:
                            cursor[r] = k
                            return k, first_maker[product], product
                        first_maker[product] = k
                    if has_delay:
                        arrive[product + space] = when + delay[product]
            # Wake the ranks parked on what the action made: in this sweep if they come after r,
            # else in the next one.
            for h in range(2):
                product, when = (p, fp) if h == 0 else (q, fq)
                if product < 0:  # q: only the backward half of an OVERLAP makes a second
                    break
                arrive[product] = when
                w = park_head[product]
                park_head[product] = -1
                while w >= 0:
                    parked_on[w] = -1
                    if w > r:
                        if not now[w]:
                            now[w], n_now = True, n_now + 1
                    elif not later[w]:
                        later[w], n_later = True, n_later + 1
                    w = park_next[w]
            k += 1
        cursor[r], free[r] = k, f
    return -1, -1, -1


def in_sequence(
    sequence,
    rank,
    need0,
    need1,
    need2,
    make0,
    make1,
    duration,
    latency,
    space,
    start,
    end,
    free,
    arrive,
):
    """Take the actions in ``sequence``: each starts at the latest of its rank's previous end and
    its
    needs' arrivals (the engine's own float operations), writing ``start``, ``end``, ``free``
    and ``arrive``. False at the first action that needs a product not made yet."""
    for k in sequence:
        r = rank[k]
        s = free[r]
        for a in (need0[k], need1[k], need2[k]):  # packed: the first -1 ends them
            if a < 0:
                break
            x = arrive[a]
            if x < 0.0:
                return False
            s = x if x > s else s
        f = s + duration[k]
        start[k], end[k], free[r] = s, f, f
        p, q = make0[k], make1[k]
        arrive[p] = f
        if q >= 0:
            arrive[q] = f
        if latency:
            arrive[p + space] = f + latency
            if q >= 0:
                arrive[q + space] = f + latency
    return True
