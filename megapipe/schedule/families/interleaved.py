"""Several stages per rank in loop placement: interleaved 1F1B and looped BFS.

Stage s lives on rank s % pp, so rank r holds stages r, r + pp, r + 2pp, ... (its "model chunks",
vpp of them). A microbatch therefore visits every rank vpp times.
"""

from __future__ import annotations

import numpy as np

from ..ir import Schedule, loop_placement
from ..table import ActionTable, B, F
from .builder import warmup_then_alternate
from .simple import one_f_one_b


def chunk_sequence(
    num_microbatches: int, vpp: int, group_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """``megatron_chunk_sequence`` as (microbatch, chunk) columns."""
    mbs, chunks = [], []
    for first in range(0, num_microbatches, group_size):
        group = np.arange(first, min(first + group_size, num_microbatches))
        mbs.append(np.tile(group, vpp))
        chunks.append(np.repeat(np.arange(vpp), len(group)))
    if not mbs:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(mbs), np.concatenate(chunks)


def megatron_chunk_sequence(
    num_microbatches: int, vpp: int, group_size: int
) -> list[tuple[int, int]]:
    """The (microbatch, chunk) order in which every rank runs its forwards, as Megatron does.

    Microbatches go in groups of ``group_size`` (Megatron's ``microbatch_group_size_per_vp_stage``);
    each group runs through chunk 0, then chunk 1, ... before the next group starts. The last
    group takes whatever microbatches remain, so the count need not divide evenly.
    Backwards use the same order with the chunks reversed.
    """
    mbs, chunks = chunk_sequence(num_microbatches, vpp, group_size)
    return list(zip(mbs.tolist(), chunks.tolist()))


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

    Each rank runs ``megatron_warmup`` forwards in ``megatron_chunk_sequence``, then alternates one
    forward and one backward (chunks reversed), then drains the backwards. With vpp=1 this is
    Megatron's non-interleaved schedule, plain 1F1B.
    """
    group = microbatch_group_size_per_vp_stage or pp
    if vpp == 1:
        plain = one_f_one_b(pp, num_microbatches)
        return plain.replace_actions(plain.table, name="interleaved-1f1b")
    mbs, chunks = chunk_sequence(num_microbatches, vpp, group)
    total = len(mbs)
    blocks = []
    for rank in range(pp):
        forwards = (chunks * pp + rank, mbs)
        backwards = ((vpp - 1 - chunks) * pp + rank, mbs)
        warmup = megatron_warmup(rank, pp, vpp, group, total)
        blocks.append(warmup_then_alternate(forwards, backwards, warmup, B))
    return Schedule(
        ActionTable.from_blocks(blocks),
        pp * vpp,
        num_microbatches,
        loop_placement(pp, pp * vpp),
        name="interleaved-1f1b",
    )


def looped_bfs(pp: int, num_microbatches: int, vpp: int) -> Schedule:
    """Looped BFS (breadth-first pipelining, Lamy-Poirier 2022; torch's ScheduleLoopedBFS).

    Each rank runs all microbatches through its first chunk, then its second, ...; then all
    backwards, last chunk first, microbatches in reverse. Like GPipe per chunk: few, large
    phases, and every activation of the step held at once.
    """
    m = num_microbatches
    blocks = []
    for rank in range(pp):
        stages = np.arange(rank, pp * vpp, pp)
        kind = np.repeat([F, B], len(stages) * m)
        stage = np.concatenate([np.repeat(stages, m), np.repeat(stages[::-1], m)])
        mb = np.concatenate(
            [np.tile(np.arange(m), len(stages)), np.tile(np.arange(m)[::-1], len(stages))]
        )
        blocks.append((kind, stage, mb))
    return Schedule(
        ActionTable.from_blocks(blocks),
        pp * vpp,
        num_microbatches,
        loop_placement(pp, pp * vpp),
        name="looped-bfs",
    )
