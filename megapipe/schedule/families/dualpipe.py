"""DualPipe and DualPipeV (DeepSeek-V3 report, arXiv 2412.19437; github.com/deepseek-ai/DualPipe).

Every rank holds two stages, ``near`` and ``far``: in DualPipeV one V-shaped pipeline of 2 pp
stages (rank r: stages r and 2pp-1-r); in DualPipe two pipelines fed from opposite ends (rank r:
stage r of the forward pipeline and stage 2pp-1-r of the mirrored one), each rank mirroring rank
pp-1-r. Both run the same eight phases; the main phase pairs the forward of one stage with the
backward of the other as OVERLAP actions, so one microbatch's communication hides behind the
other's computation. Parts of the warmup and cooldown split the backward into I and W (zero
bubble). With ``overlap=False`` each pair becomes its forward followed by its backward.
"""

from __future__ import annotations

from ..ir import Schedule, ScheduleOptions, v_placement
from ..table import ActionTable, B, F, I, W
from .builder import RowBuilder


def _backward(row: RowBuilder, stage: int, zero_bubble: bool = False) -> None:
    """The next B of ``stage``, or its I with the W deferred to the FIFO (numbered alike)."""
    mb = row.take(stage, B)
    if zero_bubble:
        row.add(I, stage, mb)
        row.pending_w.append((stage, mb))
    else:
        row.add(B, stage, mb)


def _weight(row: RowBuilder) -> None:
    """The oldest deferred W, if any (DualPipe's WeightGradStore.pop)."""
    if row.pending_w:
        stage, mb = row.pending_w.popleft()
        row.add(W, stage, mb)


def _dualpipe_rank(
    row: RowBuilder, near: int, far: int, position: int, ranks: int, chunks: int
) -> list:
    """The eight DualPipe phases for the rank at ``position`` of ``ranks`` along its pipeline.

    ``near`` is its stage ``position`` hops from the start of a pipeline, ``far`` its stage
    ``position`` hops from the end; ``chunks`` is the number of microbatches per stage.
    Returns the rank's table columns.
    """
    behind = ranks - position - 1  # ranks between this one and the turning point
    row.repeat([(near, F)], 2 * behind)  # 1: forwards of near fill the pipeline
    row.repeat([(near, F), (far, F)], position + 1)  # 2: near and far forwards alternate
    for _ in range(behind):  # 3: far's first backwards, W run at once
        _backward(row, far, zero_bubble=True)
        _weight(row)
        row.run(far, F)
    main = chunks - 2 * ranks + position + 1  # 4: the main phase, two pairs per turn
    if main > 0 and behind == 0:
        # At the turning point DualPipe runs this first pair apart to shorten the bubble.
        row.run(near, F)
        row.run(far, B)
        row.pair(far, near, B)
        main -= 1
    row.repeat([(near, far, B), (far, near, B)], main)
    for _ in range(behind):  # 5: far's backwards run out, near still pairs
        row.run(far, B)
        row.pair(far, near, B)
    zero_bubble = False
    for i in range(position + 1):  # 6: the last backwards, the second half with W deferred
        if i == (position + 1) // 2 and position % 2 == 1:
            zero_bubble = True
        _backward(row, far, zero_bubble)
        if i == (position + 1) // 2 and position % 2 == 0:
            zero_bubble = True
        _backward(row, near, zero_bubble)
    for _ in range(behind):  # 7: deferred W's interleave with near's last backwards
        _weight(row)
        _backward(row, near, zero_bubble=True)
    for _ in range(position + 1):  # 8: the remaining W's
        _weight(row)
    return row.columns()


def dualpipev(pp: int, num_microbatches: int, overlap: bool = True) -> Schedule:
    """DualPipeV ("cut-in-half" DualPipe; DualPipe repo's DualPipeV, torch's ScheduleDualPipeV).

    2 pp stages in V placement on pp ranks, one pipeline of ``num_microbatches >= 2 pp``
    microbatches.
    """
    stages = 2 * pp
    blocks = []
    for rank in range(pp):
        near, far = rank, stages - 1 - rank
        row = RowBuilder({near: 0, far: 0}, overlap)
        blocks.append(_dualpipe_rank(row, near, far, rank, pp, num_microbatches))
    return Schedule(
        ActionTable.from_blocks(blocks),
        stages,
        num_microbatches,
        v_placement(pp, stages),
        name="dualpipev",
        options=ScheduleOptions(overlap=overlap),
    )


def dualpipe(pp: int, num_microbatches: int, overlap: bool = True) -> Schedule:
    """DualPipe: two mirrored pipelines fed from both ends (bidirectional; pp even, M even).

    Stages 0..pp-1 on ranks 0..pp-1 carry microbatches [0, M/2); stages pp..2pp-1 on ranks
    pp-1..0 carry [M/2, M) (stage pp+k mirrors model part k). Rank r and rank pp-1-r run the same
    phases with the two pipelines' roles swapped: the pipeline whose stage on the rank is nearer
    to its start plays ``near``. Needs M/2 >= pp microbatches per direction.
    """
    half = num_microbatches // 2
    stages = 2 * pp
    placement = tuple(range(pp)) + tuple(range(pp - 1, -1, -1))
    blocks = []
    for rank in range(pp):
        down, up = rank, stages - 1 - rank  # forward-pipeline stage, mirrored-pipeline stage
        position = min(rank, pp - 1 - rank)
        near, far = (down, up) if rank < pp // 2 else (up, down)
        row = RowBuilder({down: 0, up: half}, overlap)
        blocks.append(_dualpipe_rank(row, near, far, position, pp // 2, half))
    return Schedule(
        ActionTable.from_blocks(blocks),
        stages,
        num_microbatches,
        placement,
        name="dualpipe",
        bidirectional=True,
        options=ScheduleOptions(overlap=overlap),
    )
