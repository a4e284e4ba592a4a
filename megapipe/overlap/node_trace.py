"""A recorder of the nodes the combined step issued: who ran where, when.

Each span names the microbatch, the layer, the node, the direction (F forward, B backward,
W deferred weight gradients), the stream, the combined step's slot (spans with one slot were
issued side by side), and start/end times in seconds (``time.perf_counter`` scale).

Times are those of the stream that ran the work, so the exposed-communication fraction means the
same on both devices. On CPU a span is timed with the host clock around the work, on the thread
that ran it. On CUDA the work is only queued by the host, so a span records two timing events on
its stream (``Stream.mark``) and is *resolved* when read (``spans``, after the step): its start
and end are GPU times, placed on the host clock's scale through the trace's first event.
Reading the spans of a CUDA trace therefore waits for the recorded work (outside the hot path).
With ``annotate=True`` each span also opens a ``torch.profiler.record_function`` range named by
its label, so a PyTorch profiler trace shows megapipe's nodes (``--use-pytorch-profiler``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from megapipe.schedule.timing.intervals import covered_total, union


@dataclass(frozen=True)
class NodeSpan:
    microbatch: int | None
    layer: int
    node: str
    direction: str  # "F", "B" or "W"
    stream: str
    kind: str  # "compute" or "comm"
    start: float
    end: float
    slot: int = -1  # spans with the same slot were issued side by side by the combined step

    @property
    def duration(self) -> float:
        return self.end - self.start

    def label(self) -> str:
        return span_label(self.microbatch, self.layer, self.node, self.direction)


def span_label(microbatch: int | None, layer: int, node: str, direction: str) -> str:
    """``F3.1.layer1.dispatch``: direction and microbatch, layer, node; just the node for a span
    of no layer (``layer`` -1: a profiled step's actions and waits, ``pipeline.step_profile``)."""
    if layer < 0:
        return node
    return f"{direction}{'' if microbatch is None else microbatch}.{layer}.{node}"


def _profiler_range(label: str) -> Any:
    from torch.profiler import record_function  # only when a PyTorch profiler run asks

    return record_function(f"megapipe {label}")


class NodeTrace:
    """Thread-safe list of ``NodeSpan`` (the combined step appends from two threads on CPU)."""

    def __init__(
        self, clock: Callable[[], float] = time.perf_counter, annotate: bool = False
    ) -> None:
        self.clock = clock
        self.annotate = annotate
        self._spans: list[NodeSpan] = []
        # (microbatch, layer, node, direction, stream, kind), slot, start mark, end mark
        self._unresolved: list[
            tuple[tuple[int | None, int, str, str, str, str], int, Any, Any]
        ] = []
        self._origin: Any = None  # the first device mark: where device times meet the host clock
        self._lock = threading.Lock()
        self._slots = 0

    @contextmanager
    def span(
        self,
        microbatch: int | None,
        layer: int,
        node: str,
        direction: str,
        stream: Any,
        kind: str,
        slot: int = -1,
    ) -> Iterator[None]:
        """Time the work inside the ``with`` block. ``stream``: the ``Stream`` it runs on (its
        ``mark()`` times it: GPU events on CUDA, None = the host clock) or just its name."""
        name = stream if isinstance(stream, str) else stream.name
        ranges = nullcontext()
        if self.annotate:
            ranges = _profiler_range(span_label(microbatch, layer, node, direction))
        start = self._mark(stream)
        try:
            with ranges:
                yield
        finally:
            end = self._mark(stream)
            fields = (microbatch, layer, node, direction, name, kind)
            with self._lock:
                if isinstance(start, float):
                    self._spans.append(NodeSpan(*fields, start, end, slot))
                else:
                    if self._origin is None:
                        self._origin = start
                    self._unresolved.append((fields, slot, start, end))

    def _mark(self, stream: Any) -> Any:
        mark = None if isinstance(stream, str) else stream.mark()
        return self.clock() if mark is None else mark

    @property
    def spans(self) -> list[NodeSpan]:
        """Every recorded span (device spans are resolved first, which waits for their work)."""
        with self._lock:
            for fields, slot, start, end in self._unresolved:
                origin = self._origin
                self._spans.append(
                    NodeSpan(*fields, origin.host_time_of(start), origin.host_time_of(end), slot)
                )
            self._unresolved.clear()
            return list(self._spans)

    def new_slot(self) -> int:
        """A slot number never handed out before by this trace (combined steps sharing one
        trace number their slots from here, so ``slots()`` never mixes two runners)."""
        with self._lock:
            self._slots += 1
            return self._slots

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()
            self._unresolved.clear()
            self._origin = None

    def slots(self) -> list[list[NodeSpan]]:
        """Spans grouped by combined-step slot, in issue order (what ran beside what)."""
        groups: dict[int, list[NodeSpan]] = {}
        for span in self.by_start():
            groups.setdefault(span.slot, []).append(span)
        return [groups[k] for k in sorted(groups)]

    def by_start(self) -> list[NodeSpan]:
        return sorted(self.spans, key=lambda s: s.start)

    def total(self, kind: str) -> float:
        """Summed duration of the spans of one kind ("compute" or "comm")."""
        return sum(s.duration for s in self.spans if s.kind == kind)

    def exposed_comm_fraction(self) -> float:
        """Share of communication time not covered by any compute span (0: all hidden)."""
        spans = self.spans
        comm = [(s.start, s.end) for s in spans if s.kind == "comm"]
        compute = union([(s.start, s.end) for s in spans if s.kind == "compute"])
        total = sum(e - s for s, e in comm)
        if total <= 0:
            return 0.0
        covered = covered_total(comm, compute)  # one pass: this runs inside a timed step
        return max(0.0, (total - covered) / total)
