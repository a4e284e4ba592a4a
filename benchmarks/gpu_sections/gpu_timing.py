"""Timing on the device: CUDA events on a GPU, the host clock on CPU, behind one interface.

- ``time_ms(fn, device)``: device milliseconds of ``fn``'s work (events around it on the
  current stream, then a sync), plus the host milliseconds it took to issue that work.
- ``node_spans(trace)``: the node timeline of a step from megapipe's own ``NodeTrace`` (CUDA
  events around every node on CUDA, the host clock on CPU) as ``timeline.Span``s in
  milliseconds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gpu_sections.timeline import Span
from megapipe.overlap.node_trace import NodeTrace


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
    return Timed(
        statistics.median(r.device_ms for r in runs), statistics.median(r.host_ms for r in runs)
    )


def node_spans(trace: NodeTrace) -> list[Span]:
    """The trace's nodes as spans in milliseconds from the first node's start (reading a CUDA
    trace waits for its work)."""
    spans = trace.spans
    if not spans:
        return []
    origin = min(s.start for s in spans)
    return [Span(s.kind, (s.start - origin) * 1e3, (s.end - origin) * 1e3, s.label(), s.stream)
            for s in spans]
