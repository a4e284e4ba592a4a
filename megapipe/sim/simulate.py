"""Event simulation of a Schedule under a cost model: when each action runs, and what it costs.

Each rank runs its actions in order, one at a time. An action starts when the previous action
of its rank has ended and every input it needs has arrived:

- F of stage s, microbatch i: F of the previous stage of i's pipeline (none for a first stage);
- B or I of stage s: F of stage s, and B/I of the next stage (none for a last stage);
- W of stage s: I of stage s;
- OVERLAP: the inputs of both halves (the combined step starts when both are there).

An input produced on another rank arrives ``costs.p2p_latency`` after its producer ends. Both
halves of an OVERLAP hand their outputs on when the OVERLAP ends, except when actions are timed
node by node (``Costs.nodes``): then each half hands its output on as the executor's early
sends do (``programs.half_ends``). Bidirectional schedules (DualPipe) follow
``Schedule.stages_for``/``next_stage``.
SEND/RECV actions of a lowered schedule are skipped: their cost is the P2P latency.

The actions are timed by the in-order engine (``megapipe.schedule.timing.engine``: the round robin
of the ranks, in O(actions)); the metrics come from all pieces at once (``action_costs``); the
timeline of ``TimedAction`` objects is made only when asked for.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..schedule.checks.table_checks import faults
from ..schedule.errors import ScheduleError
from ..schedule.ir import Action, Schedule
from ..schedule.overlap_pass.in_flight import peak_of_events
from ..schedule.p2p.early_sends import executor_rule
from ..schedule.table import OVERLAP, B, F, I, is_comm
from ..schedule.timing.deps import Product, missing_needs
from ..schedule.timing.engine import ActionTimes
from ..schedule.timing.intervals import uncovered_length
from ..schedule.timing.retime import time_actions
from ..schedule.timing.timeline import ActionGraph, MadeTimes
from .action_costs import COMM, COMPUTE, ActionCosts
from .costs import Costs
from .programs import Segment, time_action
from .result import SimResult, TimedAction

__all__ = ["SimResult", "TimedAction", "simulate"]


def _product_text(product: Product) -> str:
    kind, stage, mb = product
    return f"{stage}{'B/I' if kind == 'G' else kind}{mb}"


def _check_actions(schedule: Schedule, work: Schedule) -> None:
    """Every computation's stage and microbatch exist, its stage is on its rank and in its
    microbatch's pipeline; the first that is not is named (with its whole action)."""
    comps = work.table.comps()
    s, m = schedule.num_stages, schedule.num_microbatches
    found = faults(schedule, comps)
    bad = np.flatnonzero(found.no_stage | found.misplaced | found.no_mb | found.outside)
    if not len(bad):
        return
    c = int(bad[0])
    rank, stage, mb = int(comps.rank[c]), int(comps.stage[c]), int(comps.mb[c])
    action = work.action_at(comps.action[c])
    if found.no_stage[c]:
        rule = f"stage {stage} does not exist ({s} stages)"
    elif found.misplaced[c]:
        rule = f"stage {stage} is placed on rank {int(found.owner[c])}"
    elif found.no_mb[c]:
        rule = f"microbatch {mb} does not exist ({m} microbatches)"
    else:
        rule = f"microbatch {mb} does not flow through stage {stage}"
    raise ScheduleError(rule, rank, action)


def simulate(schedule: Schedule, costs: Costs = Costs()) -> SimResult:
    """Run ``schedule`` under ``costs``; raise ScheduleError if it cannot finish (a deadlock)."""
    costs.check_stages(schedule.num_stages)
    table = schedule.table
    work = (
        schedule
        if table.compute_only
        else schedule.replace_actions(table.select(~is_comm(table.kind)))
    )
    _check_actions(schedule, work)
    if costs.nodes is not None and costs.nodes.early_sends is None and table.has_overlap:
        costs = replace(costs, nodes=replace(costs.nodes, early_sends=executor_rule(work)))
    pieces = ActionCosts(work.table, costs, schedule.num_stages)
    duration = pieces.durations() if pieces.exact else np.zeros(len(work.table))
    graph = ActionGraph.build(work, duration, costs.p2p_latency)
    if not pieces.exact:
        graph.inputs.end_of = pieces.end_of
    if costs.nodes is not None and table.has_overlap:
        graph.inputs.made_at = pieces.made_at
    timed = time_actions(work, graph, graph.watch)
    if timed.remade is not None:
        _raise_remade(work, graph, timed)
    if timed.stuck:
        _raise_stuck(schedule, work, graph, timed)
    return _result(schedule, work, pieces, timed, costs)


