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

from collections import deque
from dataclasses import dataclass, field

from .ir import Action, Kind, Schedule, v_placement


@dataclass
class _RankOrder:
    """Builds one rank's list: per-stage microbatch counters and the FIFO of deferred W's."""

    first_microbatch: dict[int, int]
    overlap: bool
    row: list[Action] = field(default_factory=list)
    counts: dict[tuple[int, Kind], int] = field(default_factory=dict)
    pending_w: deque = field(default_factory=deque)

    def _next(self, stage: int, kind: Kind) -> Action:
        n = self.counts.get((stage, kind), 0)
        self.counts[(stage, kind)] = n + 1
        return Action(stage, kind, self.first_microbatch[stage] + n)

    def forward(self, stage: int) -> None:
        self.row.append(self._next(stage, Kind.F))

    def backward(self, stage: int, zero_bubble: bool = False) -> None:
        """B, or I with its W deferred to the FIFO (both count as this stage's backward)."""
        action = self._next(stage, Kind.B)
        if zero_bubble:
            self.row.append(Action(stage, Kind.I, action.microbatch))
            self.pending_w.append(Action(stage, Kind.W, action.microbatch))
        else:
            self.row.append(action)

    def weight(self) -> None:
        """The oldest deferred W, if any (DualPipe's WeightGradStore.pop)."""
        if self.pending_w:
            self.row.append(self.pending_w.popleft())

    def pair(self, forward_stage: int, backward_stage: int) -> None:
        f = self._next(forward_stage, Kind.F)
        b = self._next(backward_stage, Kind.B)
        self.row += [Action.overlap(f, b)] if self.overlap else [f, b]


def _dualpipe_rank(
    order: _RankOrder, near: int, far: int, position: int, ranks: int, chunks: int
) -> list[Action]:
    """The eight DualPipe phases for the rank at ``position`` of ``ranks`` along its pipeline.

    ``near`` is its stage ``position`` hops from the start of a pipeline, ``far`` its stage
    ``position`` hops from the end; ``chunks`` is the number of microbatches per stage.
    """
    behind = ranks - position - 1  # ranks between this one and the turning point
    for _ in range(2 * behind):  # 1: forwards of near fill the pipeline
        order.forward(near)
    for _ in range(position + 1):  # 2: near and far forwards alternate
        order.forward(near)
        order.forward(far)
    for _ in range(behind):  # 3: far's first backwards, W run at once
        order.backward(far, zero_bubble=True)
        order.weight()
        order.forward(far)
    for i in range(chunks - 2 * ranks + position + 1):  # 4: the main phase, two pairs per step
        if i == 0 and behind == 0:
            # At the turning point DualPipe runs this first pair apart to shorten the bubble.
            order.forward(near)
            order.backward(far)
        else:
            order.pair(near, far)
        order.pair(far, near)
    for _ in range(behind):  # 5: far's backwards run out, near still pairs
        order.backward(far)
        order.pair(far, near)
    zero_bubble = False
    for i in range(position + 1):  # 6: the last backwards, the second half with W deferred
        if i == (position + 1) // 2 and position % 2 == 1:
            zero_bubble = True
        order.backward(far, zero_bubble)
        if i == (position + 1) // 2 and position % 2 == 0:
            zero_bubble = True
        order.backward(near, zero_bubble)
    for _ in range(behind):  # 7: deferred W's interleave with near's last backwards
        order.weight()
        order.backward(near, zero_bubble=True)
    for _ in range(position + 1):  # 8: the remaining W's
        order.weight()
    return order.row


def dualpipev(pp: int, num_microbatches: int, overlap: bool = True) -> Schedule:
    """DualPipeV ("cut-in-half" DualPipe; DualPipe repo's DualPipeV, torch's ScheduleDualPipeV).

    2 pp stages in V placement on pp ranks, one pipeline of ``num_microbatches >= 2 pp``
    microbatches.
    """
    stages = 2 * pp
    actions = []
    for rank in range(pp):
        near, far = rank, stages - 1 - rank
        order = _RankOrder({near: 0, far: 0}, overlap)
        actions.append(_dualpipe_rank(order, near, far, rank, pp, num_microbatches))
    return Schedule(
        actions, stages, num_microbatches, v_placement(pp, stages), name="dualpipev",
        options={"overlap": overlap},
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
    actions = []
    for rank in range(pp):
        down, up = rank, stages - 1 - rank  # forward-pipeline stage, mirrored-pipeline stage
        position = min(rank, pp - 1 - rank)
        near, far = (down, up) if rank < pp // 2 else (up, down)
        order = _RankOrder({down: 0, up: half}, overlap)
        actions.append(_dualpipe_rank(order, near, far, position, pp // 2, half))
    return Schedule(
        actions, stages, num_microbatches, placement, name="dualpipe", bidirectional=True,
        options={"overlap": overlap},
    )
