"""A stand-in for ``torch.cuda`` graphs on CPU that replays like CUDA: ``megapipe.graphs.nodes``
in the CPU suite.

``FakeGraphApi`` has ``GraphApi``'s methods. A capture runs the function once under a dispatch
mode that records what it computes: each aten operation, its arguments (tensors by storage,
offset, sizes and strides) and the storages it makes, which the graph's pool then owns (kept,
as CUDA's private pool keeps them). A replay runs that list of operations again on the same
storages and nothing else: no Python of the captured region (no hook, attribute write, counter
or log) runs at replay, as on CUDA. It is as strict as CUDA where CUDA fails quietly:

- an operation of the capture that reads or writes a storage neither made by a capture into
  the same pool nor given as a static input (``static``: the static input buffers, parameters,
  buffers the graph reads in place) is an error at capture, naming the operation: on CUDA the
  graph would read that address at every replay, whatever lives there then;
- a replay whose static input moved (``param.data = ...``: another storage) is an error, as the
  graph would read the old memory;
- a capture computes nothing: every storage it made is filled with garbage (NaN, or -7777 for
  integers) and what it wrote into a static input is undone, so code that reads a capture's
  results without a replay fails; host syncs (``item``, ``nonzero``...) are refused.

Warm-ups and captures run on the graphs' side stream (``side``), replays on the current one:
``stream_of()`` names the stream current on this thread (the side stream inside ``warm`` and
``capture``, else the thread's name), and every warm-up, capture and replay is recorded in
``events`` with it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from support.host_syncs import sync_op

_NOTHING_TO_RUN = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


@dataclass(frozen=True)
class _Ref:
    """A tensor of a graph: a view of one storage (the graph's addresses)."""

    storage: int  # the storage's key in the graph's table
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class _Op:
    func: Any
    args: Any  # the arguments, tensors as _Ref
    kwargs: Any
    made: tuple[tuple[int, _Ref], ...]  # (output index, its _Ref) of the outputs it made


@dataclass
class _Pool:
    """A private memory pool: the storages its captures made, kept for the graphs' lifetime."""

    number: int
    storages: dict[int, torch.UntypedStorage] = field(default_factory=dict)
    # per storage, the bytes its capture computed: a later capture into the pool computes from
    # them (a CPU op cannot run on garbage indices, a CUDA capture runs nothing), then the
    # memory is put back as it was
    computed: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class FakeGraph:
    """What was captured: the operations, the storages they use, the results, the pool."""

    ops: list[_Op]
    storages: dict[int, torch.UntypedStorage]  # every storage an operation touches
    statics: tuple[tuple[torch.Tensor, int], ...]  # (static input, its storage's key)
    result: Any
    pool: _Pool
    replays: int = 0
    _views: dict[_Ref, torch.Tensor] = field(default_factory=dict)

    def view(self, ref: _Ref) -> torch.Tensor:
        """``ref`` as a tensor on the captured storage (made once; no autograd, no version
        counter shared with the program's tensors, as a graph's kernels)."""
        view = self._views.get(ref)
        if view is None:
            with torch.no_grad():
                view = torch.empty(0, dtype=ref.dtype).set_(
                    self.storages[ref.storage], ref.offset, ref.size, ref.stride)
            self._views[ref] = view
        return view


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _ref(t: torch.Tensor) -> _Ref:
    return _Ref(_key(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _writes(func: Any) -> list[int]:
    """Positions of the arguments ``func`` writes (``Tensor(a!)``), metadata-only ones not."""
    if torch.Tag.inplace_view in func.tags:
        return []
    return [i for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write]


class _Recording(TorchDispatchMode):
    """Records a capture's operations; refuses host syncs and memory the capture does not own."""

    def __init__(self, pool: _Pool, statics: dict[int, torch.UntypedStorage]) -> None:
        super().__init__()
        self.pool, self.statics = pool, statics
        self.ops: list[_Op] = []
        self.used: dict[int, torch.UntypedStorage] = {}
        self.made: dict[int, torch.UntypedStorage] = {}
        self.saved: dict[int, torch.Tensor] = {}  # static storages written: their contents

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        op = sync_op(func, args, kwargs)
        if op is not None:
            raise RuntimeError(f"host sync ({op}) inside a CUDA graph capture")
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        for t in inputs:
            key = _key(t)
            if key in self.pool.storages:
                self.used[key] = self.pool.storages[key]
            elif key in self.statics:
                self.used[key] = self.statics[key]
            else:
                raise RuntimeError(
                    f"{func} inside a CUDA graph capture reads or writes a tensor of shape "
                    f"{tuple(t.shape)} ({t.dtype}) that the capture neither made nor received "
                    "as a static input: a replay would use whatever memory is at its address then")
        positional = func._schema.arguments
        for i in _writes(func):
            target = args[i] if i < len(args) else kwargs.get(positional[i].name)
            for t in tree_flatten(target)[0]:
                if isinstance(t, torch.Tensor) and _key(t) in self.statics \
                        and _key(t) not in self.saved:
                    self.saved[_key(t)] = _bytes(t.untyped_storage()).clone()
        recorded = tree_map(lambda v: _ref(v) if isinstance(v, torch.Tensor) else v,
                            (args, kwargs))
        out = func(*args, **kwargs)
        made = []
        for index, t in enumerate(tree_flatten(out)[0]):
            if not isinstance(t, torch.Tensor):
                continue
            key = _key(t)
            if key not in self.used:  # a new storage: the pool's from now on
                self.pool.storages[key] = self.made[key] = self.used[key] = t.untyped_storage()
                made.append((index, _ref(t)))
        name = func.overloadpacket.__name__
        if (made or _writes(func)) and name not in _NOTHING_TO_RUN:
            self.ops.append(_Op(func, recorded[0], recorded[1], tuple(made)))
        return out


@dataclass
class FakeGraphApi:
    """``GraphApi`` on CPU (module docstring)."""

    side: str = "graphs"
    events: list[tuple[str, int, str]] = field(default_factory=list)
    reserved_bytes: int = 0
    _pools: int = 0
    _local: threading.local = field(default_factory=threading.local)

    def stream_of(self) -> str:
        """The stream current on this thread: the side stream in a warm-up or capture, else
        the thread's name."""
        return getattr(self._local, "stream", None) or threading.current_thread().name

    @contextmanager
    def on_side(self) -> Iterator[None]:
        before = getattr(self._local, "stream", None)
        self._local.stream = self.side
        try:
            yield
        finally:
            self._local.stream = before

    def warm(self, fn: Callable[[], Any]) -> None:
        with self.on_side():
            self.events.append(("warm", -1, self.stream_of()))
            fn()

    def capture(self, fn: Callable[[], Any], pool: Any, mode: str,
                static: Sequence[torch.Tensor] = ()) -> tuple[FakeGraph, Any]:
        if pool is None:
            self._pools += 1
            pool = _Pool(self._pools)
        statics = {_key(t): t.untyped_storage() for t in static}
        recording = _Recording(pool, statics)
        with torch.no_grad():
            held = {key: _bytes(pool.storages[key]).clone() for key in pool.computed}
            for key, computed in pool.computed.items():
                _bytes(pool.storages[key]).copy_(computed)
        with self.on_side():
            try:
                with recording:
                    result = fn()
            finally:
                with torch.no_grad():  # a capture writes nothing: memory back as it was
                    for key, saved in recording.saved.items():
                        _bytes(statics[key]).copy_(saved)
                    for key, before in held.items():
                        _bytes(pool.storages[key]).copy_(before)
            self.events.append(("capture", pool.number, self.stream_of()))
        for t in tree_flatten(result)[0]:
            if isinstance(t, torch.Tensor) and _key(t) not in recording.used:
                raise RuntimeError(f"a CUDA graph capture returned a tensor of shape "
                                   f"{tuple(t.shape)} it did not make (not in its pool)")
        graph = FakeGraph(recording.ops, recording.used,
                          tuple((t, _key(t)) for t in static), result, pool)
        with torch.no_grad():
            for key, storage in recording.made.items():
                pool.computed[key] = _bytes(storage).clone()
        for op in recording.ops:  # every view made now: storage use counts stay put
            tree_map(lambda v: graph.view(v) if isinstance(v, _Ref) else v, (op.args, op.kwargs))
            for _, ref in op.made:
                _poison(graph.view(ref))
        self.reserved_bytes += sum(s.nbytes() for s in recording.made.values())
        return graph, result

    def pool(self, graph: FakeGraph) -> _Pool:
        return graph.pool

    def replay(self, graph: FakeGraph) -> None:
        self.events.append(("replay", graph.pool.number, self.stream_of()))
        for tensor, key in graph.statics:
            if _key(tensor) != key:
                raise RuntimeError(f"a static input of shape {tuple(tensor.shape)} moved to "
                                   "other memory since its CUDA graph was captured (a replay "
                                   "reads the old address)")
        graph.replays += 1
        # the operations run below every dispatch mode: a replay is one launch, no dispatcher
        with torch.no_grad(), _disable_current_modes():
            for op in graph.ops:
                args, kwargs = tree_map(lambda v: graph.view(v) if isinstance(v, _Ref) else v,
                                        (op.args, op.kwargs))
                out = op.func(*args, **kwargs)
                if op.made:
                    values = tree_flatten(out)[0]
                    for index, ref in op.made:
                        graph.view(ref).copy_(values[index])

    def reserved(self) -> int:
        return self.reserved_bytes

    def count(self, what: str) -> int:
        return sum(1 for event in self.events if event[0] == what)


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _poison(value: torch.Tensor) -> None:
    with torch.no_grad():
        if value.is_floating_point():
            value.fill_(float("nan"))
        elif value.dtype in (torch.int16, torch.int32, torch.int64):
            value.fill_(-7777)
        else:
            value.fill_(True if value.dtype == torch.bool else torch.iinfo(value.dtype).max)
