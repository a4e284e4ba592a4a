"""Measured activation memory of one step: the peak bytes of the tensors saved for backward and
of the tensors the pipeline holds.

``ActivationMeter`` counts storages, each once however many tensors (views) share it and
whether it is saved, held, or both:

- *saved for backward*: saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``),
  installed for the duration of a step, see every tensor autograd saves; it counts from the
  first save until the last graph node that saved it is freed (after its backward, or with its
  graph);
- *held by the pipeline*: ``track(values)`` is called where the engine keeps a tensor
  (a stage's received or handed-over input, its output until sent and until its backward, the
  scaled loss, the tape's node-boundary tensors, what a deferred weight gradient keeps for
  later); it counts from then until the storage is freed.

``holders`` (objects with a ``track`` attribute: the executor's stage workers and data in
transit) get ``track`` while the meter measures, None after. ``peak_bytes`` is the most bytes
counted at once. Storages of ``params`` (the stages'
parameters, and views of them) are never counted: they are not activations. Only host-side
metadata is read (storage address and size), so the meter adds no device synchronisation;
unpack returns a tensor with the very storage that was packed, so no value changes. One
difference hooks make that code must not depend on: a saved tensor comes back as a new tensor
object, so a custom autograd Function whose backward uses a saved *parameter's* identity (its
``.grad`` or ``main_grad``) must keep the parameter on ``ctx`` instead (megapipe's
``grouped_matmul`` does).

On CUDA the meter also reads the caching allocator's peak: ``cuda_peak_bytes`` is
``max_memory_allocated`` during the step minus what was allocated when it began (the peak
statistic is reset at the start; host-side counters, no sync). It includes every temporary too.

Saved-tensor hooks are per thread: ops of the communication stream's worker thread (CPU
all-to-alls, which save no activations) are not seen; ``track`` is thread-safe.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch

Key = tuple[torch.device, int]


def _key(tensor: torch.Tensor) -> tuple[Key, int]:
    storage = tensor.untyped_storage()
    return (tensor.device, storage.data_ptr()), storage.nbytes()


class _Saved:
    """What the pack hook returns: the tensor, while its storage stays counted."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class ActivationMeter:
    """Peak bytes of distinct storages saved for backward or held (module docstring);
    ``with meter:`` measures."""

    def __init__(
        self,
        device: torch.device | None = None,
        params: Iterable[torch.Tensor] = (),
        holders: Sequence[Any] = (),
    ) -> None:
        self.device = device
        self.holders = holders
        self.live_bytes = 0
        self.peak_bytes = 0
        self.cuda_peak_bytes: int | None = None
        self._params = {_key(p)[0] for p in params}
        self._saved: dict[Key, int] = {}  # saved references alive, per storage
        self._held: dict[Key, weakref.finalize] = {}  # held storages not yet freed
        self._lock = threading.RLock()  # a collection inside may free a storage
        self._hooks: Any = None
        self._cuda_start = 0

    # ------------------------------------------------------------------ counting
    def _counted(self, key: Key) -> bool:
        return key in self._saved or key in self._held

    def _grow(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        # detached: a saved output would otherwise hold its own grad_fn, a cycle that keeps
        # the graph alive (same storage and data, so backward reads the same values)
        saved = _Saved(tensor.detach())
        key, nbytes = _key(tensor)
        if nbytes == 0 or key in self._params:
            return saved
        with self._lock:
            if not self._counted(key):
                self._grow(nbytes)
            self._saved[key] = self._saved.get(key, 0) + 1
        weakref.finalize(saved, self._unsave, key, nbytes)
        return saved

    def _unsave(self, key: Key, nbytes: int) -> None:
        with self._lock:
            count = self._saved.pop(key) - 1
            if count:
                self._saved[key] = count
            elif key not in self._held:
                self.live_bytes -= nbytes

    @staticmethod
    def _unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    def track(self, values: Iterable[Any]) -> None:
        """The pipeline holds these tensors (other values are skipped): count each storage
        not counted yet until it is freed."""
        for value in values:
            if not isinstance(value, torch.Tensor):
                continue
            key, nbytes = _key(value)
            if nbytes == 0 or key in self._params:
                continue
            with self._lock:
                if key in self._held:
                    continue
                if key not in self._saved:
                    self._grow(nbytes)
                token = weakref.finalize(value.untyped_storage(), self._free, key, nbytes)
                self._held[key] = token

    def _free(self, key: Key, nbytes: int) -> None:
        with self._lock:
            self._held.pop(key, None)
            if key not in self._saved:
                self.live_bytes -= nbytes

    # ------------------------------------------------------------------ a step
    def _on_cuda(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def __enter__(self) -> ActivationMeter:
        self.peak_bytes = self.live_bytes
        if self._on_cuda():
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_start = torch.cuda.memory_allocated(self.device)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        for holder in self.holders:
            holder.track = self.track
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None
        for holder in self.holders:
            holder.track = None
        if self._on_cuda():
            self.cuda_peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._cuda_start
