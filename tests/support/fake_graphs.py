"""A stand-in for ``torch.cuda`` graphs on CPU: ``megapipe.overlap.graphs`` in the CPU suite.

``FakeGraphApi`` has ``GraphApi``'s methods. A capture runs the function once, as CUDA would
record it, remembers it and its results (the static buffers), and then fills those results with
garbage (NaN, or -7777 for integers: a real capture computes nothing), so code that reads a
capture's results without a replay fails. A capture also refuses host syncs (``item``,
``nonzero``...), as a CUDA capture does. A replay runs the function again and copies what it
returns (in the grad mode of the capture) into the captured results, in place, without touching
autograd's version counters (a graph's kernels do not either). Every warm-up, capture and replay
is recorded in ``events`` with the stream current at the time (``stream_of()``; default: the
calling thread's name).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from support.host_syncs import sync_op


class _RefuseSyncs(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = sync_op(func, args, kwargs)
        if op is not None:
            raise RuntimeError(f"host sync ({op}) inside a CUDA graph capture")
        return func(*args, **kwargs)


@dataclass
class FakeGraph:
    """What was captured: the function, its results (the static buffers), its pool."""

    fn: Callable[[], Any]
    result: tuple
    pool: int
    grad_enabled: bool
    replays: int = 0


@dataclass
class FakeGraphApi:
    """``GraphApi`` on CPU (module docstring)."""

    stream_of: Callable[[], str] = lambda: threading.current_thread().name
    events: list[tuple[str, int, str]] = field(default_factory=list)
    reserved_bytes: int = 0
    _pools: int = 0

    def warm(self, fn: Callable[[], Any]) -> None:
        self.events.append(("warm", -1, self.stream_of()))
        fn()

    def capture(self, fn: Callable[[], Any], pool: Any, mode: str) -> tuple[FakeGraph, Any]:
        with _RefuseSyncs():
            result = fn()
        if pool is None:
            self._pools += 1
            pool = self._pools
        graph = FakeGraph(fn, tuple(result), pool, torch.is_grad_enabled())
        for value in graph.result:
            if value is not None:
                self.reserved_bytes += value.numel() * value.element_size()
                _poison(value)
        self.events.append(("capture", pool, self.stream_of()))
        return graph, result

    def pool(self, graph: FakeGraph) -> int:
        return graph.pool

    def replay(self, graph: FakeGraph) -> None:
        self.events.append(("replay", graph.pool, self.stream_of()))
        graph.replays += 1
        with torch.set_grad_enabled(graph.grad_enabled):  # the mode its Python ran in
            values = graph.fn()
        with torch.no_grad():
            for static, value in zip(graph.result, values):
                if static is not None:
                    static.data.copy_(value)  # .data: no version bump, as a graph's kernels

    def reserved(self) -> int:
        return self.reserved_bytes

    def count(self, what: str) -> int:
        return sum(1 for event in self.events if event[0] == what)


def _poison(value: torch.Tensor) -> None:
    with torch.no_grad():
        value.data.fill_(float("nan") if value.is_floating_point() else -7777)
