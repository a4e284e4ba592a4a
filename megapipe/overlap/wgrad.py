"""Deferred weight gradients (Megatron's ``delay_wgrad_compute``, DualPipe's W action).

A backward normally computes, for each matmul ``y = x @ W``, both the input gradient
``dx = dy @ W^T`` (needed at once by the previous layer) and the weight gradient
``dW = x^T @ dy`` (needed only by the optimizer). Deferring ``dW`` into a ``WeightGradQueue``
lets it fill time later, e.g. while a backward all-to-all is in flight.

The queue is an object handed down explicitly: an op finds it at backward time through the
layer's ``LayerState`` it was given at forward time, whose ``wgrad_queue`` field the tape sets
for the duration of that layer's backward (None: compute now).
A deferred closure performs exactly the operations the immediate path performs and adds the
result into ``.grad`` (or the fp32 ``main_grad``, ``precision.main_grad``) the way autograd's
accumulation does, so gradients are bitwise equal with and without deferral (as long as each
weight is used by one such op per backward, so that no two contributions are summed before
reaching ``.grad``).

The experts' ``moe.grouped_gemm.grouped_matmul`` is such an op.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

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

    def put(self, fn: Callable[[], None], name: str = "wgrad", keeps: Sequence[Any] = ()) -> None:
        """Queue ``fn``; ``keeps``: the tensors it holds until it runs (other values skipped)."""
        if self.track is not None:
            self.track(keeps)
        self._work.append((name, fn))

    def __len__(self) -> int:
        return len(self._work)

    def names(self) -> list[str]:
        return [name for name, _ in self._work]

    def wrap_last(
        self, count: int, wrapper: Callable[[Callable[[], None]], Callable[[], None]]
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
