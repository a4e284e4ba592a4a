"""The in-order engine both the timeline and the simulator use: every rank runs its list in order,
each action once every product it needs has arrived; each product is looked at once per wait.

Semantics (the definition the schedule layer has always had): the ranks are swept round robin,
0 to pp-1, each running as far as it can, until a sweep moves nothing. ``time_in_order`` gives
exactly that result, order included (a product made twice is read as it stood when the reader
ran), without retrying blocked ranks: a rank that waits is parked on the product it waits for
and woken when it is made, in the sweep where the round robin would have moved it (this sweep if
its maker has a lower rank, the next one otherwise). Work is O(actions + waits).

Products are integers below ``space``; a need is a cell: ``p`` for product p as made, or
``space + p`` for product p as it arrives from another rank (made + ``delay``). The loops
themselves are in ``loops`` (Python, or compiled where numba is installed).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from . import loops


class ActionColumns:
    """What each action needs and makes, as int64 columns (``need``: (3, n) cells, -1 none;
    ``make``: (n, 2) products, -1 none) and the ranks' ``offsets``; their lists are made once,
    when a loop runs in Python (``loops``)."""

    def __init__(self, offsets: np.ndarray, need: np.ndarray, make: np.ndarray) -> None:
        self.arrays = (
            np.array(offsets, dtype=np.int64),  # writable: one compiled signature
            *(np.ascontiguousarray(c, dtype=np.int64) for c in need),
            *(np.ascontiguousarray(make[:, h], dtype=np.int64) for h in (0, 1)),
        )

    @functools.cached_property
    def lists(self) -> tuple[list, ...]:
        """offsets, need0, need1, need2, make0, make1 as lists (a column of -1 as one repeated
        object, cheaply)."""
        return tuple([-1] * len(c) if not (c >= 0).any() else c.tolist() for c in self.arrays)


@dataclass
class ActionInputs:
    """Flat per-action inputs; rank r's actions are ``offsets[r]:offsets[r + 1]`` (``columns``).

    ``columns``: the cells each action waits for and the products it makes; ``duration``: end =
    start + duration, unless ``end_of(action, start)`` is given. ``delay`` is added to a product
    for readers of cell ``space + p``. ``made_at(action, start, end)``, if given, says when the
    action's two products are made (an OVERLAP whose halves hand their outputs on before it ends:
    early sends); else both at its end.
    """

    columns: ActionColumns
    duration: np.ndarray
    space: int
    delay: float = 0.0
    end_of: Callable[[int, float], float] | None = None
    made_at: Callable[[int, float, float], tuple[float, float]] | None = None

    @property
    def offsets(self) -> np.ndarray:
        return self.columns.arrays[0]


@dataclass
class Prefix:
    """Where a timing starts when the first ``done[r]`` actions of each rank already ran (with these
    ``start``, ``end``, ``free`` per rank and cells ``arrive``): the rest is timed from there."""

    done: list[int]
    free: list[float]
    start: np.ndarray
    end: np.ndarray
    arrive: np.ndarray


@dataclass
class ActionTimes:
    """What ``time_in_order`` found: per-action start, end and sweep (-1 where an action never ran),
    the time each cell became available (``arrive``, -1.0 where never), where each stuck rank
    stopped (``{rank: action}``), and, with ``watch``, the first product made twice
    (``(action, first maker action, product)``), at which the timing stopped. The columns are lists,
    or numpy arrays where the compiled loops ran (``loops``)."""

    start: list[float] | np.ndarray
    end: list[float] | np.ndarray
    sweep: list[int] | np.ndarray | None
    arrive: list[float] | np.ndarray
    stuck: dict[int, int]
    remade: tuple[int, int, int] | None = None


class LoopColumns:
    """Columns for one of ``loops``' loops: lists where it runs in Python, numpy arrays where it
    runs compiled (the engine here, ``retime`` for its retimings)."""

    def __init__(self, compiled: bool) -> None:
        self.compiled = compiled

    def fill(self, n: int, value, dtype) -> list | np.ndarray:
        return np.full(n, value, dtype=dtype) if self.compiled else [value] * n

    def copy(self, values, dtype) -> list | np.ndarray:
        if self.compiled:
            return np.array(values, dtype=dtype)
        return values.tolist() if isinstance(values, np.ndarray) else list(values)

    def of_actions(self, actions: ActionInputs) -> tuple:
        """offsets, need0, need1, need2, make0, make1 and duration of ``actions``."""
        if self.compiled:
            return (*actions.columns.arrays, actions.duration)
        return (*actions.columns.lists, actions.duration.tolist())


def time_in_order(
    actions: ActionInputs, watch: frozenset = frozenset(), prefix: Prefix | None = None
) -> ActionTimes:
    """Time ``actions`` (module docstring). A product in ``watch`` made a second time stops the
    timing there (the simulator reports it). Cell ``2 * space`` is never filled (a need nobody
    makes). With ``prefix``, the actions it holds are taken as run; only valid where every product
    has one maker, since then the result does not depend on the sequence actions run in."""
    offsets, total, space = actions.offsets, len(actions.duration), actions.space
    pp = len(offsets) - 1
    plain = actions.end_of is None and actions.made_at is None
    compiled = loops.compiled_loops(total) if plain else None
    new = LoopColumns(compiled is not None)
    if prefix is None:
        done, free = [0] * pp, new.fill(pp, 0.0, np.float64)
        start, end = new.fill(total, -1.0, np.float64), new.fill(total, -1.0, np.float64)
        arrive = new.fill(2 * space + 1, -1.0, np.float64)
    else:
        done, free = prefix.done, new.copy(prefix.free, np.float64)
        start, end = new.copy(prefix.start, np.float64), new.copy(prefix.end, np.float64)
        arrive = new.copy(prefix.arrive, np.float64)
    cursor = new.copy([int(offsets[r]) + d for r, d in enumerate(done)], np.int64)
    watched = new.fill(space if watch else 0, False, np.bool_)
    for p in watch:
        watched[p] = True
    sweep = new.fill(total, -1, np.int64)
    row_offsets, need0, need1, need2, make0, make1, duration = new.of_actions(actions)
    remade = (compiled[0] if compiled else loops.sweep)(
        row_offsets,
        need0,
        need1,
        need2,
        make0,
        make1,
        duration,
        space,
        new.fill(space if actions.delay else 0, actions.delay, np.float64),
        watched,
        new.fill(len(watched), -1, np.int64),
        actions.end_of,
        actions.made_at,
        cursor,
        free,
        start,
        end,
        sweep,
        arrive,
        new.fill(space, -1, np.int64),
        new.fill(pp, -1, np.int64),
        new.fill(pp, -1, np.int64),
        new.fill(pp, True, np.bool_),
        new.fill(pp, False, np.bool_),
    )
    stuck = {r: int(k) for r, k in enumerate(cursor) if k < offsets[r + 1]}
    action, maker, product = remade
    found = None if action < 0 else (int(action), int(maker), int(product))
    return ActionTimes(start, end, sweep, arrive, stuck, found)
