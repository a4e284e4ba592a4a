"""Zero-bubble schedules (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): ZB1P and ZB-V.

The backward is split in two: I computes the input gradient (what the previous stage waits
for), W the weight gradient (which nobody waits for). Deferring W lets it fill the idle time
that 1F1B leaves at the start and end of a step.
"""

from __future__ import annotations

from collections import deque

from .interleaved import megatron_orders
from .ir import Action, Kind, Schedule, loop_placement, v_placement


def zb1p(
    pp: int,
    num_microbatches: int,
    vpp: int = 1,
    microbatch_group_size_per_vp_stage: int | None = None,
) -> Schedule:
    """ZB1P: the paper's ZB-H1 (1F1B memory, bubble (pp-1)(F+I-W)), interleaved over vpp chunks.

    Source: the zero-bubble paper's handcrafted ZB-H1, and torch's ScheduleInterleavedZeroBubble
    for the interleaved form. Forwards follow Megatron's chunk order (see ``interleaved``); a
    rank runs ``(pp - rank - 1) + (vpp - 1) group`` warmup forwards (the input gradient comes
    back one hop per I, not one per F+B as in interleaved 1F1B), then pairs F with I, and rank r
    holds back its W's by r microbatches, so the ranks that wait longest for the first I of the
    cooldown have the most W's left to fill the wait.
    """
    group = microbatch_group_size_per_vp_stage or pp
    forwards, backwards = megatron_orders(num_microbatches, vpp, group)
    total = len(forwards)
    actions = []
    for rank in range(pp):
        def stage(chunk: int) -> int:
            return chunk * pp + rank

        warmup = min(pp - rank - 1 + (vpp - 1) * group, total)
        row = [Action(stage(c), Kind.F, mb) for mb, c in forwards[:warmup]]
        pending_w: deque[Action] = deque()
        for k in range(total):
            if warmup + k < total:
                mb, c = forwards[warmup + k]
                row.append(Action(stage(c), Kind.F, mb))
            mb, c = backwards[k]
            row.append(Action(stage(c), Kind.I, mb))
            pending_w.append(Action(stage(c), Kind.W, mb))
            if k >= rank:
                row.append(pending_w.popleft())
        row += pending_w
        actions.append(row)
    return Schedule(actions, pp * vpp, num_microbatches, loop_placement(pp, pp * vpp), name="zb1p")


def zbv(pp: int, num_microbatches: int) -> Schedule:
    """ZB-V: the paper's V-shaped zero-bubble schedule (section 6; torch's ScheduleZBVZeroBubble).

    2 pp stages in V placement: rank r holds stage r (chunk 0, going down) and stage 2pp-1-r
    (chunk 1, coming back up), so the first and last stage share rank 0. Phases per rank:
    forwards of chunk 0 fill the V, chunk 0 and 1 forwards alternate, chunk 1 starts its I+W,
    then the steady state runs F, I, W of both chunks, and the cooldown drains the I's of both
    chunks before the deferred W's. The order is built for ``max(M, 2pp - 1)`` microbatches (the
    pattern needs that many to close) and the extra microbatches are dropped, which leaves a
    valid order because no other microbatch depends on them.
    """
    n = max(num_microbatches, 2 * pp - 1)
    actions = []
    for rank in range(pp):
        down, up = rank, 2 * pp - 1 - rank
        count = {(s, k): 0 for s in (down, up) for k in (Kind.F, Kind.I, Kind.W)}
        row: list[Action] = []

        def run(stage: int, kind: Kind) -> None:
            row.append(Action(stage, kind, count[(stage, kind)]))
            count[(stage, kind)] += 1

        for _ in range(2 * (pp - rank) - 1):
            run(down, Kind.F)
        for _ in range(rank):
            run(up, Kind.F)
            run(down, Kind.F)
        for _ in range(pp - rank):
            run(up, Kind.F)
            run(up, Kind.I)
            run(up, Kind.W)
        while count[(up, Kind.F)] < count[(down, Kind.F)] or count[(down, Kind.F)] < n:
            if count[(down, Kind.F)] < n:
                run(down, Kind.F)
            run(down, Kind.I)
            run(down, Kind.W)
            run(up, Kind.F)
            run(up, Kind.I)
            run(up, Kind.W)
        for _ in range(rank):
            run(down, Kind.I)
            run(up, Kind.I)
        for _ in range(pp - rank):
            run(down, Kind.I)
            run(down, Kind.W)
        while count[(up, Kind.W)] < count[(up, Kind.I)]:
            run(up, Kind.W)
        while count[(down, Kind.W)] < count[(down, Kind.I)]:
            run(down, Kind.W)
        actions.append([a for a in row if a.microbatch < num_microbatches])
    return Schedule(actions, 2 * pp, num_microbatches, v_placement(pp, 2 * pp), name="zbv")
