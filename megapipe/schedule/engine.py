"""The in-order run both the timeline and the simulator use: every rank runs its list in order,
each step once every product it needs has arrived; each product is looked at once per wait.

Semantics (the definition the schedule layer has always had): the ranks are swept round robin,
0 to pp-1, each running as far as it can, until a sweep moves nothing. ``run_in_order`` gives
exactly that result, order included (a product made twice is read as it stood when the reader
ran), without retrying blocked ranks: a rank that waits is parked on the product it waits for
and woken when it is made, in the sweep where the round robin would have moved it (this sweep if
its maker has a lower rank, the next one otherwise). Work is O(steps + waits).

Products are integers below ``space``; a need is a cell: ``p`` for product p as made, or
``space + p`` for product p as it arrives from another rank (made + ``delay[p]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass
class Steps:
    """Flat per-step inputs; rank r's steps are ``offsets[r]:offsets[r + 1]``.

    ``need0..need2``: cells the step waits for (-1: none); ``make0``, ``make1``: products it
    makes (-1: none); ``duration``: end = start + duration, unless ``end_of(step, start)`` is
    given. ``delay[p]``: added to product p for readers of cell ``space + p``. ``made_at(step,
    start, end)``, if given, says when the step's two products are made (an OVERLAP whose halves
    hand their outputs on before it ends: early sends); else both at its end.
    """

    offsets: Sequence[int]
    need0: list[int]
    need1: list[int]
    need2: list[int]
    make0: list[int]
    make1: list[int]
    duration: list[float]
    space: int
    delay: Sequence[float] | float = 0.0
    end_of: Callable[[int, float], float] | None = None
    made_at: Callable[[int, float, float], tuple[float, float]] | None = None


@dataclass
class Prefix:
    """Where a run starts when the first ``done[r]`` steps of each rank already ran (with these
    ``start``, ``end``, ``free`` per rank and cells ``arrive``): the rest is run from there."""

    done: list[int]
    free: list[float]
    start: list[float]
    end: list[float]
    arrive: list[float]


@dataclass
class Run:
    """What ``run_in_order`` found: per-step start, end and sweep (-1 where a step never ran),
    the time each cell became available (``arrive``, -1.0 where never), where each stuck rank
    stopped (``{rank: step}``), and, with ``watch``, the first product made twice
    (``(step, first maker step, product)``), at which the run stopped."""

    start: list[float]
    end: list[float]
    sweep: list[int]
    arrive: list[float]
    stuck: dict[int, int]
    remade: tuple[int, int, int] | None = None


class _Publisher:
    """The rarer parts of making a product: its arrival on other ranks after a latency, and
    stopping at a watched product made a second time (``remade``)."""

    def __init__(self, steps: Steps, arrive: list[float], watch: frozenset) -> None:
        delay = steps.delay
        if isinstance(delay, (int, float)):
            delay = [delay] * steps.space if delay else None
        self.delay, self.arrive, self.space, self.watch = delay, arrive, steps.space, watch
        self.first_maker: dict[int, int] = {}
        self.remade: tuple[int, int, int] | None = None

    @property
    def needed(self) -> bool:
        return bool(self.watch) or self.delay is not None

    def record(self, p: int, f: float, k: int) -> bool:
        """Product ``p`` is made at ``f`` by step k; False if it is made a second time."""
        if self.watch and p in self.watch:
            if p in self.first_maker:
                self.remade = (k, self.first_maker[p], p)
                return False
            self.first_maker[p] = k
        if self.delay is not None:
            self.arrive[p + self.space] = f + self.delay[p]
        return True


def run_in_order(
    steps: Steps, watch: frozenset = frozenset(), prefix: Prefix | None = None
) -> Run:
    """Run ``steps`` (module docstring). A product in ``watch`` made a second time stops the
    run there (the simulator reports it). Cell ``2 * space`` is never filled (a need nobody
    makes). With ``prefix``, the steps it holds are taken as run; only valid where every product
    has one maker, since then the result does not depend on the order steps run in."""
    offsets, total = steps.offsets, steps.offsets[-1]
    if prefix is None:
        prefix = Prefix([0] * (len(offsets) - 1), [0.0] * (len(offsets) - 1), [-1.0] * total,
                        [-1.0] * total, [-1.0] * (2 * steps.space + 1))
    run = Run(prefix.start, prefix.end, [-1] * total, prefix.arrive, {})
    cursor = [offsets[r] + done for r, done in enumerate(prefix.done)]
    publisher = _Publisher(steps, run.arrive, watch)
    _sweep(steps, run, cursor, list(prefix.free), publisher)
    run.remade = publisher.remade
    run.stuck = {r: k for r, k in enumerate(cursor) if k < offsets[r + 1]}
    return run


def _sweep(steps: Steps, run: Run, cursor: list[int], free: list[float], publisher) -> None:
    """The round robin (module docstring): the hot loop, with its lists in local variables."""
    offsets, space, end_of, duration, made_at, need0, need1, need2, make0, make1 = (
        steps.offsets, steps.space, steps.end_of, steps.duration, steps.made_at, steps.need0,
        steps.need1, steps.need2, steps.make0, steps.make1)
    arrive, start, end, sweep, parked = run.arrive, run.start, run.end, run.sweep, {}
    slow, record = publisher.needed, publisher.record
    now, later, t = (1 << (len(offsets) - 1)) - 1, 0, 0  # bit r: rank r runs this/next sweep
    while now or later:
        if not now:
            now, later, t = later, 0, t + 1
        lowest = now & -now
        r, now = lowest.bit_length() - 1, now ^ lowest
        k, stop, f = cursor[r], offsets[r + 1], free[r]
        while k < stop:
            s, a = f, need0[k]
            if a >= 0:  # needs are packed: a step with none has need0 = -1
                x = arrive[a]
                if x < 0.0:
                    parked.setdefault(a - space if a >= space else a, []).append(r)
                    break
                s, a = (x if x > s else s), need1[k]
                if a >= 0:
                    x = arrive[a]
                    if x < 0.0:
                        parked.setdefault(a - space if a >= space else a, []).append(r)
                        break
                    s, a = (x if x > s else s), need2[k]
                    if a >= 0:
                        x = arrive[a]
                        if x < 0.0:
                            parked.setdefault(a - space if a >= space else a, []).append(r)
                            break
                        s = x if x > s else s
            start[k], f = s, (s + duration[k] if end_of is None else end_of(k, s))
            end[k], sweep[k] = f, t
            p, q = make0[k], make1[k]
            fp, fq = (f, f) if made_at is None else made_at(k, s, f)
            if slow and not (record(p, fp, k) and (q < 0 or record(q, fq, k))):
                cursor[r] = k
                return
            # Wake the ranks parked on what the step made: in this sweep if they come after r,
            # else in the next one (written out for both products: this loop is the hot path).
            arrive[p] = fp
            if p in parked:
                for w in parked.pop(p):
                    if w > r:
                        now |= 1 << w
                    else:
                        later |= 1 << w
            if q >= 0:  # the backward half of an OVERLAP
                arrive[q] = fq
                if q in parked:
                    for w in parked.pop(q):
                        if w > r:
                            now |= 1 << w
                        else:
                            later |= 1 << w
            k += 1
        cursor[r], free[r] = k, f
