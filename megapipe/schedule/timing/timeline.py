"""Timelines: when each action of a compute-only schedule runs, at given durations.

``timeline(schedule, durations)`` runs each rank's list in order, each action starting once its
rank is free and every product it needs is made (on any rank): the in-order run of ``engine``.
The overlap pass uses it to find pairs that wait on each other; lowering uses its times to
decide where a receive is posted; validation uses it to find ranks that wait on each other.
A schedule's timeline is computed once and kept with it (``TIMELINES``).

``ActionGraph`` turns a table into the engine's actions; the simulator builds its own actions with
it.
A need made by a single action earlier on the same rank is left out of the actions: it is made
before the rank gets there and ends before the rank is free, so it can neither hold the action
back nor move it (unless a latency applies to it, in which case it stays).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ..actions import Kind
from ..ir import Derived, Schedule
from ..table import CODE, OVERLAP, ActionTable, Comps, is_comm
from .deps import DEFAULT_DURATIONS
from .engine import ActionColumns, ActionInputs, ActionTimes, Prefix, time_in_order
from .flows import MAKE_LETTER, ProductSpace, comp_needs, stage_rank
from .retime import retime, time_actions

DurationKey = tuple[tuple[str, float], ...] | None  # durations, hashable (None: the defaults)
TIMELINES: Derived[dict[DurationKey, Timeline]] = Derived(dict)  # durations -> timeline
STRUCTURES: Derived[dict[bool, _Structure]] = Derived(dict)  # p2p latency or not -> structure


class MadeTimes(Mapping):
    """Product ``("F" | "G" | "W", stage, microbatch)`` -> the time it was made, for those made."""

    def __init__(self, space: ProductSpace, arrive: list[float] | np.ndarray) -> None:
        self._space = space
        self._arrive = arrive

    def __getitem__(self, key) -> float:
        pid = self._space.id_of(key)
        if pid is None or self._arrive[pid] < 0:
            raise KeyError(key)
        return float(self._arrive[pid])

    def _made(self) -> np.ndarray:
        return np.flatnonzero(np.asarray(self._arrive[: self._space.size]) >= 0)

    def __iter__(self):
        return iter(self._space.decode(self._made()))

    def __len__(self) -> int:
        return len(self._made())


@dataclass
class _Structure:
    """What a table's actions need and make, whatever their durations (``ActionGraph``)."""

    space: ProductSpace
    make: np.ndarray
    need: np.ndarray  # (n, 3) cells
    columns: ActionColumns
    unique: bool
    watch: frozenset


@dataclass
class ActionGraph:
    """A table as engine actions: per action up to three needs (cells), two products, a duration.

    ``make`` is (n, 2) product ids (-1: none); ``unique`` says every product has one maker;
    ``watch`` holds the products made more than once.
    """

    table: ActionTable
    space: ProductSpace
    make: np.ndarray
    need: np.ndarray
    duration: np.ndarray
    inputs: ActionInputs
    unique: bool
    watch: frozenset
    _makers: np.ndarray | None = field(default=None, repr=False)

    @classmethod
    def build(cls, schedule: Schedule, duration: np.ndarray, latency: float = 0.0) -> ActionGraph:
        """The actions of ``schedule`` (compute-only) with these durations and p2p latency; what
        they need and make is worked out once per schedule (``STRUCTURES``)."""
        structures = STRUCTURES.of(schedule)
        if bool(latency) not in structures:
            structures[bool(latency)] = _structure(schedule, latency)
        found = structures[bool(latency)]
        actions = ActionInputs(found.columns, duration, found.space.size, latency)
        return cls(
            schedule.table,
            found.space,
            found.make,
            found.need,
            duration,
            actions,
            found.unique,
            found.watch,
        )

    def makers(self) -> np.ndarray:
        """Per engine cell: the row of the product's last maker (rank order), -1 if none (made
        once per graph: the overlap pass, the retiming and the lowered schedule's proof ask
        for it)."""
        if self._makers is None:
            self._makers = self._find_makers()
        return self._makers

    def _find_makers(self) -> np.ndarray:
        out = np.full(2 * self.space.size + 1, -1, dtype=np.int64)
        rows = np.repeat(np.arange(len(self.table)), 2)
        made = self.make.reshape(-1)
        if self.unique:
            out[made[made >= 0]] = rows[made >= 0]
        else:
            np.maximum.at(out, made[made >= 0], rows[made >= 0])
        out[self.space.size : 2 * self.space.size] = out[: self.space.size]
        return out


