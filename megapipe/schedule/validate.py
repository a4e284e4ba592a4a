"""Validation: does a schedule run every microbatch through every stage, in an order that finishes?

The rules, checked in this order (the first broken one raises ``ScheduleError`` naming the rank,
the action and the rule):

1. placement: an action's stage lives on the rank that runs it; stage and microbatch in range;
2. pairs: the two halves of an OVERLAP are different microbatches (otherwise one needs the other);
3. counts: each stage of a microbatch's pipeline (``Schedule.stages_for``) runs exactly one F and
   either one B or one I and one W for it, and no other stage runs that microbatch;
4. rank order: on a rank, F before B/I before W of the same stage and microbatch, and between
   adjacent stages on the same rank, F of stage s before F of stage s+1 and backward the reverse;
5. progress: with every rank running its list in order and each action waiting for the actions
   it needs from other stages, every rank finishes (no cycle of waits across ranks);
6. lowered run: the schedule with SEND/RECV added (``lower``) finishes under the batched p2p model
   of ``check_runs``. A schedule that already holds SEND/RECV actions is checked as it is.
"""

from __future__ import annotations

from collections import defaultdict

from .deps import Product, missing_needs, timeline
from .errors import ScheduleError
from .ir import COMM_KINDS, Action, Kind, Schedule
from .overlap import pair_is_independent

# Where a computation sits on its rank: (index in the rank's list, 0 for an F half / 1 for a
# backward half of an OVERLAP), so the forward half of a pair counts as the earlier one.
Position = tuple[int, int]


def validate(schedule: Schedule) -> None:
    """Raise ``ScheduleError`` if ``schedule`` breaks any rule listed in the module docstring."""
    _check_placement(schedule)
    _check_pairs(schedule)
    positions = _check_counts(schedule)
    _check_rank_order(schedule, positions)
    _check_progress(schedule)
    _check_lowered_run(schedule)


def _computations(schedule: Schedule):
    """(rank, position, action) for every plain compute action, OVERLAP halves included."""
    for rank, row in enumerate(schedule.actions):
        for index, action in enumerate(row):
            if action.kind in COMM_KINDS:
                continue
            for half, comp in enumerate(action.computations()):
                yield rank, (index, half), comp


def _check_placement(schedule: Schedule) -> None:
    if schedule.num_stages == 0 or schedule.num_microbatches == 0:
        raise ScheduleError(
            f"the schedule has {schedule.num_stages} stages and {schedule.num_microbatches} "
            "microbatches: it needs at least one of each"
        )
    if schedule.bidirectional and (schedule.num_stages % 2 or schedule.num_microbatches % 2):
        raise ScheduleError(
            f"a bidirectional schedule needs an even number of stages and microbatches, got "
            f"{schedule.num_stages} stages and {schedule.num_microbatches} microbatches"
        )
    for stage, rank in enumerate(schedule.stage_to_rank):
        if not 0 <= rank < schedule.pp:
            raise ScheduleError(
                f"stage {stage} is placed on rank {rank}, but the schedule has {schedule.pp} ranks"
            )
    for rank, row in enumerate(schedule.actions):
        for action in row:
            for comp in action.computations():
                if not 0 <= comp.stage < schedule.num_stages:
                    raise ScheduleError(
                        f"stage {comp.stage} does not exist ({schedule.num_stages} stages)",
                        rank, action,
                    )
                if not 0 <= comp.microbatch < schedule.num_microbatches:
                    raise ScheduleError(
                        f"microbatch {comp.microbatch} does not exist "
                        f"({schedule.num_microbatches} microbatches)",
                        rank, action,
                    )
                owner = schedule.stage_to_rank[comp.stage]
                if owner != rank:
                    raise ScheduleError(
                        f"stage {comp.stage} is placed on rank {owner}, not on this rank",
                        rank, action,
                    )


def _check_pairs(schedule: Schedule) -> None:
    for rank, row in enumerate(schedule.actions):
        for action in row:
            if action.kind is not Kind.OVERLAP:
                continue
            if not pair_is_independent(action.forward, action.backward):
                raise ScheduleError(
                    "the two halves of an OVERLAP must be different microbatches (a backward of "
                    "a microbatch needs its own forward to have finished)",
                    rank, action,
                )


