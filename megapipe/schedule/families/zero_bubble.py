"""Zero-bubble schedules (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): ZB1P and ZB-V.

The backward is split in two: I computes the input gradient (what the previous stage waits
for), W the weight gradient (which nobody waits for). Deferring W lets it fill the idle time
that 1F1B leaves at the start and end of a step.
"""

from __future__ import annotations

import numpy as np

from ..ir import Schedule, loop_placement, v_placement
from ..table import ActionTable, F, I, W
from .builder import RowBuilder
from .interleaved import chunk_sequence


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
    mbs, chunks = chunk_sequence(num_microbatches, vpp, group)
    total = len(mbs)
    turns = np.arange(total)
    blocks = []
    for rank in range(pp):
        f_stage, b_stage = chunks * pp + rank, (vpp - 1 - chunks) * pp + rank
        warmup = min(pp - rank - 1 + (vpp - 1) * group, total)
        # Turn k of the main loop: the next forward (while any is left), I of backward k, and
        # the W deferred ``rank`` turns ago (FIFO); the W's still deferred come last.
        later = np.minimum(turns + warmup, total - 1)
        held = np.maximum(turns - rank, 0)
        kind = np.stack([np.full(total, F), np.full(total, I), np.full(total, W)], axis=1)
        stage = np.stack([f_stage[later], b_stage, b_stage[held]], axis=1)
        mb = np.stack([mbs[later], mbs, mbs[held]], axis=1)
        keep = np.stack([turns + warmup < total, turns >= 0, turns >= rank], axis=1).reshape(-1)
        rest = np.arange(max(total - rank, 0), total)
        blocks.append(
            (
                np.concatenate([np.full(warmup, F), kind.reshape(-1)[keep], np.full(len(rest), W)]),
                np.concatenate([f_stage[:warmup], stage.reshape(-1)[keep], b_stage[rest]]),
                np.concatenate([mbs[:warmup], mb.reshape(-1)[keep], mbs[rest]]),
            )
        )
    return Schedule(
        ActionTable.from_blocks(blocks),
        pp * vpp,
        num_microbatches,
        loop_placement(pp, pp * vpp),
        name="zb1p",
    )


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
    blocks = []
    for rank in range(pp):
        down, up = rank, 2 * pp - 1 - rank
        row = RowBuilder()
        row.repeat([(down, F)], 2 * (pp - rank) - 1)
        row.repeat([(up, F), (down, F)], rank)
        row.repeat([(up, F), (up, I), (up, W)], pp - rank)
        # Steady state: while down's forwards last, then until up's forwards catch up.
        row.repeat(
            [(down, F), (down, I), (down, W), (up, F), (up, I), (up, W)], n - row.count(down, F)
        )
        row.repeat(
            [(down, I), (down, W), (up, F), (up, I), (up, W)], row.count(down, F) - row.count(up, F)
        )
        row.repeat([(down, I), (up, I)], rank)
        row.repeat([(down, I), (down, W)], pp - rank)
        row.repeat([(up, W)], row.count(up, I) - row.count(up, W))
        row.repeat([(down, W)], row.count(down, I) - row.count(down, W))
        kind, stage, mb, *_ = row.columns()
        keep = mb < num_microbatches
        blocks.append((kind[keep], stage[keep], mb[keep]))
    return Schedule(
        ActionTable.from_blocks(blocks),
        2 * pp,
        num_microbatches,
        v_placement(pp, 2 * pp),
        name="zbv",
    )
