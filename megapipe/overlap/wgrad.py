"""Deferred weight gradients (Megatron's ``delay_wgrad_compute``, DualPipe's W action).

A backward normally computes, for each matmul ``y = x @ W``, both the input gradient
``dx = dy @ W^T`` (needed at once by the previous layer) and the weight gradient
``dW = x^T @ dy`` (needed only by the optimizer). Deferring ``dW`` into a ``WeightGradQueue``
lets it fill time later, e.g. while a backward all-to-all is in flight.

The queue is an object handed down explicitly: an op finds it at backward time through the
layer's ``LayerState`` it was given at forward time, whose ``wgrad_queue`` field the tape sets
for the duration of that layer's backward (None: compute now).
The deferred closure performs exactly the operations the immediate path performs and adds the
result into ``.grad`` (or the fp32 ``main_grad``, ``precision.main_grad``) the way autograd's
accumulation does, so gradients are bitwise equal with and without deferral (as long as each
weight is used by one such op per backward, so that no two contributions are summed before
reaching ``.grad``).

``grouped_matmul`` computes in the operands' dtype (bf16 in a bf16 model) and, under
``torch.autocast``, in the autocast dtype, returning each gradient in its input's dtype; its
GEMMs are one grouped kernel when the caller gives device offsets (``moe.grouped_gemm``).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Sequence

import torch

from megapipe.moe.grouped_gemm import (
    grouped_forward, grouped_input_grad, grouped_weight_grad,
)
from megapipe.precision.main_grad import accumulate_grad_rows

Track = Callable[[Sequence[Any]], None]
"""``track(values)``: the engine keeps these tensors until their backward or later use (the
pipeline's activation meter counts them, ``pipeline.activation_meter``)."""


class WeightGradQueue:
    """Deferred weight-gradient computations, run in the order they were queued.

    ``track`` (optional) is told of the tensors each item keeps until it runs (``put``'s
    ``keeps``), so the activation meter counts them."""

    def __init__(self, track: Track | None = None) -> None:
        self._work: deque[tuple[str, Callable[[], None]]] = deque()
        self.track = track

    def put(
        self, fn: Callable[[], None], name: str = "wgrad", keeps: Sequence[Any] = ()
    ) -> None:
        """Queue ``fn``; ``keeps``: the tensors it holds until it runs (other values skipped)."""
        if self.track is not None:
            self.track(keeps)
        self._work.append((name, fn))

    def __len__(self) -> int:
        return len(self._work)

    def names(self) -> list[str]:
        return [name for name, _ in self._work]

    def wrap_last(self, count: int, wrapper: Callable[[Callable[[], None]], Callable[[], None]]
                  ) -> None:
        """Replace each of the ``count`` items queued last by ``wrapper(item)`` (instrumentation:
        the replay benchmark makes each deferred GEMM last its profile time)."""
        for index in range(len(self._work) - count, len(self._work)):
            name, fn = self._work[index]
            self._work[index] = (name, wrapper(fn))

    def run(self, limit: int | None = None) -> int:
        """Run everything queued so far (FIFO), or its first ``limit`` items; return how many
        items ran."""
        count = 0
        while self._work and (limit is None or count < limit):
            _, fn = self._work.popleft()
            with torch.no_grad():
                fn()
            count += 1
        return count


def queue_of(state: Any) -> WeightGradQueue | None:
    """The queue a deferrable op should use now: the ``wgrad_queue`` of ``state`` (a layer's
    ``plan.LayerState``; None: no deferral)."""
    return None if state is None else state.wgrad_queue


class _GroupedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, counts, weight, state, offsets, first):  # type: ignore[override]
        dtype = _compute_dtype(x, weight)
        used = weight if first == 0 and len(counts) == weight.shape[0] else (
            weight[first : first + len(counts)]
        )
        x_c, w_c = x.to(dtype), used.to(dtype)
        ctx.save_for_backward(x_c, w_c, offsets)
        # the parameter itself, not saved: under saved-tensor hooks (the activation meter's) a
        # saved tensor comes back as a new tensor object, whose .grad / main_grad are not the
        # parameter's, so a deferred gradient accumulated there would be lost
        ctx.weight = weight
        ctx.counts, ctx.state, ctx.first = counts, state, first
        ctx.x_dtype = x.dtype
        with torch.autocast(x.device.type, enabled=False):
            return grouped_forward(x_c, w_c, counts, offsets)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x, w, offsets = ctx.saved_tensors
        weight = ctx.weight
        counts = ctx.counts
        grad_out = grad_out.to(w.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grouped_input_grad(grad_out, w, counts, offsets).to(ctx.x_dtype)
        if not ctx.needs_input_grad[2]:
            return grad_x, None, None, None, None, None
        first = ctx.first

        def weight_grad() -> torch.Tensor:
            return grouped_weight_grad(x, grad_out, w, counts, offsets).to(weight.dtype)

        queue = queue_of(ctx.state)
        ctx.state = None
        if queue is None:
            grad_w = weight_grad()
            if grad_w.shape != weight.shape:  # a group of the weight's groups: zeros elsewhere
                padded = torch.zeros_like(weight)
                padded[first : first + len(counts)] = grad_w
                grad_w = padded
            return grad_x, None, grad_w, None, None, None
        if weight.grad_fn is not None or not weight.is_leaf:
            raise RuntimeError(
                "grouped_matmul can defer the weight gradient only for a leaf weight "
                "(a Parameter); "
                f"got a weight with grad_fn {type(weight.grad_fn).__name__}"
            )
        queue.put(
            lambda: accumulate_grad_rows(weight, first, weight_grad()), name="grouped_matmul",
            keeps=(x, grad_out, w, offsets),
        )
        return grad_x, None, None, None, None, None


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on for ``x``'s device, else the operands' own."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    if x.dtype != weight.dtype:
        raise TypeError(
            f"grouped_matmul: x is {x.dtype} but weight is {weight.dtype}; cast the model "
            "(e.g. to bf16 with fp32 main weights) or run under torch.autocast"
        )
    return x.dtype


def grouped_matmul(
    x: torch.Tensor, counts: Sequence[int], weight: torch.Tensor,
    state: Any = None, offsets: torch.Tensor | None = None, first: int = 0,
) -> torch.Tensor:
    """``cat_i(x_i @ weight[first + i])`` for ``x`` split into row groups of ``counts``.

    ``weight`` is ``[groups, in, out]``; ``counts`` has one entry per group used, from group
    ``first`` on (zeros allowed; all groups by default).
    ``offsets`` (int32 on ``x``'s device: each group's end row) allows the one-kernel grouped
    GEMM; without them a loop over the groups runs. Its backward defers the weight gradient
    into ``state.wgrad_queue`` when that is set.
    """
    counts = tuple(int(c) for c in counts)
    if weight.dim() != 3 or not counts or first < 0 or first + len(counts) > weight.shape[0]:
        raise ValueError(
            f"grouped_matmul: weight of shape {tuple(weight.shape)} needs one count per group, "
            f"got {len(counts)} counts (for the groups from {first} on)"
        )
    if sum(counts) != x.shape[0]:
        raise ValueError(f"grouped_matmul: counts sum to {sum(counts)} but x has {x.shape[0]} rows")
    if offsets is not None and (
        first != 0 or len(counts) != weight.shape[0] or offsets.shape != (len(counts),)
    ):
        raise ValueError(
            f"grouped_matmul: offsets of shape {tuple(offsets.shape)} need one entry per group "
            f"({weight.shape[0]}) and all groups (first={first})"
        )
    return _GroupedMatmul.apply(x, counts, weight, state, offsets, first)