def _check_counts(schedule: Schedule) -> dict[tuple[int, int], dict[Kind, Position]]:
    """Check one F and one B (or one I and one W) per stage and microbatch; return positions."""
    seen: dict[tuple[int, int], dict[Kind, Position]] = defaultdict(dict)
    for rank, position, comp in _computations(schedule):
        if comp.stage not in schedule.stages_for(comp.microbatch):
            raise ScheduleError(
                f"microbatch {comp.microbatch} does not flow through stage {comp.stage} "
                f"(its stages are {_span(schedule.stages_for(comp.microbatch))})",
                rank, comp,
            )
        kinds = seen[(comp.stage, comp.microbatch)]
        if comp.kind in kinds:
            raise ScheduleError(
                f"stage {comp.stage} runs {comp.kind.value} of microbatch {comp.microbatch} twice",
                rank, comp,
            )
        if (comp.kind is Kind.B and Kind.I in kinds) or (comp.kind is Kind.I and Kind.B in kinds):
            raise ScheduleError(
                "a stage runs either one B or one I and one W per microbatch, not both B and I",
                rank, comp,
            )
        kinds[comp.kind] = position
    for mb in range(schedule.num_microbatches):
        for stage in schedule.stages_for(mb):
            kinds = seen.get((stage, mb), {})
            rank = schedule.stage_to_rank[stage]
            if Kind.F not in kinds:
                missing = Kind.F
            elif Kind.W in kinds and Kind.I not in kinds:
                missing = Kind.I
            elif Kind.B not in kinds and Kind.I not in kinds:
                missing = Kind.B
            elif Kind.I in kinds and Kind.W not in kinds:
                missing = Kind.W
            else:
                continue
            raise ScheduleError(
                "missing: each stage runs one F and one B (or one I and one W) per microbatch",
                rank, Action(stage, missing, mb),
            )
    return seen


def _backward(kinds: dict[Kind, Position]) -> tuple[Kind, Position]:
    kind = Kind.B if Kind.B in kinds else Kind.I
    return kind, kinds[kind]


def _check_rank_order(
    schedule: Schedule, positions: dict[tuple[int, int], dict[Kind, Position]]
) -> None:
    for (stage, mb), kinds in positions.items():
        rank = schedule.stage_to_rank[stage]
        back_kind, back_pos = _backward(kinds)
        if back_pos < kinds[Kind.F]:
            raise ScheduleError(
                f"runs before {stage}F{mb}: a backward needs its forward first",
                rank, Action(stage, back_kind, mb),
            )
        if Kind.W in kinds and kinds[Kind.W] < back_pos:
            raise ScheduleError(
                f"runs before {stage}I{mb}: W needs the I of the same microbatch first",
                rank, Action(stage, Kind.W, mb),
            )
        after = schedule.next_stage(stage)
        if after is None or schedule.stage_to_rank[after] != rank:
            continue
        next_kinds = positions[(after, mb)]
        if next_kinds[Kind.F] < kinds[Kind.F]:
            raise ScheduleError(
                f"runs before {stage}F{mb} on the same rank: stage {after} needs the output of "
                f"stage {stage}",
                rank, Action(after, Kind.F, mb),
            )
        next_back_kind, next_back_pos = _backward(next_kinds)
        if back_pos < next_back_pos:
            raise ScheduleError(
                f"runs before {after}{next_back_kind.value}{mb} on the same rank: stage {stage} "
                f"needs the input gradient of stage {after}",
                rank, Action(stage, back_kind, mb),
            )


def _check_progress(schedule: Schedule) -> None:
    """Run every rank's list in order against the cross-stage dependencies; find stuck ranks."""
    rows = [[a for a in row if a.kind not in COMM_KINDS] for row in schedule.actions]
    run = timeline(schedule.replace_actions(rows))
    if not run.stuck:
        return
    waits = []
    for rank, index in run.stuck.items():
        action = rows[rank][index]
        blocked = [c for c in action.computations() if missing_needs(schedule, c, run.made)]
        needs = ", ".join(_describe_need(schedule, c, run.made) for c in blocked)
        waits.append(f"rank {rank} at {action} waits for {needs}")
    first_rank, first_index = next(iter(run.stuck.items()))
    raise ScheduleError(
        "the ranks' orders wait on each other in a cycle (dependency order across stages): "
        + "; ".join(waits),
        first_rank, rows[first_rank][first_index],
    )


def _describe_need(schedule: Schedule, comp: Action, made: dict[Product, float]) -> str:
    """The first product ``comp`` still waits for; a backward's own forward runs on its own
    rank, so no rank is named for it."""
    kind, stage, mb = missing_needs(schedule, comp, made)[0]
    if kind == "F" and stage == comp.stage:
        return f"{stage}F{mb}"
    text = f"{stage}B/I{mb}" if kind == "G" else f"{stage}{kind}{mb}"
    return f"{text} on rank {schedule.stage_to_rank[stage]}"


def _check_lowered_run(schedule: Schedule) -> None:
    from .lower import check_runs, lower  # lower imports this package's modules, not validate
    has_comm = any(a.kind in COMM_KINDS for row in schedule.actions for a in row)
    check_runs(schedule if has_comm else lower(schedule))


def _span(stages: range) -> str:
    return f"{stages.start}..{stages.stop - 1}"
