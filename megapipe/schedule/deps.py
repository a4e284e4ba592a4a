"""What each computation needs and what it hands on: the dependency rules of a schedule.

A forward F(s, i) needs the output of F(s-1, i); a backward B or I of (s, i) needs its own
forward's activations and the input gradient of stage s+1 (on a last stage, the loss, computed by
its own forward); a W needs the I of the same stage and microbatch. When producer and consumer sit
on different ranks the tensor travels as a message, named by the sending side: ``("F", s, i)`` is
F(s, i)'s output, ``("B", s, i)`` stage s's input gradient of microbatch i.

``timeline`` runs a compute-only schedule with given durations (each rank runs its list in order,
each action once what it needs is made). The overlap pass uses it to find pairs that wait on each
other; lowering uses its times to decide where a receive is posted; validation uses it to find
ranks that wait on each other. ``run_in_rank_order`` is the in-order driver it shares with the
simulator (``megapipe.sim``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

from .ir import BACKWARD_KINDS, COMM_KINDS, Action, Kind, Schedule

# What a computation leaves behind for others: ("F" | "G" | "W", stage, microbatch), "G" being the
# input gradient (made by B or I alike).
Product = tuple[str, int, int]
# A tensor that travels between ranks, named by its sender: ("F" | "B", sending stage, microbatch).
Message = tuple[str, int, int]


def product_of(comp: Action) -> Product:
    """What a plain computation produces (B and I both produce the input gradient "G")."""
    if comp.kind is Kind.F:
        return ("F", comp.stage, comp.microbatch)
    if comp.kind in BACKWARD_KINDS:
        return ("G", comp.stage, comp.microbatch)
    if comp.kind is Kind.W:
        return ("W", comp.stage, comp.microbatch)
    raise ValueError(f"{comp} is not a plain computation (F, B, I or W)")


def needs_of(schedule: Schedule, comp: Action) -> list[Product]:
    """The products a plain computation needs, wherever they are made."""
    stage, mb = comp.stage, comp.microbatch
    if comp.kind is Kind.F:
        before = schedule.prev_stage(stage)
        return [] if before is None else [("F", before, mb)]
    if comp.kind in BACKWARD_KINDS:
        after = schedule.next_stage(stage)
        own = ("F", stage, mb)
        return [own] if after is None else [own, ("G", after, mb)]
    if comp.kind is Kind.W:
        return [("G", stage, mb)]
    raise ValueError(f"{comp} is not a plain computation (F, B, I or W)")


def rank_of_product(schedule: Schedule, product: Product) -> int:
    return schedule.stage_to_rank[product[1]]


def sent_message(schedule: Schedule, comp: Action) -> Message | None:
    """The message a computation's result becomes, or None if its consumer is on the same rank."""
    here = schedule.stage_to_rank[comp.stage]
    if comp.kind is Kind.F:
        target = schedule.next_stage(comp.stage)
        kind = "F"
    elif comp.kind in BACKWARD_KINDS:
        target = schedule.prev_stage(comp.stage)
        kind = "B"
    else:
        return None
    if target is None or schedule.stage_to_rank[target] == here:
        return None
    return (kind, comp.stage, comp.microbatch)


def received_message(schedule: Schedule, comp: Action) -> Message | None:
    """The message a computation must receive from another rank, or None.

    That is its need made on another rank, if any: for an F the previous stage's output, for a
    B or I the next stage's input gradient (a W needs only its own rank's I).
    """
    if comp.kind is not Kind.F and comp.kind not in BACKWARD_KINDS:
        return None
    here = schedule.stage_to_rank[comp.stage]
    for product, stage, mb in needs_of(schedule, comp):
        if schedule.stage_to_rank[stage] != here:
            return ("F" if product == "F" else "B", stage, mb)
    return None


def message_of_comm(schedule: Schedule, action: Action) -> Message:
    """The message a SEND or RECV action carries (named by the sending stage)."""
    stage, mb = action.stage, action.microbatch
    if action.kind is Kind.SEND_F:
        return ("F", stage, mb)
    if action.kind is Kind.SEND_B:
        return ("B", stage, mb)
    if action.kind is Kind.RECV_F:
        source = schedule.prev_stage(stage)
        return ("F", -1 if source is None else source, mb)
    if action.kind is Kind.RECV_B:
        source = schedule.next_stage(stage)
        return ("B", -1 if source is None else source, mb)
    raise ValueError(f"{action} is not a SEND or RECV action")


def send_action(message: Message) -> Action:
    kind, stage, mb = message
    return Action(stage, Kind.SEND_F if kind == "F" else Kind.SEND_B, mb)


def recv_action(schedule: Schedule, message: Message) -> Action:
    """The RECV that takes ``message`` in, written with the receiving stage as torch does."""
    kind, stage, mb = message
    if kind == "F":
        return Action(schedule.next_stage(stage), Kind.RECV_F, mb)
    return Action(schedule.prev_stage(stage), Kind.RECV_B, mb)


def peer_rank(schedule: Schedule, action: Action) -> int:
    """The rank on the other end of a SEND or RECV (an error if there is none)."""
    stage = action.stage
    if action.kind in (Kind.SEND_F, Kind.RECV_B):
        other = schedule.next_stage(stage)
    elif action.kind in (Kind.SEND_B, Kind.RECV_F):
        other = schedule.prev_stage(stage)
    else:
        raise ValueError(f"{action} is not a SEND or RECV action")
    if other is None:
        raise ValueError(f"{action} has no peer: stage {stage} is at the end of its pipeline")
    return schedule.stage_to_rank[other]


