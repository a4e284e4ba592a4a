"""Event simulation of a Schedule under a cost model: when each action runs, and what it costs.

Each rank runs its actions in order, one at a time. An action starts when the previous action
of its rank has ended and every input it needs has arrived:

- F of stage s, microbatch i: F of the previous stage of i's pipeline (none for a first stage);
- B or I of stage s: F of stage s, and B/I of the next stage (none for a last stage);
- W of stage s: I of stage s;
- OVERLAP: the inputs of both halves (the combined step starts when both are there).

An input produced on another rank arrives ``costs.p2p_latency`` after its producer ends. Both
halves of an OVERLAP hand their outputs on when the OVERLAP ends (the executor sends after the
combined step). Bidirectional schedules (DualPipe) follow ``Schedule.stages_for``/``next_stage``.
SEND/RECV actions of a lowered schedule are skipped: their cost is the P2P latency.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedule.deps import Product, missing_needs, needs_of, product_of, run_in_rank_order
from ..schedule.errors import ScheduleError
from ..schedule.in_flight import holding_change, peak_held
from ..schedule.ir import Action, Kind, Schedule
from .costs import Costs
from .intervals import uncovered_length
from .steps import COMM, COMPUTE, Segment, time_step

@dataclass(frozen=True)
class TimedAction:
    """One action of the timeline. An OVERLAP's ``halves`` are its F and its B/I, each timed
    from its first to its last piece; ``segments`` are the pieces on the two streams."""

    rank: int
    action: Action
    start: float
    end: float
    halves: tuple["TimedAction", ...] = ()
    segments: tuple[Segment, ...] = ()


@dataclass(frozen=True)
class SimResult:
    """Timeline and metrics of one simulated run of a schedule (one training step).

    Per rank: ``busy`` is compute time; ``comm`` the all-to-all time; ``exposed_comm`` the
    all-to-all time with no compute beside it (the rank waits on its own communication);
    ``idle`` = makespan - busy; ``bubble`` = idle - exposed_comm, the time spent waiting for
    other ranks. With free communication bubble = idle = makespan - busy.
    ``peak_in_flight``: the most microbatch activations held at once, counted per stage (an F
    holds one from its start until its B or I ends; for one stage per rank that is microbatches).
    """

    name: str
    costs: Costs
    makespan: float
    busy: tuple[float, ...]
    comm: tuple[float, ...]
    exposed_comm: tuple[float, ...]
    peak_in_flight: tuple[int, ...]
    timeline: tuple[TimedAction, ...]

    @property
    def pp(self) -> int:
        return len(self.busy)

    @property
    def idle(self) -> tuple[float, ...]:
        return tuple(self.makespan - b for b in self.busy)

    @property
    def bubble(self) -> tuple[float, ...]:
        return tuple(i - e for i, e in zip(self.idle, self.exposed_comm))

    @property
    def bubble_fraction(self) -> float:
        """Share of all rank-time spent waiting for other ranks."""
        total = self.makespan * self.pp
        return sum(self.bubble) / total if total else 0.0

    @property
    def exposed_comm_fraction(self) -> float:
        """Share of all-to-all time not hidden behind compute (0 when communication is free)."""
        total = sum(self.comm)
        return sum(self.exposed_comm) / total if total else 0.0

    def actions_of(self, rank: int) -> list[TimedAction]:
        return [t for t in self.timeline if t.rank == rank]

    def summary(self) -> str:
        """The metrics as a few readable lines."""

        def row(values) -> str:
            return " ".join(f"{v:g}" for v in values)

        lines = [
            f"makespan          {self.makespan:g}",
            f"bubble per rank   {row(round(b, 6) for b in self.bubble)}",
            f"bubble fraction   {self.bubble_fraction:.1%}",
            f"busy per rank     {row(round(b, 6) for b in self.busy)}",
        ]
        if sum(self.comm):
            lines.append(f"exposed a2a       {row(round(e, 6) for e in self.exposed_comm)}")
            lines.append(
                f"exposed a2a frac  {self.exposed_comm_fraction:.1%} "
                f"of {sum(self.comm):g} all-to-all time"
            )
        else:
            lines.append("exposed a2a frac  - (free all-to-all; set costs F,B,W,A2A)")
        lines.append(f"peak in flight    {row(self.peak_in_flight)} (microbatch-stages per rank)")
        return "\n".join(lines)


def _product_text(product: Product) -> str:
    kind, stage, mb = product
    return f"{stage}{'B/I' if kind == 'G' else kind}{mb}"


def _check_action(schedule: Schedule, rank: int, action: Action) -> None:
    for comp in action.computations():
        if not 0 <= comp.stage < schedule.num_stages:
            raise ScheduleError(
                f"stage {comp.stage} does not exist ({schedule.num_stages} stages)", rank, action
            )
        if schedule.stage_to_rank[comp.stage] != rank:
            raise ScheduleError(
                f"stage {comp.stage} is placed on rank {schedule.stage_to_rank[comp.stage]}",
                rank,
                action,
            )
        if not 0 <= comp.microbatch < schedule.num_microbatches:
            raise ScheduleError(
                f"microbatch {comp.microbatch} does not exist "
                f"({schedule.num_microbatches} microbatches)",
                rank,
                action,
            )
        if comp.stage not in schedule.stages_for(comp.microbatch):
            raise ScheduleError(
                f"microbatch {comp.microbatch} does not flow through stage {comp.stage}",
                rank,
                action,
            )


def _half(rank: int, half: Action, segments: tuple[Segment, ...]) -> TimedAction:
    own = [s for s in segments if s.action == half]
    start, end = min(s.start for s in own), max(s.end for s in own)
    return TimedAction(rank, half, start, end, (), tuple(own))


def _peak_in_flight(rank_actions: list[TimedAction]) -> int:
    """Most activations held at once: taken at an F's start, given back at its B/I's end."""
    events = []
    for timed in rank_actions:
        for comp in timed.action.computations():
            change = holding_change(comp)
            if change:
                events.append((timed.start if change > 0 else timed.end, change))
    # at equal times a release (-1) sorts before a new F
    return peak_held(change for _, change in sorted(events))


def simulate(schedule: Schedule, costs: Costs = Costs()) -> SimResult:
    """Run ``schedule`` under ``costs``; raise ScheduleError if it cannot finish (a deadlock)."""
    costs.check_stages(schedule.num_stages)
    rows = [[a for a in row if a.is_compute] for row in schedule.actions]
    for rank, row in enumerate(rows):
        for action in row:
            _check_action(schedule, rank, action)

    done: dict[Product, float] = {}
    placed: dict[Product, tuple[int, Action]] = {}
    free_at = [0.0] * len(rows)
    timeline: list[TimedAction] = []

    def arrival(rank: int, key: Product) -> float | None:
        if key not in done:
            return None
        remote = schedule.stage_to_rank[key[1]] != rank
        return done[key] + (costs.p2p_latency if remote else 0.0)

    def try_run(rank: int, index: int) -> bool:
        action = rows[rank][index]
        needs = [k for comp in action.computations() for k in needs_of(schedule, comp)]
        arrivals = [arrival(rank, k) for k in needs]
        if any(t is None for t in arrivals):
            return False
        start = max([free_at[rank]] + arrivals)
        segments = time_step(action, start, costs)
        end = max([start] + [s.end for s in segments])
        halves = ()
        if action.kind is Kind.OVERLAP:
            halves = tuple(_half(rank, h, segments) for h in action.computations())
        timeline.append(TimedAction(rank, action, start, end, halves, segments))
        for comp in action.computations():
            key = product_of(comp)
            if key in placed:
                first_rank, first = placed[key]
                raise ScheduleError(
                    f"{_product_text(key)} runs twice (also in {first} on rank {first_rank})",
                    rank,
                    action,
                )
            placed[key] = (rank, action)
            done[key] = end
        free_at[rank] = end
        return True

    stuck = run_in_rank_order(rows, try_run)
    if stuck:
        waits = []
        for r, index in stuck.items():
            action = rows[r][index]
            missing = [_product_text(k) for k in missing_needs(schedule, action, done)]
            waits.append(f"rank {r} at {action} waits for {', '.join(missing)}")
        raise ScheduleError("the schedule cannot finish (deadlock): " + "; ".join(waits))

    makespan = max((t.end for t in timeline), default=0.0)
    busy, comm, exposed, peaks = [], [], [], []
    for rank in range(len(rows)):
        mine = [t for t in timeline if t.rank == rank]
        segs = [s for t in mine for s in t.segments if s.end > s.start]
        compute = sorted((s.start, s.end) for s in segs if s.stream == COMPUTE)
        talks = sorted((s.start, s.end) for s in segs if s.stream == COMM)
        busy.append(sum(e - s for s, e in compute))
        comm.append(sum(e - s for s, e in talks))
        exposed.append(uncovered_length(talks, compute))
        peaks.append(_peak_in_flight(mine))
    return SimResult(
        name=schedule.name,
        costs=costs,
        makespan=makespan,
        busy=tuple(busy),
        comm=tuple(comm),
        exposed_comm=tuple(exposed),
        peak_in_flight=tuple(peaks),
        timeline=tuple(timeline),
    )
