"""One stage per rank: GPipe and 1F1B.

Both place stage s on rank s; pp=1 with 1F1B is "no pipelining" (every forward followed by its
backward on the single rank).
"""

from __future__ import annotations

from .ir import Action, Kind, Schedule, loop_placement


def gpipe(pp: int, num_microbatches: int) -> Schedule:
    """GPipe (Huang et al. 2019): every forward, then every backward, in microbatch order.

    Simple and deadlock-free, but each rank holds the activations of all microbatches.
    The backward order follows torch.distributed.pipelining's ScheduleGPipe (0, 1, ...).
    """
    mbs = range(num_microbatches)
    actions = [
        [Action(rank, Kind.F, i) for i in mbs] + [Action(rank, Kind.B, i) for i in mbs]
        for rank in range(pp)
    ]
    return Schedule(actions, pp, num_microbatches, loop_placement(pp, pp), name="gpipe")


def one_f_one_b(pp: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021; Megatron's non-interleaved schedule).

    Rank r runs ``pp - r - 1`` warmup forwards, then alternates one forward and one backward,
    then drains the remaining backwards. At most ``pp - r`` microbatches are in flight on rank r.
    """
    actions = []
    for rank in range(pp):
        warmup = min(pp - rank - 1, num_microbatches)
        row = [Action(rank, Kind.F, i) for i in range(warmup)]
        for step in range(num_microbatches - warmup):
            row.append(Action(rank, Kind.F, warmup + step))
            row.append(Action(rank, Kind.B, step))
        row += [Action(rank, Kind.B, i) for i in range(num_microbatches - warmup, num_microbatches)]
        actions.append(row)
    return Schedule(actions, pp, num_microbatches, loop_placement(pp, pp), name="1f1b")
