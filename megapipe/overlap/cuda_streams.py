"""The CUDA implementation of ``streams``' interface: ``CudaStream`` and its ``CudaEvent``.

``fn`` runs on the host at once with the stream current (the compute stream is the device's
current stream: no switch), so its kernels queue on it; the combined step's events are made
once and reused (``run``, ``recycle``); a tensor handed to another stream gets
``record_stream``. Every ``torch.cuda`` call goes through ``cuda_api.CudaApi``, so a stand-in
API can check them on CPU. Same semantics as the CPU streams (``streams``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megapipe.overlap.cuda_api import CudaApi, CudaMark, tensors_in
from megapipe.overlap.streams import Event, Stream


class CudaEvent(Event):
    """A CUDA event recorded on its producer stream, with the value of the work before it."""

    def __init__(self, event: Any, value: Any, producer: CudaStream) -> None:
        self.event = event
        self.value = value
        self.producer = producer

    def synchronize(self) -> None:
        self.event.synchronize()

    def query(self) -> bool:
        return self.event.query()

    def value_on(self, stream: Stream) -> Any:
        if not isinstance(stream, CudaStream):
            raise TypeError(f"a CUDA event's value can go only to a CudaStream, not {stream!r}")
        stream.wait_event(self)
        if stream.stream is not self.producer.stream:
            stream.record_use(self.value)
        return self.value


class CudaStream(Stream):
    """A CUDA stream; ``fn`` runs on the host at once with this stream current.

    ``current``: this stream is the device's current stream while work is submitted (the
    compute stream), so work runs without a stream switch. ``run`` (the combined step's way in)
    records its events into a pool that ``recycle`` hands out again: events are made once.
    """

    keeps_memory = True

    def __init__(
        self,
        name: str,
        device: torch.device,
        priority: int = 0,
        stream: torch.cuda.Stream | None = None,
        current: bool = False,
        api: CudaApi | None = None,
    ) -> None:
        self.name = name
        self.device = device
        self.api = api if api is not None else CudaApi()
        if stream is None:
            stream = torch.cuda.Stream(device=device, priority=priority)
        self.stream = stream
        self.current = current
        self._pool: list[Any] = []  # events ``run`` records, reused after ``recycle``
        self._used = 0

    def _call(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if self.current:
            return fn(*args, **kwargs)
        with self.api.switch(self.stream):
            return fn(*args, **kwargs)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Event:
        value = self._call(fn, args, kwargs)
        event = self.api.new_event()
        self.api.record(event, self.stream)
        return CudaEvent(event, value, self)

    def run(
        self, fn: Callable[..., Any] | None, args: tuple = (), record: bool = True
    ) -> Event | None:
        if fn is not None:
            self._call(fn, args, {})
        if not record:
            return None
        if self._used == len(self._pool):
            self._pool.append(self.api.new_event())
        event = self._pool[self._used]
        self._used += 1
        self.api.record(event, self.stream)
        return CudaEvent(event, None, self)

    def recycle(self) -> None:
        self._used = 0
        if self.current and self.api.current_stream(self.device) != self.stream:
            raise RuntimeError(
                f"stream {self.name!r} must stay the device's current stream while megapipe "
                "runs (its work is issued without switching to it)"
            )

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, CudaEvent):
            raise TypeError(
                f"a CudaStream can wait only on a CudaEvent, not {type(event).__name__}"
            )
        self.api.wait(self.stream, event.event)

    def record_event(self) -> Event:
        event = self.api.new_event()
        self.api.record(event, self.stream)
        return CudaEvent(event, None, self)

    def mark(self) -> CudaMark:
        return CudaMark(self.stream)

    def record_use(self, values: Any) -> None:
        for t in tensors_in(values):
            self.api.keep(t, self.stream)
