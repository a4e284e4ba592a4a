"""What one MoE layer's nodes leave for its later nodes (``MoEState``), and ``pass_leading``,
which lets a node read only its own trailing tensors (``moe.layer``'s node table)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megapipe.moe.dispatcher import DispatchSplits
from megapipe.moe.waves import WaveSplits
from megapipe.overlap.plan import LayerState, NodeFn, NodeKind


@dataclass(eq=False, slots=True)
class MoEState(LayerState):
    """One MoE layer's scratch for one microbatch: route writes all but the splits; dispatch
    (or wave 0's dispatch) writes the splits. With a rank capacity every field a later node
    reads is a plain value or a device tensor (no host list, no object), so the nodes that
    read them can be captured into CUDA graphs (``graphs.nodes``)."""

    aux_loss_scale: float | None = None  # the scale of the aux-loss gradient, fixed at forward
    input_shape: torch.Size | None = None  # x's shape, which finish gives its output
    row_choice: torch.Tensor | None = None  # per permuted row, its flat choice (-1: padding)
    choice_rows: torch.Tensor | None = None  # per token and choice, its row (-1: dropped)
    rows_per_expert: torch.Tensor | None = None  # per expert label (a capacity: all of it)
    capacity: int | None = None  # rows per expert (None: dropless)
    dispatch_splits: DispatchSplits | None = None  # the all-to-all's sizes (one wave)
    wave_splits: list[WaveSplits] | None = None  # per wave, its all-to-all's sizes
    # a rank capacity's exchange (moe.rank_capacity), in the nodes that run it: route plans
    # the sends, dispatch exchanges, experts orders what arrived, finish takes its rows back
    lane: int | None = None  # rows per lane (None: no rank capacity in this forward)
    send_counts: torch.Tensor | None = None  # [ep, local] rows sent to each expert (route)
    return_index: torch.Tensor | None = None  # each row's place in the returned lanes (route)
    received_counts: torch.Tensor | None = None  # [ep, local] rows received (dispatch)

    def crossing(self, reader: NodeKind) -> tuple[torch.Tensor, ...]:
        """The dispatch's tensors the experts read on the compute stream: the grouped-GEMM
        offsets (dropless; deferred weight-gradient closures keep them after the layer's
        backward, past the comm stream's last wait for the compute stream), or a rank
        capacity's received counts. (Route's row counts, read by the dispatch on the comm
        stream, need nothing: the compute stream waits for the dispatch before the state can
        drop them; ``tests/support/stream_checker.py`` checks both.)"""
        if reader is not NodeKind.COMPUTE:
            return ()
        if self.received_counts is not None:
            return (self.received_counts,)
        splits = self.dispatch_splits
        if splits is None or splits.local_offsets is None:
            return ()
        return (splits.local_offsets,)


def pass_leading(fn: NodeFn, num_own: int) -> NodeFn:
    """Wrap a node fn reading exactly ``num_own`` tensors so leading extras pass through."""

    def wrapped(state: LayerState, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if len(tensors) < num_own:
            raise ValueError(f"node needs {num_own} trailing tensors, got {len(tensors)}")
        split = len(tensors) - num_own
        return tuple(tensors[:split]) + tuple(fn(state, tuple(tensors[split:])))

    return wrapped