def _structure(schedule: Schedule, latency: float) -> _Structure:
    table = schedule.table
    comps = table.comps()
    space = ProductSpace.covering(comps.stage, comps.mb)
    made = space.ids(MAKE_LETTER[comps.kind], comps.stage, comps.mb)
    count = np.bincount(made, minlength=space.size)
    maker = np.full(space.size + 1, -1, dtype=np.int64)
    single = count[made] == 1
    maker[made[single]] = comps.action[single]
    # Each action's dynamic needs, in order (forward half's first), packed into three columns.
    need = np.full((3, len(table)), -1, dtype=np.int64)  # need.T is the (n, 3) table: no copy
    columns = list(need)
    filled = np.zeros(len(table), dtype=np.int64)
    needs = comp_needs(schedule, comps)
    cells = [_need_cell(schedule, comps, need, space, maker, table.rank, latency) for need in needs]
    halves = (0, 1) if table.has_overlap else (0,)
    for half in halves:
        in_half = comps.half == half
        for cell in cells:
            wanted = np.flatnonzero((cell >= 0) & in_half)
            actions = comps.action[wanted]
            place = filled[actions]
            for j, column in enumerate(columns):
                at = place == j
                column[actions[at]] = cell[wanted[at]]
            filled[actions] += 1
    make = np.full((len(table), 2), -1, dtype=np.int64)
    make[comps.action, comps.half] = made
    repeated = np.flatnonzero(count > 1)
    return _Structure(
        space,
        make,
        need.T,
        ActionColumns(table.offsets, need, make),
        len(repeated) == 0,
        frozenset(repeated.tolist()),
    )


def _need_cell(
    schedule: Schedule,
    comps: Comps,
    need,
    space: ProductSpace,
    maker: np.ndarray,
    rank_of: np.ndarray,
    latency: float,
) -> np.ndarray:
    """The engine cell of one need of each computation, -1 where it has none or the need is
    settled statically (its only maker runs earlier on the same rank, with no latency)."""
    pid = np.where(need.exists, space.ids(need.letter, need.stage, comps.mb), -1)
    known = (pid >= 0) & (pid < space.size)
    late = known & (stage_rank(schedule, need.stage) != comps.rank) if latency else ~known & known
    source = maker[np.where(known, pid, space.size)]
    static = known & ~late & (source >= 0) & (source < comps.action)
    static &= rank_of[np.maximum(source, 0)] == comps.rank
    return np.where(static, -1, np.where(late, pid + space.size, pid))


class Timeline:
    """The times of a compute-only schedule: ``start[r][k]`` and ``end[r][k]`` of rank r's
    k-th action.

    ``stuck`` maps each rank that could not finish to the index of the action it waits at (empty
    when it finished); times from a stuck index on are -1. ``made`` maps each product made to
    the time it was made. ``start_flat``/``end_flat`` hold the same times as arrays, ranks one
    after another (``offsets``).
    """

    def __init__(self, graph: ActionGraph, timed: ActionTimes) -> None:
        self.graph = graph
        self.offsets = graph.table.offsets
        self.start_list, self.end_list = timed.start, timed.end
        self.arrive = timed.arrive
        self.stuck = {r: k - int(self.offsets[r]) for r, k in timed.stuck.items()}
        self.made = MadeTimes(graph.space, timed.arrive)

    @functools.cached_property
    def start_flat(self) -> np.ndarray:
        return np.asarray(self.start_list, dtype=np.float64)

    @functools.cached_property
    def end_flat(self) -> np.ndarray:
        return np.asarray(self.end_list, dtype=np.float64)

    def _per_rank(self, flat: np.ndarray) -> tuple[tuple[float, ...], ...]:
        return tuple(tuple(flat[lo:hi].tolist()) for lo, hi in zip(self.offsets, self.offsets[1:]))

    @property
    def start(self) -> tuple[tuple[float, ...], ...]:
        return self._per_rank(self.start_flat)

    @property
    def end(self) -> tuple[tuple[float, ...], ...]:
        return self._per_rank(self.end_flat)

    @functools.cached_property
    def makespan(self) -> float:
        """When the last action ends (-1 entries included, as the old tuple max did)."""
        return float(self.end_flat.max()) if len(self.end_list) else 0.0


def check_durations(durations: dict | None) -> dict:
    """The durations to use (``DEFAULT_DURATIONS`` if None), each of F, B, I, W positive."""
    durations = dict(DEFAULT_DURATIONS if durations is None else durations)
    for kind in (Kind.F, Kind.B, Kind.I, Kind.W):
        value = durations.get(kind)
        if not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"durations[{kind.value}] must be a positive number, got {value!r}")
    return durations


def action_durations(table: ActionTable, durations: dict) -> np.ndarray:
    """Each action's duration: its kind's, and an OVERLAP's that of ``Kind.OVERLAP`` if given,
    else the sum of its halves."""
    by_code = np.zeros(len(CODE), dtype=np.float64)
    for kind in (Kind.F, Kind.B, Kind.I, Kind.W):
        by_code[CODE[kind]] = durations[kind]
    out = by_code[table.kind]
    pairs = table.kind == OVERLAP
    if Kind.OVERLAP in durations:
        out[pairs] = durations[Kind.OVERLAP]
    else:
        out[pairs] = by_code[CODE[Kind.F]] + by_code[table.back_kind[pairs]]
    return out


