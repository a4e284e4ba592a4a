"""One stage per rank: GPipe and 1F1B.

Both place stage s on rank s; pp=1 with 1F1B is "no pipelining" (every forward followed by its
backward on the single rank).
"""

from __future__ import annotations

import numpy as np

from ..ir import Schedule, loop_placement
from ..table import ActionTable, B, F
from .builder import warmup_then_alternate


def gpipe(pp: int, num_microbatches: int) -> Schedule:
    """GPipe (Huang et al. 2019): every forward, then every backward, in microbatch order.

    Simple and deadlock-free, but each rank holds the activations of all microbatches.
    The backward order follows torch.distributed.pipelining's ScheduleGPipe (0, 1, ...).
    """
    mbs = np.arange(num_microbatches)
    kind = np.repeat([F, B], num_microbatches)
    blocks = [(kind, np.full(2 * num_microbatches, rank), np.tile(mbs, 2)) for rank in range(pp)]
    return Schedule(
        ActionTable.from_blocks(blocks), pp, num_microbatches, loop_placement(pp, pp), name="gpipe"
    )


def one_f_one_b(pp: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021; Megatron's non-interleaved schedule).

    Rank r runs ``pp - r - 1`` warmup forwards, then alternates one forward and one backward,
    then drains the remaining backwards. At most ``pp - r`` microbatches are in flight on rank r.
    """
    mbs = np.arange(num_microbatches)
    blocks = []
    for rank in range(pp):
        stages = np.full(num_microbatches, rank)
        warmup = min(pp - rank - 1, num_microbatches)
        blocks.append(warmup_then_alternate((stages, mbs), (stages, mbs), warmup, B))
    return Schedule(
        ActionTable.from_blocks(blocks), pp, num_microbatches, loop_placement(pp, pp), name="1f1b"
    )
