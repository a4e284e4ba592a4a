"""Several stages per rank in loop placement: interleaved 1F1B and looped BFS.

Stage s lives on rank s % pp, so rank r holds stages r, r + pp, r + 2pp, ... (its "model chunks",
vpp of them). A microbatch therefore visits every rank vpp times.
"""

from __future__ import annotations

from .ir import Action, Kind, Schedule, loop_placement
from .simple import one_f_one_b


def megatron_chunk_order(
    num_microbatches: int, vpp: int, group_size: int
) -> list[tuple[int, int]]:
    """The (microbatch, chunk) order in which every rank runs its forwards, as Megatron does.

    Microbatches go in groups of ``group_size`` (Megatron's ``microbatch_group_size_per_vp_stage``);
    each group runs through chunk 0, then chunk 1, ... before the next group starts. The last
    group takes whatever microbatches remain, so the count need not divide evenly.
    Backwards use the same order with the chunks reversed.
    """
    order = []
    for first in range(0, num_microbatches, group_size):
        group = range(first, min(first + group_size, num_microbatches))
        order += [(mb, chunk) for chunk in range(vpp) for mb in group]
    return order


def megatron_orders(
    num_microbatches: int, vpp: int, group_size: int
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The (microbatch, chunk) orders of a rank's forwards and backwards: ``megatron_chunk_order``,
    and the same with the chunks reversed (a microbatch comes back through the last chunk first).
    """
    forwards = megatron_chunk_order(num_microbatches, vpp, group_size)
    return forwards, [(mb, vpp - 1 - chunk) for mb, chunk in forwards]


def megatron_warmup(rank: int, pp: int, vpp: int, group_size: int, total: int) -> int:
    """Megatron's interleaved warmup: ``2 (pp - rank - 1) + (vpp - 1) group_size`` forwards.

    Capped at ``total`` (all forwards of the rank), in which case the rank runs every forward
    before any backward.
    """
    return min(2 * (pp - rank - 1) + (vpp - 1) * group_size, total)


def interleaved_1f1b(
    pp: int,
    num_microbatches: int,
    vpp: int,
    microbatch_group_size_per_vp_stage: int | None = None,
) -> Schedule:
    """Interleaved (virtual-pipeline) 1F1B, Megatron-LM's order (Narayanan et al. 2021).

    Each rank runs ``megatron_warmup`` forwards in ``megatron_chunk_order``, then alternates one
    forward and one backward (chunks reversed), then drains the backwards. With vpp=1 this is
    Megatron's non-interleaved schedule, plain 1F1B.
    """
    group = microbatch_group_size_per_vp_stage or pp
    if vpp == 1:
        plain = one_f_one_b(pp, num_microbatches)
        return plain.replace_actions(plain.actions, name="interleaved-1f1b")
    forwards, backwards = megatron_orders(num_microbatches, vpp, group)
    total = len(forwards)
    actions = []
    for rank in range(pp):
        def stage(chunk: int) -> int:
            return chunk * pp + rank

        warmup = megatron_warmup(rank, pp, vpp, group, total)
        row = [Action(stage(c), Kind.F, mb) for mb, c in forwards[:warmup]]
        for k in range(total - warmup):
            mb, c = forwards[warmup + k]
            row.append(Action(stage(c), Kind.F, mb))
            mb, c = backwards[k]
            row.append(Action(stage(c), Kind.B, mb))
        row += [Action(stage(c), Kind.B, mb) for mb, c in backwards[total - warmup :]]
        actions.append(row)
    return Schedule(
        actions, pp * vpp, num_microbatches, loop_placement(pp, pp * vpp), name="interleaved-1f1b"
    )


def looped_bfs(pp: int, num_microbatches: int, vpp: int) -> Schedule:
    """Looped BFS (breadth-first pipelining, Lamy-Poirier 2022; torch's ScheduleLoopedBFS).

    Each rank runs all microbatches through its first chunk, then its second, ...; then all
    backwards, last chunk first, microbatches in reverse. Like GPipe per chunk: few, large
    phases, and every activation of the step held at once.
    """
    actions = []
    for rank in range(pp):
        stages = range(rank, pp * vpp, pp)
        mbs = range(num_microbatches)
        row = [Action(s, Kind.F, mb) for s in stages for mb in mbs]
        row += [Action(s, Kind.B, mb) for s in reversed(stages) for mb in reversed(mbs)]
        actions.append(row)
    return Schedule(
        actions, pp * vpp, num_microbatches, loop_placement(pp, pp * vpp), name="looped-bfs"
    )
