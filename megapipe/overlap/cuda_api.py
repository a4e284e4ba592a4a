"""The ``torch.cuda`` calls of a ``CudaStream`` (``cuda_streams``), in one place; its timing mark.

``CudaApi`` is the one seam between the CUDA streams and ``torch.cuda``: a stand-in that counts
or checks the calls runs the CUDA path's logic on CPU (``benchmarks/engine_primitives.py``, the
stream checker of the tests). ``CudaMark`` is a timing point a CUDA stream records for
``NodeTrace``.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value``: a tensor, or tuples and lists of them, nested."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    return []


class CudaMark:
    """A timing event recorded on a CUDA stream, with the host time at which it was recorded."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.event = torch.cuda.Event(enable_timing=True)
        self.event.record(stream)
        self.host = time.perf_counter()

    def host_time_of(self, other: CudaMark) -> float:
        """When ``other`` was reached on the GPU, on the host clock's scale with this mark as
        the origin (waits until ``other`` is reached)."""
        other.event.synchronize()
        return self.host + self.event.elapsed_time(other.event) / 1e3


class CudaApi:
    """The ``torch.cuda`` calls a ``CudaStream`` makes, in one place: a stand-in that counts
    them runs the CUDA path's logic on CPU (the engine-cost count of ``benchmarks/host_cost.py``
    and its tests)."""

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def switch(self, stream: Any) -> Any:
        """A context in which ``stream`` is the current stream."""
        return torch.cuda.stream(stream)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def keep(self, tensor: torch.Tensor, stream: Any) -> None:
        """``record_stream``: the allocator keeps ``tensor``'s memory until ``stream``'s work
        queued so far is done."""
        if tensor.is_cuda:
            tensor.record_stream(stream)
