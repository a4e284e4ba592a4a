"""The overlap pass: turn an F/B (or F/I/W) schedule into a combined one of OVERLAP pairs.

An OVERLAP ``(sF i; s'B j)`` runs the forward of microbatch i beside the backward of microbatch j
so that each one's all-to-all hides behind the other's compute (docs/combined-step.md).

The pass is one mechanism applied to each rank's list, whatever schedule made it: rank r runs
``e_r`` extra warmup forwards and fuses backwards with later forwards (``partners`` says which
with which). A pair's halves are independent: a backward of microbatch j follows every
forward of j, so its partner (a later forward) is another microbatch (``pair_is_independent``).

Why one extra forward is not always enough. A pair hands both outputs on only when it ends, so a
hop between two ranks now costs a whole pair. In plain 1F1B with ``e_r = 1`` rank r's pairs are
``(F_{j+w_r+1}; B_j)`` (``w_r = pp-r-1``): the pair holding B_i on rank r waits for rank r+1's
pair holding B_i, which waits for rank r's F output that lies in rank r's *previous* pair, so
adjacent ranks take turns and every turn costs two pairs (at pp=8, M=16, F=1, B=2 the bubble
grows from 21 to 63). With ``e_r`` extras, rank r+1's pair holding B_i needs rank r's pair
holding ``B_{i-1+e_{r+1}-e_r}``; the steady state runs one pair per turn only if
``e_r >= e_{r+1} + 1``. The smallest such choice is the *chain* ``e_r = pp - r`` (warmup
``2(pp-r-1) + 1``: Megatron's interleaved warmup formula plus one). Interleaved 1F1B already
has that factor 2 in its warmup, and the chunks give slack, so Megatron's ``e_r = 1`` suffices
there; it also keeps pp=1 at Megatron's exact order ``F0 (F1;B0) ... B(M-1)``.

Candidates, least memory first (``pairing_candidates``): *megatron* (``e_r = 1``, every pair),
*cross-stage* (``e_r = 1``, only pairs of two different stages, offered when a rank holds stages
that send to different neighbours, as in V placement: there such a pair takes both inputs from
one neighbour and feeds the other, so it does not ping-pong like a same-stage pair) and the
*chain*. Each runs on the dependency timeline
(``timeline.timeline``: F=1, B=2, I=W=1, a pair the sum of its halves, i.e. free communication,
where pairing gains nothing). The target is the original's makespan plus one pair (F + B, or
F + I). The first candidate that has pairs and ends by the target is taken (interleaved 1F1B:
megatron; 1F1B and ZB1P with M >= 2 pp: the chain, which ends exactly with the original; with
fewer microbatches megatron may already end in time). If none does (ZBV:
its last microbatches' forwards climb the V through pairs), the fastest is refined: each round
splits, on each rank, the latest pair on the timeline's critical path (the forward going back
behind its backward) until it ends in time.

Guarantee (free communication, the timeline above): the result ends at most one pair after the
original. Proof for the refinement of an ``e_r = 1`` pairing: splitting every pair gives the
original order back, and once no pair lies on the critical path that path is a chain of waits
the original has too (unpaired actions keep their order), so it is no longer than the
original's makespan; rounds stop at the latest there. If every candidate would lose all its
pairs, the original schedule is returned unpaired (pairing cannot help then; no registered
schedule with M >= 2 comes to that).
With real all-to-all the pairs hide it and the step gets shorter (tests/sim/test_overlap_gain).

Memory (``peak_in_flight``): a rank holds at most ``e_r`` more microbatch activations than in
the original schedule: +1 with megatron and cross-stage, ``pp - r`` more with the chain, so
plain 1F1B's peak doubles from ``pp - r`` to ``2(pp - r)`` stage activations. For comparison,
Megatron's interleaved 1F1B with vpp=2 holds ``3pp - 1`` half-stage chunks (about ``1.5 pp``
stage activations) on rank 0. That is the honest price of pairing a one-chunk pipeline.

Fusing can make ranks wait on each other in a cycle (a pair needing, through another rank, the
output of its own other half). While a paired schedule is stuck, the stuck pairs whose backward
could run alone (or, if none could, every stuck pair) are split the same way; with
``e_r = 1`` that ends at the original order, which runs; a chain candidate that is stuck is
dropped. Schedules that already hold OVERLAP actions (DualPipe, DualPipeV) pass unchanged;
schedules with no forward after a backward (GPipe, looped BFS) get no pairs.

Cost: two to four timeline timings (original, candidates) plus one per refinement round. The
first candidate is timed first, on the engine; the original is then timed in that timing's
sequence (each pair's backward, then its forward: ``timeline_in_sequence``, a retiming checked as
it goes, which falls back to the engine where a W sat between a pair's halves). A round's timing
starts from the previous one's times before the first split pair (``timeline_after_change``), and
the final schedule keeps its timeline and sweep sequence, so lowering and validation do not time
it again and ``simulate`` retimes it in that sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import ScheduleError
from ..ir import Kind, Schedule
from ..table import B, I
from ..timing.deps import DEFAULT_DURATIONS, missing_needs
from ..timing.retime import SWEEP_SEQUENCE
from ..timing.timeline import (
    STRUCTURES,
    TIMELINES,
    Timeline,
    timeline,
    timeline_after_change,
    timeline_in_sequence,
)
from .in_flight import peak_in_flight  # noqa: F401 - the memory bound of the docstring
from .partners import Candidates, assemble, find_pairs, pair_is_independent  # noqa: F401


@dataclass(frozen=True)
class Pairing:
    """One way to pair a schedule: per-rank extra warmup forwards, and which pairs are allowed."""

    name: str
    extra: tuple[int, ...]
    cross_stage_only: bool = False


def pairing_candidates(schedule: Schedule) -> list[Pairing]:
    """The pairings the pass tries, least memory first (module docstring)."""
    pp = schedule.pp
    candidates = [Pairing("megatron", (1,) * pp)]
    if _opposite_flows(schedule):
        candidates.append(Pairing("cross-stage", (1,) * pp, cross_stage_only=True))
    chain = tuple(pp - rank for rank in range(pp))
    if chain != candidates[0].extra:
        candidates.append(Pairing("chain", chain))
    return candidates


def _opposite_flows(schedule: Schedule) -> bool:
    """Whether some rank holds two stages whose outputs go to different ranks (V placement,
    DualPipe): only there can a pair of two stages take both inputs from one side."""
    for rank in range(schedule.pp):
        targets = {
            schedule.stage_to_rank[after]
            for stage in schedule.stages_of_rank(rank)
            if (after := schedule.next_stage(stage)) is not None
            and schedule.stage_to_rank[after] != rank
        }
        if len(targets) > 1:
            return True
    return False


def makespan(timed: Timeline) -> float:
    """When the last action of a timeline ends."""
    return timed.makespan


def critical_path(schedule: Schedule, timed: Timeline) -> list[tuple[int, int]]:
    """(rank, index) of the actions on a longest chain of waits ending at the last action.

    Walking back from the action that ends last, each hop goes to whatever made the action
    start when it did: a product from another rank (the last such need, in need order), or else
    the previous action of its rank. A product made twice counts at its last maker in rank order.
    """
    table = timed.graph.table
    offsets = table.offsets.tolist()
    last = [
        (float(timed.end_flat[hi - 1]), r)
        for r, (lo, hi) in enumerate(zip(offsets, offsets[1:]))
        if hi > lo
    ]
    if not last:
        return []
    before = _waited_for(timed)  # walked hop by hop: a path is short next to the table
    rank_of = table.rank
    k = offsets[max(last)[1] + 1] - 1
    path = []
    while k >= 0:
        path.append(k)
        k = int(before[k])
    path.reverse()
    ranks = rank_of[path].tolist()
    return [(r, k - offsets[r]) for r, k in zip(ranks, path)]


def _waited_for(timed: Timeline) -> np.ndarray:
    """Per action, the action it waited for last (module docstring of ``critical_path``), or -1
    if it started at once."""
    graph, table = timed.graph, timed.graph.table
    start, end, rank = timed.start_flat, timed.end_flat, table.rank
    maker = graph.makers()
    before = np.full(len(table), -1, dtype=np.int64)
    for j in range(graph.need.shape[1]):  # a later need wins
        needed = graph.need[:, j]
        made_by = maker[np.where(needed >= 0, needed, graph.space.never)]
        ok = (made_by >= 0) & (rank[made_by] != rank) & (end[made_by] == start)
        before = np.where(ok, made_by, before)
    row = np.arange(len(table))
    previous = (before < 0) & (row > table.offsets[rank])
    previous &= end[np.maximum(row - 1, 0)] == start
    return np.where(previous, row - 1, before)


@dataclass
class _Attempt:
    """A pairing being built: its candidate pairs, which are still fused, and the latest timing
    (``rows``: per row of the combined schedule, the pair it holds or -1; ``source``: the row
    of the original it comes from, a pair's backward's)."""

    pairing: Pairing
    pairs: Candidates
    fused: np.ndarray
    combined: Schedule | None = None
    timed: Timeline | None = None
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    source: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def built(self) -> tuple[Schedule, Timeline]:
        """The combined schedule and its timeline, as the latest ``_rebuild`` built them."""
        assert self.combined is not None and self.timed is not None, "not built yet"
        return self.combined, self.timed

    def original_sequence(self) -> np.ndarray | None:
        """The rows of the original in the sequence the latest timing took them (each pair's
        backward, then its forward), if that timing kept its sequence (``retime.time_actions``)."""
        found = SWEEP_SEQUENCE.of(self.built()[0])
        if found is None:
            return None
        taken = found.sequence
        pair = self.rows[taken]
        mate = (
            np.where(pair >= 0, self.pairs.forward[np.maximum(pair, 0)], -1)
            if len(self.pairs.forward)
            else np.full(len(taken), -1)
        )
        both = np.stack([self.source[taken], mate], axis=1).reshape(-1)
        return both[both >= 0]

    @property
    def paired(self) -> int:
        return int(self.fused.sum())


def _rebuild(schedule: Schedule, attempt: _Attempt, split: np.ndarray) -> None:
    """Assemble and run ``attempt`` again after splitting the pairs ``split`` (ids)."""
    extra = np.asarray(attempt.pairing.extra, dtype=np.int64)
    table, rows, source = assemble(schedule.table, attempt.pairs, attempt.fused, extra)
    combined = schedule.replace_actions(table)
    if attempt.timed is None or not len(split):
        timed = timeline(combined)
    else:
        before = attempt.built()[0].table
        first = np.full(before.pp, np.iinfo(np.int64).max)
        at = np.flatnonzero(np.isin(attempt.rows, split))
        np.minimum.at(first, before.rank[at], before.local_index[at])
        same = np.minimum(first, np.diff(before.offsets)).tolist()
        timed = timeline_after_change(combined, attempt.timed, same)
    attempt.combined, attempt.timed, attempt.rows, attempt.source = combined, timed, rows, source


def _splits(schedule: Schedule, attempt: _Attempt, target: float) -> np.ndarray | None:
    """The pairs to split next (ids), or None if the attempt runs and ends by ``target``.

    A stuck schedule loses its stuck pairs whose backward could run alone (those wait only for
    their forward's input, so splitting lets the backward go first as before pairing), or, if
    none could, every stuck pair. A late one loses, on each rank, the latest pair on the
    critical path.
    """
    combined, timed = attempt.built()
    table = combined.table
    if timed.stuck:
        stuck = {r: int(attempt.rows[table.offsets[r] + i]) for r, i in timed.stuck.items()}
        stuck = {r: pair for r, pair in stuck.items() if pair >= 0}
        blocking = [
            pair
            for r, pair in stuck.items()
            if not missing_needs(
                schedule, schedule.action_at(attempt.pairs.backward[pair]), timed.made
            )
        ]
        return np.array(blocking or list(stuck.values()), dtype=np.int64)
    if timed.makespan <= target:
        return None
    latest: dict[int, int] = {}
    for r, i in critical_path(combined, timed):
        pair = int(attempt.rows[table.offsets[r] + i])
        if pair >= 0:
            latest[r] = pair
    return np.array(list(latest.values()), dtype=np.int64)


def _settle(schedule: Schedule, attempt: _Attempt, target: float) -> bool:
    """Split pairs of ``attempt`` until its schedule runs and ends by ``target``; False if no
    split is left that could get there. A split puts the forward back behind its backward."""
    if attempt.timed is None:
        _rebuild(schedule, attempt, np.zeros(0, np.int64))
    while True:
        if attempt.built()[1].stuck and max(attempt.pairing.extra) > 1:
            return False  # splits would not lead back to the original order
        split = _splits(schedule, attempt, target)
        if split is None:
            return True
        if not len(split):
            return False
        attempt.fused[split] = False
        _rebuild(schedule, attempt, split)


def apply_overlap(schedule: Schedule) -> Schedule:
    """The combined version of ``schedule`` (see the module docstring for the rule).

    Raises ``ScheduleError`` if ``schedule`` itself cannot run to the end (its ranks wait on each
    other), since no pairing can repair that.
    """
    table = schedule.table
    if table.has_overlap:
        return schedule
    if not table.compute_only:
        raise ScheduleError(
            "the overlap pass takes a compute-only schedule; pair before lowering (SEND/RECV)"
        )
    pairings = pairing_candidates(schedule)
    first = _new_attempt(table, pairings[0])  # its timing gives the original's timeline a sequence
    _rebuild(schedule, first, np.zeros(0, np.int64))
    original = timeline_in_sequence(schedule, first.original_sequence())
    if original.stuck:
        rank, index = next(iter(original.stuck.items()))
        raise ScheduleError(
            "cannot pair a schedule whose ranks wait on each other before pairing "
            f"(stuck ranks: {sorted(original.stuck)})",
            rank,
            schedule.row(rank)[index],
        )
    target = original.makespan + _longest_pair(schedule)
    settled = []
    for pairing in pairings:
        attempt = first if pairing is pairings[0] else _new_attempt(table, pairing)
        if not _settle(schedule, attempt, math.inf) or not attempt.paired:
            continue
        combined, timed = attempt.built()
        if timed.makespan <= target:
            return _finish(schedule, combined)
        settled.append(attempt)
    # None ends in time as paired: refine the fastest first (most pairs on a tie). Splitting
    # every pair of an ``e_r = 1`` pairing gives back the original order, so the refinement
    # always ends in time, in the worst case with no pair left (pairing cannot help then).
    settled.sort(key=lambda a: (a.built()[1].makespan, -a.paired))
    for attempt in settled:
        if _settle(schedule, attempt, target) and attempt.paired:
            return _finish(schedule, attempt.built()[0])
    return _finish(schedule, schedule)


def _new_attempt(table, pairing: Pairing) -> _Attempt:
    """Every candidate pair of ``pairing`` fused, not run yet."""
    pairs = find_pairs(table, np.asarray(pairing.extra, dtype=np.int64), pairing.cross_stage_only)
    return _Attempt(pairing, pairs, np.ones(len(pairs.backward), dtype=bool))


def _longest_pair(schedule: Schedule) -> float:
    """The longest a pair can take on the timeline: F plus the longest backward present."""
    kinds = schedule.table.comps().kind
    present = [k for code, k in ((B, Kind.B), (I, Kind.I)) if (kinds == code).any()]
    backward = max((DEFAULT_DURATIONS[k] for k in present), default=0.0)
    return DEFAULT_DURATIONS[Kind.F] + backward


def _finish(schedule: Schedule, combined: Schedule) -> Schedule:
    """``combined`` with the options of ``schedule`` and overlap on, keeping its timeline."""
    result = combined.replace_actions(
        combined.table, options=replace(schedule.options, overlap=True)
    )
    timelines, structures = TIMELINES.of(combined), STRUCTURES.of(combined)  # same actions, run
    if None in timelines:
        TIMELINES.of(result)[None] = timelines[None]
    if False in structures:
        STRUCTURES.of(result)[False] = structures[False]
    SWEEP_SEQUENCE.keep(result, SWEEP_SEQUENCE.of(combined))
    return result
