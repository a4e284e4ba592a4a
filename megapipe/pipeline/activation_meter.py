"""Measured activation memory of one step: the peak bytes of the tensors saved for backward.

``ActivationMeter`` installs saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``)
for the duration of a step. Every tensor autograd saves is counted by its storage: a storage
counts once however many saved tensors (views) share it, from the first save until the last of
them is released (the graph node that saved it is freed after its backward, or with its graph).
``peak_bytes`` is the most bytes held at once. The hooks only read host-side metadata (storage
address and size), so they add no device synchronisation and change no result: unpack returns
the very tensor that was packed.

On CUDA the meter also reads the caching allocator's peak: ``cuda_peak_bytes`` is
``max_memory_allocated`` during the step minus what was allocated when it began (the peak
statistic is reset at the start; host-side counters, no sync). It includes everything the step
allocates (stashed pipeline tensors, temporaries), so it bounds the saved-tensor figure above.

Hooks are per thread: ops of the communication stream's worker thread (CPU all-to-alls, which
save no activations) are not seen. Tensors a node boundary holds without any op saving them
are not counted by the hooks (on CUDA the allocator figure has them).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch


class _Saved:
    """What the pack hook returns: the tensor, and the storage it keeps counted."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class ActivationMeter:
    """Counts the bytes of distinct storages saved for backward; ``with meter:`` measures."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self.live_bytes = 0
        self.peak_bytes = 0
        self.cuda_peak_bytes: int | None = None
        self._counts: dict[tuple, int] = {}
        self._lock = threading.Lock()
        self._hooks: Any = None
        self._cuda_start = 0

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        storage = tensor.untyped_storage()
        key = (tensor.device, storage.data_ptr())
        with self._lock:
            count = self._counts.get(key, 0)
            self._counts[key] = count + 1
            if count == 0:
                self.live_bytes += storage.nbytes()
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        # detached: a saved output would otherwise hold its own grad_fn, a cycle that keeps
        # the graph alive (same storage and data, so backward reads the same values)
        saved = _Saved(tensor.detach())
        weakref.finalize(saved, self._release, key, storage.nbytes())
        return saved

    def _release(self, key: tuple, nbytes: int) -> None:
        with self._lock:
            count = self._counts[key] - 1
            if count:
                self._counts[key] = count
            else:
                del self._counts[key]
                self.live_bytes -= nbytes

    @staticmethod
    def _unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    def _on_cuda(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def __enter__(self) -> "ActivationMeter":
        self.peak_bytes = self.live_bytes
        if self._on_cuda():
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_start = torch.cuda.memory_allocated(self.device)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None
        if self._on_cuda():
            self.cuda_peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._cuda_start