def _raise_remade(work: Schedule, graph: ActionGraph, timed: ActionTimes) -> None:
    assert timed.remade is not None  # the caller's test
    row, first, product = timed.remade
    table = work.table
    rank, first_rank = int(table.rank[row]), int(table.rank[first])
    action, first_action = work.action_at(row), work.action_at(first)
    raise ScheduleError(
        f"{_product_text(graph.space.product(product))} runs twice "
        f"(also in {first_action} on rank {first_rank})",
        rank,
        action,
    )


def _raise_stuck(
    schedule: Schedule, work: Schedule, graph: ActionGraph, timed: ActionTimes
) -> None:
    done = MadeTimes(graph.space, timed.arrive)
    waits = []
    for rank, row in timed.stuck.items():
        action = work.row(rank)[row - int(work.table.offsets[rank])]
        missing = [_product_text(k) for k in missing_needs(schedule, action, done)]
        waits.append(f"rank {rank} at {action} waits for {', '.join(missing)}")
    raise ScheduleError("the schedule cannot finish (deadlock): " + "; ".join(waits))


def _sum(values: np.ndarray):
    """``sum(values)`` as Python adds a list: 0 when empty, else left to right."""
    return float(np.cumsum(values)[-1]) if len(values) else 0


def _result(
    schedule: Schedule, work: Schedule, pieces: ActionCosts, timed: ActionTimes, costs: Costs
) -> SimResult:
    table = work.table
    start = np.asarray(timed.start, dtype=np.float64)
    end = np.asarray(timed.end, dtype=np.float64)
    by_stream = pieces.pieces(start)
    compute, comm = by_stream[COMPUTE], by_stream[COMM]
    takes = (table.kind == F) | (table.kind == OVERLAP)
    releases = (table.kind == B) | (table.kind == I) | (table.kind == OVERLAP)
    metrics: list[list] = [[], [], [], []]
    for rank in range(table.pp):
        lo, hi = int(table.offsets[rank]), int(table.offsets[rank + 1])
        c_begin, c_end = _rank_pieces(compute, lo, hi)
        t_begin, t_end = _rank_pieces(comm, lo, hi)
        metrics[0].append(_sum(c_end - c_begin))
        metrics[1].append(_sum(t_end - t_begin))
        metrics[2].append(uncovered_length(t_begin, t_end, c_begin, c_end))
        metrics[3].append(peak_of_events(start[lo:hi][takes[lo:hi]], end[lo:hi][releases[lo:hi]]))
    return SimResult(
        name=schedule.name,
        costs=costs,
        makespan=float(end.max()) if len(end) else 0.0,
        busy=tuple(metrics[0]),
        comm=tuple(metrics[1]),
        exposed_comm=tuple(metrics[2]),
        peak_in_flight=tuple(metrics[3]),
        make_timeline=lambda: _timeline(work, timed, costs),
    )


def _rank_pieces(pieces, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """The pieces of actions lo..hi-1 (rows) that take time, in order."""
    begin, end, rows = pieces
    a, b = np.searchsorted(rows, [lo, hi])
    begin, end = begin[a:b], end[a:b]
    keep = end > begin
    return begin[keep], end[keep]


def _half(rank: int, half: Action, segments: tuple[Segment, ...]) -> TimedAction:
    own = [s for s in segments if s.action == half]
    start, end = min(s.start for s in own), max(s.end for s in own)
    return TimedAction(rank, half, start, end, (), tuple(own))


def _timeline(work: Schedule, timed: ActionTimes, costs: Costs) -> tuple[TimedAction, ...]:
    """The actions in the sequence the timing took them (sweep, rank, list order), with pieces."""
    table = work.table
    order = np.lexsort((np.arange(len(table)), np.asarray(timed.sweep)))
    out = []
    for row in order.tolist():
        rank = int(table.rank[row])
        action = work.row(rank)[row - int(table.offsets[rank])]
        start, end = float(timed.start[row]), float(timed.end[row])
        segments = time_action(action, start, costs)
        halves: tuple[TimedAction, ...] = ()
        if action.kind is action.kind.OVERLAP:
            halves = tuple(_half(rank, h, segments) for h in action.computations())
        out.append(TimedAction(rank, action, start, end, halves, segments))
    return tuple(out)
