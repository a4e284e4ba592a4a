"""Deferred weight gradients (Megatron's ``delay_wgrad_compute``, DualPipe's W step).

A backward normally computes, for each matmul ``y = x @ W``, both the input gradient
``dx = dy @ W^T`` (needed at once by the previous layer) and the weight gradient
``dW = x^T @ dy`` (needed only by the optimizer). Deferring ``dW`` into a ``WeightGradQueue``
lets it fill time later, e.g. while a backward all-to-all is in flight.

The queue is an object handed down explicitly: an op finds it at backward time through the
layer's ``LayerState`` it was given at forward time, whose ``wgrad_queue`` field the tape sets
for the duration of that layer's backward (None: compute now).
The deferred closure performs exactly the operations the immediate path performs and adds the
result into ``.grad`` the way autograd's accumulation does, so gradients are bitwise equal with
and without deferral (as long as each weight is used by one such op per backward, so that no
two contributions are summed before reaching ``.grad``).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable, Sequence

import torch

if TYPE_CHECKING:
    from megapipe.overlap.plan import LayerState


class WeightGradQueue:
    """Deferred weight-gradient computations, run in the order they were queued."""

    def __init__(self) -> None:
        self._work: deque[tuple[str, Callable[[], None]]] = deque()

    def put(self, fn: Callable[[], None], name: str = "wgrad") -> None:
        self._work.append((name, fn))

    def __len__(self) -> int:
        return len(self._work)

    def names(self) -> list[str]:
        return [name for name, _ in self._work]

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


def queue_of(state: "LayerState | None") -> WeightGradQueue | None:
    """The queue a deferrable op should use now: ``state.wgrad_queue`` (None: no deferral)."""
    return None if state is None else state.wgrad_queue


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add ``grad`` into ``param.grad`` as autograd's accumulation does (same bits)."""
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


def accumulate_grad_groups(param: torch.Tensor, first: int, grad: torch.Tensor) -> None:
    """Add ``grad`` into ``param.grad[first:first + len(grad)]`` (the rest of a fresh ``.grad``
    is zeros), which equals adding the zero-padded gradient as autograd would."""
    if first == 0 and grad.shape == param.shape:
        accumulate_grad(param, grad)
        return
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    param.grad[first : first + grad.shape[0]].add_(grad)


class _GroupedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, counts: tuple[int, ...], weight: torch.Tensor, state, first: int):
        chunks = torch.split(x, list(counts), dim=0)
        ctx.save_for_backward(x, weight)
        ctx.counts, ctx.state, ctx.first = counts, state, first
        return torch.cat([chunk @ weight[first + i] for i, chunk in enumerate(chunks)], dim=0)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        counts, first = list(ctx.counts), ctx.first
        grad_chunks = torch.split(grad_out, counts, dim=0)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.cat(
                [g @ weight[first + i].t() for i, g in enumerate(grad_chunks)], dim=0
            )
        if not ctx.needs_input_grad[2]:
            return grad_x, None, None, None, None
        x_chunks = torch.split(x, counts, dim=0)

        def weight_grad() -> torch.Tensor:
            return torch.stack([xc.t() @ g for xc, g in zip(x_chunks, grad_chunks)])

        queue = queue_of(ctx.state)
        ctx.state = None
        if queue is None:
            grad_w = weight_grad()
            if grad_w.shape != weight.shape:  # a group of the weight's groups: zeros elsewhere
                padded = torch.zeros_like(weight)
                padded[first : first + len(counts)] = grad_w
                grad_w = padded
            return grad_x, None, grad_w, None, None
        if weight.grad_fn is not None or not weight.is_leaf:
            raise RuntimeError(
                "grouped_matmul can defer the weight gradient only for a leaf weight "
                "(a Parameter); "
                f"got a weight with grad_fn {type(weight.grad_fn).__name__}"
            )
        queue.put(
            lambda: accumulate_grad_groups(weight, first, weight_grad()), name="grouped_matmul"
        )
        return grad_x, None, None, None, None


def grouped_matmul(
    x: torch.Tensor, counts: Sequence[int], weight: torch.Tensor,
    state: "LayerState | None" = None, first: int = 0,
) -> torch.Tensor:
    """``cat_i(x_i @ weight[first + i])`` for ``x`` split into row groups of ``counts``.

    ``weight`` is ``[groups, in, out]``; ``counts`` has one entry per group used, from group
    ``first`` on (zeros allowed). Its backward defers the weight gradient into
    ``state.wgrad_queue`` when that is set.
    """
    counts = tuple(int(c) for c in counts)
    if weight.dim() != 3 or not counts or first < 0 or first + len(counts) > weight.shape[0]:
        raise ValueError(
            f"grouped_matmul: weight of shape {tuple(weight.shape)} needs one count per group, "
            f"got {len(counts)} counts (for the groups from {first} on)"
        )
    if sum(counts) != x.shape[0]:
        raise ValueError(f"grouped_matmul: counts sum to {sum(counts)} but x has {x.shape[0]} rows")
    return _GroupedMatmul.apply(x, counts, weight, state, first)