# Relative durations used when none are given: a backward costs two forwards, and I and W one
# each (the usual F=1, B=2, W=1 of the zero-bubble and DualPipe papers). An OVERLAP costs the
# sum of its halves unless ``Kind.OVERLAP`` is given.
DEFAULT_DURATIONS: dict[Kind, float] = {Kind.F: 1.0, Kind.B: 2.0, Kind.I: 1.0, Kind.W: 1.0}


@dataclass(frozen=True)
class Timeline:
    """A run of a compute-only schedule: ``start[r][k]`` and ``end[r][k]`` of rank r's k-th action.

    ``stuck`` maps each rank that could not finish to the index of the action it waits at (empty
    when the run finished); times from a stuck index on are -1. ``made`` maps each product made to
    the time it was made.
    """

    start: tuple[tuple[float, ...], ...]
    end: tuple[tuple[float, ...], ...]
    stuck: dict
    made: dict


def _duration(action: Action, durations: dict) -> float:
    if action.kind is not Kind.OVERLAP:
        return durations[action.kind]
    if Kind.OVERLAP in durations:
        return durations[Kind.OVERLAP]
    forward, backward = action.sub_actions
    return durations[forward.kind] + durations[backward.kind]


class _Step(NamedTuple):
    """One action as ``timeline`` sees it, worked out once: what it needs, makes, and costs."""

    needs: list[Product]
    makes: list[Product]
    duration: float


def _step(schedule: Schedule, action: Action, durations: dict) -> _Step:
    """The needs, products and duration of one action (an OVERLAP's halves together)."""
    needs: list[Product] = []
    makes: list[Product] = []
    for comp in action.computations():
        needs += needs_of(schedule, comp)
        makes.append(product_of(comp))
    return _Step(needs, makes, _duration(action, durations))


def _start_time(step: _Step, made: dict[Product, float], free: float) -> float | None:
    """When ``step`` can start on a rank free from ``free``, or None while a need is not made."""
    begin = free
    for need in step.needs:
        made_at = made.get(need)
        if made_at is None:
            return None
        begin = max(begin, made_at)
    return begin


def run_in_rank_order(
    rows: Sequence[Sequence[object]], try_run: Callable[[int, int], bool]
) -> dict[int, int]:
    """Run each rank's list in order, as far as its dependencies allow.

    Sweeps the ranks round robin; on each rank ``try_run(rank, index)`` runs the next action and
    returns True, or returns False when the action must wait (nothing run). Sweeps until no rank
    moves; returns ``{rank: index it waits at}`` for each rank that did not finish.
    """
    cursor = [0] * len(rows)
    progressed = True
    while progressed:
        progressed = False
        for rank, row in enumerate(rows):
            while cursor[rank] < len(row) and try_run(rank, cursor[rank]):
                cursor[rank] += 1
                progressed = True
    return {rank: cursor[rank] for rank, row in enumerate(rows) if cursor[rank] < len(row)}


def timeline(schedule: Schedule, durations: dict[Kind, float] | None = None) -> Timeline:
    """Run a compute-only schedule: each rank runs its list in order, each action starting once
    its rank is free and every product it needs is made (on any rank).

    A product needed from the same rank but made later in its list can never come, so such a
    rank is reported stuck like one in a cycle of waits. ``durations`` maps F, B, I, W (and
    optionally OVERLAP) to positive numbers; default ``DEFAULT_DURATIONS``.
    """
    durations = dict(DEFAULT_DURATIONS if durations is None else durations)
    for kind in (Kind.F, Kind.B, Kind.I, Kind.W):
        value = durations.get(kind)
        if not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"durations[{kind.value}] must be a positive number, got {value!r}")
    rows = schedule.actions
    for rank, row in enumerate(rows):
        for action in row:
            if action.kind in COMM_KINDS:
                raise ValueError(
                    f"timeline runs compute-only schedules; rank {rank} holds {action}"
                )
    # Worked out once per action: run_in_rank_order may try a blocked action several times.
    steps = [[_step(schedule, action, durations) for action in row] for row in rows]
    made: dict[Product, float] = {}
    start = [[-1.0] * len(row) for row in rows]
    end = [[-1.0] * len(row) for row in rows]
    free = [0.0] * len(rows)

    def try_run(rank: int, index: int) -> bool:
        step = steps[rank][index]
        begin = _start_time(step, made, free[rank])
        if begin is None:
            return False
        finish = begin + step.duration
        for product in step.makes:
            made[product] = finish
        start[rank][index], end[rank][index] = begin, finish
        free[rank] = finish
        return True

    stuck = run_in_rank_order(steps, try_run)
    return Timeline(tuple(map(tuple, start)), tuple(map(tuple, end)), stuck, made)


def missing_needs(schedule: Schedule, action: Action, made: set[Product] | dict) -> list[Product]:
    """The products an action (an OVERLAP's halves included) needs that are not in ``made``."""
    return [
        need for comp in action.computations() for need in needs_of(schedule, comp)
        if need not in made
    ]


def describe_product(schedule: Schedule, product: Product) -> str:
    kind, stage, mb = product
    text = {"F": f"{stage}F{mb}", "G": f"{stage}B/I{mb}", "W": f"{stage}W{mb}"}[kind]
    return f"{text} (rank {schedule.stage_to_rank[stage]})"
