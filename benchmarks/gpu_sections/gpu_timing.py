"""Timing on the device: CUDA events on a GPU, the host clock on CPU, behind one interface.

- ``time_ms(fn, device)``: device milliseconds of ``fn``'s work (events around it on the
  current stream, then a sync), plus the host milliseconds it took to issue that work.
- ``EventTrace``: a ``NodeTrace`` that also records a CUDA event pair on the node's stream
  around every node the co-scheduler issues (and, optionally, a profiler annotation), so a
  combined step yields a device timeline of its nodes (``gpu_spans``).
- ``TimedStreams``: ``Streams`` that note when the host finished issuing (the co-scheduler's
  final synchronize), to tell host issue time from device time.
- ``sleep_cycles_per_ms``: calibrates ``torch.cuda._sleep`` (a spin kernel counted in clock
  cycles) so a modelled link can wait a given number of milliseconds on a stream.
"""

from __future__ import annotations

import functools
import statistics
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from megapipe.overlap.node_trace import NodeTrace
from megapipe.overlap.streams import Streams

from gpu_sections.timeline import Span
from gpu_sections.trace_analysis import annotation_name


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Timed:
    device_ms: float  # the work's time on the device (host time on CPU)
    host_ms: float  # time the host spent in ``fn`` (issuing, and any host waits inside it)


def time_ms(fn: Callable[[], Any], device: torch.device) -> Timed:
    """Time one call of ``fn`` (the device is synchronized before and after)."""
    synchronize(device)
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        elapsed = (time.perf_counter() - start) * 1e3
        return Timed(elapsed, elapsed)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    start = time.perf_counter()
    fn()
    host = (time.perf_counter() - start) * 1e3
    end.record()
    end.synchronize()
    return Timed(begin.elapsed_time(end), host)


def median_ms(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int = 1) -> Timed:
    """Median device and host milliseconds of ``reps`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        time_ms(fn, device)
    runs = [time_ms(fn, device) for _ in range(reps)]
    return Timed(statistics.median(r.device_ms for r in runs), statistics.median(r.host_ms for r in runs))


@dataclass
class _Mark:
    label: str
    stream: str
    kind: str
    start: Any  # torch.cuda.Event, or a perf_counter value on CPU
    end: Any


class EventTrace(NodeTrace):
    """A NodeTrace that also times every node on the device.

    On CUDA an event pair is recorded on the current stream (the node's stream: the co-scheduler
    enters the span inside ``stream.submit``) around the node; on CPU the host times are the
    timeline. ``annotate=True`` also opens a profiler range named by ``annotation_name``.
    """

    def __init__(self, device: torch.device, annotate: bool = False) -> None:
        super().__init__()
        self.cuda = device.type == "cuda"
        self.annotate = annotate
        self.marks: list[_Mark] = []
        self.origin = self.stamp()

    def stamp(self) -> Any:
        """Now on the current stream: a recorded CUDA event (CUDA), the host clock (CPU)."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextmanager
    def span(self, microbatch, layer, node, direction, stream, kind, slot=-1,  # noqa: ANN001
             **extra) -> Iterator[None]:  # noqa: ANN003
        label = f"{direction}{'' if microbatch is None else microbatch}.{layer}.{node}"
        ranged = (torch.profiler.record_function(annotation_name(label, stream, kind))
                  if self.annotate else nullcontext())
        with ranged, super().span(microbatch, layer, node, direction, stream, kind, slot, **extra):
            start = self.stamp()
            try:
                yield
            finally:
                self.marks.append(_Mark(label, stream, kind, start, self.stamp()))

    def elapsed_ms(self, stamp: Any) -> float:
        """Milliseconds from this trace's creation to ``stamp`` (synchronize first on CUDA)."""
        if not self.cuda:
            return (stamp - self.origin) * 1e3
        return self.origin.elapsed_time(stamp)

    def gpu_spans(self) -> list[Span]:
        """The nodes' device intervals in ms from this trace's creation (synchronize first)."""
        return [Span(m.kind, self.elapsed_ms(m.start), self.elapsed_ms(m.end), m.label, m.stream)
                for m in self.marks]


@dataclass
class TimedStreams(Streams):
    """Streams that remember when the host asked to wait for them (the end of issuing)."""

    waits: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, streams: Streams) -> "TimedStreams":
        return cls(streams.compute, streams.comm)

    def synchronize(self) -> None:
        self.waits.append(time.perf_counter())
        super().synchronize()


@functools.cache
def sleep_cycles_per_ms(device: torch.device, cycles: int = 20_000_000) -> float:
    """Clock cycles ``torch.cuda._sleep`` spins per millisecond on this GPU (measured)."""
    torch.cuda._sleep(1000)  # load the kernel
    timed = median_ms(lambda: torch.cuda._sleep(cycles), device, reps=3)
    return cycles / timed.device_ms