def duration_key(durations: dict | None) -> DurationKey:
    """A hashable stand-in for ``durations`` (the keys of ``TIMELINES`` and ``LOWERED``)."""
    return None if durations is None else tuple(sorted((k.value, v) for k, v in durations.items()))


def timeline(schedule: Schedule, durations: dict[Kind, float] | None = None) -> Timeline:
    """Time a compute-only schedule: each rank runs its list in order, each action starting once
    its rank is free and every product it needs is made (on any rank).

    A product needed from the same rank but made later in its list can never come, so such a
    rank is reported stuck like one in a cycle of waits. ``durations`` maps F, B, I, W (and
    optionally OVERLAP) to positive numbers; default ``DEFAULT_DURATIONS``.
    """
    key, kept = duration_key(durations), TIMELINES.of(schedule)
    if key in kept:
        return kept[key]
    durations = check_durations(durations)
    table = schedule.table
    comm = np.flatnonzero(is_comm(table.kind))
    if len(comm):
        rank = int(table.rank[comm[0]])
        action = schedule.action_at(comm[0])
        raise ValueError(f"timeline runs compute-only schedules; rank {rank} holds {action}")
    graph = ActionGraph.build(schedule, action_durations(table, durations))
    result = Timeline(graph, time_actions(schedule, graph))
    kept[key] = result
    return result


def timeline_in_sequence(schedule: Schedule, sequence: np.ndarray | None) -> Timeline:
    """``timeline(schedule)`` (default durations), computed in ``sequence`` (a guess, e.g. from
    the timing of a schedule with the same actions fused in pairs) where the actions can run in
    that sequence with one maker per product (``retime.retime``), else as ``timeline`` times it."""
    if None in TIMELINES.of(schedule) or sequence is None:
        return timeline(schedule)
    graph = ActionGraph.build(schedule, action_durations(schedule.table, dict(DEFAULT_DURATIONS)))
    timed = retime(graph, sequence, None) if graph.unique else None
    if timed is None:
        return timeline(schedule)
    result = Timeline(graph, timed)
    TIMELINES.of(schedule)[None] = result
    return result


def timeline_after_change(schedule: Schedule, before: Timeline, same: list[int]) -> Timeline:
    """``timeline(schedule)`` (default durations), given the timeline ``before`` of a schedule
    whose rank r started with the same ``same[r]`` actions.

    Every action that started before the earliest changed one did so for the same reasons, so it
    keeps its times; the timing resumes from there. Only where each product has one maker (the
    result then does not depend on the order actions run in); otherwise it runs afresh.
    """
    if None in TIMELINES.of(schedule):
        return TIMELINES.of(schedule)[None]
    table = schedule.table
    graph = ActionGraph.build(schedule, action_durations(table, dict(DEFAULT_DURATIONS)))
    if not (graph.unique and before.graph.unique):
        return timeline(schedule)
    old = before.offsets
    cut = np.inf
    for r, keep in enumerate(same):
        if old[r] + keep < old[r + 1] and before.start_flat[old[r] + keep] >= 0:
            cut = min(cut, float(before.start_flat[old[r] + keep]))
    done = []
    for r in range(len(same)):
        starts = before.start_flat[old[r] : old[r + 1]]
        ran = starts[: np.searchsorted(starts < 0, True)] if len(starts) else starts
        done.append(int(np.searchsorted(ran, cut, "left")))
    prefix = _prefix(graph, before, done)
    result = Timeline(graph, time_in_order(graph.inputs, prefix=prefix))
    TIMELINES.of(schedule)[None] = result
    return result


def _prefix(graph: ActionGraph, before: Timeline, done: list[int]) -> Prefix | None:
    """The state after the first ``done[r]`` actions of each rank, taken from ``before``: their
    times, and every product but those of the later actions ``before`` ran."""
    if graph.space != before.graph.space:
        return None
    new, old = graph.table.offsets.tolist(), before.offsets.tolist()
    start = np.full(new[-1], -1.0)
    end = np.full(new[-1], -1.0)
    free, dropped = [], []
    for r, count in enumerate(done):
        lo, at = old[r], new[r]
        start[at : at + count] = before.start_flat[lo : lo + count]
        end[at : at + count] = before.end_flat[lo : lo + count]
        free.append(float(before.end_flat[lo + count - 1]) if count else 0.0)
        dropped.append(before.graph.make[lo + count : old[r + 1]].reshape(-1))
    arrive = np.array(before.arrive, dtype=np.float64)  # a copy: ``before`` keeps its own
    products = np.concatenate(dropped)
    arrive[products[products >= 0]] = -1.0
    return Prefix(done, free, start, end, arrive)
