"""A stream-and-allocator checker: the CUDA code path, run on CPU, held to CUDA's rules.

On CPU the two streams of the combined step never race and the allocator never hands a block to
another tensor while a kernel still reads it, so a missing event wait or ``record_stream`` passes
every CPU test and corrupts memory on the first GPU run. ``StreamChecker`` runs the CUDA path
(``CudaStream``, whose every ``torch.cuda`` call goes through a ``CudaApi``) with a stand-in API
that tracks the current stream and event order, plus a ``TorchDispatchMode`` that sees every
operator:

- **ordering**: each stream keeps a vector clock (one counter per stream); an operator ticks the
  current stream's; ``record(event, s)`` snapshots ``s``'s clock, ``wait(s, event)`` merges the
  snapshot into ``s``'s, and the host merges it when it synchronizes on the event. Each storage
  remembers the last write (stream, tick) of each byte range written (a flat buffer's buckets
  are written one by one). A read on another stream whose clock has not reached the tick of a
  write it overlaps is an ``unordered`` finding: no event wait after the write.
- **the caching allocator**: each storage is owned by the stream current when it was made. When
  its last Python reference dies (a finalizer on the storage), the allocator hands the block to
  the owner stream's next allocation at once, unless ``record_stream`` named the other stream
  (``CudaApi.keep``). So every use on another stream must be finished by then: ordered before the
  owner stream's future work (the owner waited for an event recorded after the use) or waited
  for by the host. Otherwise it is a ``freed`` finding: the reader outlived the maker's
  reference (a use-after-free on a GPU).

Findings carry the operator, the tensor's origin (the operator that made it, and its stream),
both streams and the innermost megapipe line of the use. A tensor the checker first meets as
an operator's input (made before the check, or inside an operator it cannot see, such as a
collective's scratch) counts as made on the stream that meets it. Autograd's backward
operators are checked on the stream current when the backward is issued: the combined step
issues each node's backward on the stream of its forward, which is where CUDA's autograd runs
it. One host thread only (the CUDA path issues everything from one thread); ``Tensor.tolist``
dispatches nothing on CPU, so host reads through it do not count as host waits (stricter,
never kinder). ``stream_cases.checked_streams`` puts the executor and the DP sync on the
checker's streams.

Use::

    with StreamChecker() as checker:
        streams = checker.streams()          # compute (current) and comm CudaStreams
        ...run the combined step on them...
    assert not checker.findings, checker.report()
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megapipe.overlap.cuda_api import CudaApi
from megapipe.overlap.cuda_streams import CudaStream
from megapipe.overlap.streams import Streams

HOST = "host"
DEFAULT = "compute"  # the device's default stream
_NO_ACCESS = {"record_stream", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
              "is_same_size", "_has_compatible_shallow_copy_type"}
_HOST_WAITS = {"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select",
               "bincount", "_unique", "_unique2", "unique_dim", "unique_consecutive"}


class CheckedStream:
    """A stream as the checker sees it: a name and a vector clock (stream name -> tick)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.clock: dict[str, int] = {name: 0}

    def tick(self) -> int:
        self.clock[self.name] += 1
        return self.clock[self.name]

    def reached(self, stream: str, tick: int) -> bool:
        return self.clock.get(stream, 0) >= tick

    def merge(self, clock: dict[str, int]) -> None:
        for name, tick in clock.items():
            if tick > self.clock.get(name, 0):
                self.clock[name] = tick

    def __repr__(self) -> str:
        return f"CheckedStream({self.name!r})"


class CheckedEvent:
    """A CUDA event: the clock of the stream it was last recorded on (None: never recorded)."""

    def __init__(self, host: CheckedStream) -> None:
        self.clock: dict[str, int] | None = None
        self._host = host

    def synchronize(self) -> None:
        if self.clock is not None:
            self._host.merge(self.clock)

    def query(self) -> bool:
        # a GPU may not be done yet: a stand-in saying "done" would be kinder than CUDA
        return False


@dataclass(frozen=True)
class Finding:
    """One breach of CUDA's stream rules."""

    kind: str  # "unordered": read without a wait after the write; "freed": see module docstring
    op: str  # the operator that read (or wrote) on the other stream
    origin: str  # the operator that made the tensor
    maker: str  # the stream that made it (for "unordered": that last wrote it)
    reader: str  # the other stream
    where: str  # innermost megapipe line of the use (and of the write, when unordered)

    def __str__(self) -> str:
        if self.kind == "unordered":
            return (f"{self.op} on {self.reader!r} reads a tensor last written on "
                    f"{self.maker!r} (made by {self.origin}) with no wait after the write "
                    f"[{self.where}]")
        return (f"{self.op} on {self.reader!r} uses a tensor made on {self.maker!r} by "
                f"{self.origin}; its last reference was dropped while that work may still "
                f"run, with no record_stream({self.reader}) and no wait: the allocator reuses "
                f"the block (use after free) [{self.where}]")


@dataclass
class _Block:
    """One storage: its owner stream, origin, its writes (by byte range: a flat buffer's
    buckets are written on their own) and its uses on other streams."""

    owner: str
    origin: str
    # (first byte, end byte, stream, tick, where): the last write of each range
    writes: list[tuple[int, int, str, int, str]] = field(default_factory=list)
    uses: dict[str, tuple[int, str, str]] = field(default_factory=dict)  # stream -> tick, op, where
    kept: set[str] = field(default_factory=set)  # streams named by record_stream

    def write(self, span: tuple[int, int], stream: str, tick: int, where: str) -> None:
        first, end = span
        self.writes = [w for w in self.writes if not (first <= w[0] and w[1] <= end)]
        self.writes.append((first, end, stream, tick, where))


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage that ``tensor`` covers (first, end)."""
    size = tensor.element_size()
    first = tensor.storage_offset() * size
    if tensor.numel() == 0:
        return first, first
    extent = sum((n - 1) * abs(st) for n, st in zip(tensor.shape, tensor.stride())) + 1
    return first, first + extent * size


def _where() -> str:
    """The innermost megapipe frame (file:line function) of the current Python stack."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module == "megapipe" or module.startswith("megapipe."):  # by module, not by path
            init = frame.f_code.co_filename.endswith("__init__.py")
            path = module.replace(".", "/") + ("/__init__.py" if init else ".py")
            return f"{path}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


class CheckedCudaApi(CudaApi):
    """``CudaApi`` for the checker: streams are ``CheckedStream``, events ``CheckedEvent``."""

    def __init__(self, checker: StreamChecker) -> None:
        self.checker = checker

    def new_event(self) -> CheckedEvent:
        return CheckedEvent(self.checker.host)

    def record(self, event: CheckedEvent, stream: CheckedStream) -> None:
        event.clock = dict(stream.clock)

    def wait(self, stream: CheckedStream, event: CheckedEvent) -> None:
        if event.clock is not None:
            stream.merge(event.clock)

    @contextlib.contextmanager
    def switch(self, stream: CheckedStream) -> Iterator[None]:
        checker = self.checker
        before, checker.current = checker.current, stream
        try:
            yield
        finally:
            checker.current = before

    def current_stream(self, device: torch.device) -> CheckedStream:
        return self.checker.current

    def keep(self, tensor: torch.Tensor, stream: CheckedStream) -> None:
        block = self.checker._block(tensor)
        if block is not None:
            block.kept.add(stream.name)


class CheckedCudaStream(CudaStream):
    """A ``CudaStream`` on the checker's API; its timing marks read the host clock (the
    checker orders work, it does not time it)."""

    def mark(self) -> None:
        return None


class StreamChecker(TorchDispatchMode):
    """Checks every operator run inside ``with checker:`` against CUDA's stream and allocator
    rules (module docstring); ``findings`` lists the breaches, once each."""

    def __init__(self) -> None:
        super().__init__()
        self.api = CheckedCudaApi(self)
        self.host = CheckedStream(HOST)
        self._streams: dict[str, CheckedStream] = {DEFAULT: CheckedStream(DEFAULT)}
        self.current = self._streams[DEFAULT]
        self._blocks: dict[int, _Block] = {}
        self._seen: set[Finding] = set()
        self.findings: list[Finding] = []
        self.ops = 0  # operators checked
        self._on = False

    # ---- streams -------------------------------------------------------------------------
    def stream(self, name: str) -> CudaStream:
        """A ``CudaStream`` on CPU checked here; ``"compute"`` is the device's current stream."""
        raw = self._streams.setdefault(name, CheckedStream(name))
        return CheckedCudaStream(name, torch.device("cpu"), stream=raw,
                                 current=name == DEFAULT, api=self.api)

    def streams(self, comm: str = "comm") -> Streams:
        """The combined step's pair: the compute stream and a communication stream."""
        return Streams(self.stream(DEFAULT), self.stream(comm))

    def wait_on_current_stream(self, event: Any) -> None:
        """``dp_sync.wait_on_current_stream`` for a checked event: the current stream waits."""
        self.api.wait(self.current, event.event)

    # ---- reports -------------------------------------------------------------------------
    def report(self) -> str:
        return "\n".join(f"- {f}" for f in self.findings) or "no findings"

    def _find(self, finding: Finding) -> None:
        if finding not in self._seen:
            self._seen.add(finding)
            self.findings.append(finding)

    # ---- storages ------------------------------------------------------------------------
    def _block(self, tensor: torch.Tensor, made: bool = False, op: str = "") -> _Block | None:
        """The block of ``tensor``'s storage; registered on first sight: ``made`` by ``op``
        now, or met here first (made before the check, or inside an operator below the
        dispatcher, a collective's scratch): either way owned by the current stream."""
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        if storage.nbytes() == 0:
            return None
        key = id(storage)
        block = self._blocks.get(key)
        if block is None:
            block = _Block(self.current.name, op if made else "a tensor first met here")
            self._blocks[key] = block
            weakref.finalize(storage, self._freed, key)
        return block

    def _freed(self, key: int) -> None:
        """The storage's last reference died: the allocator may hand it out again on its owner
        stream now (module docstring)."""
        block = self._blocks.pop(key, None)
        if block is None or not self._on:
            return
        owner = self._streams[block.owner]
        for name, (tick, op, where) in block.uses.items():
            if name in block.kept or owner.reached(name, tick) or self.host.reached(name, tick):
                continue
            self._find(Finding("freed", op, block.origin, block.owner, name, where))

    # ---- the mode ------------------------------------------------------------------------
    def __enter__(self) -> StreamChecker:
        self._on = True
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._on = False  # later frees happen after the run (its streams may be gone)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        if name in _NO_ACCESS:
            return out
        schema = func._schema
        written = {a.name for a in schema.arguments
                   if a.alias_info is not None and a.alias_info.is_write}
        views = bool(schema.returns) and not written and all(
            r.alias_info is not None for r in schema.returns)
        if views:  # a view reads nothing and makes nothing
            return out
        op = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else name
        op = f"aten.{op}"
        stream = self.current
        tick = stream.tick()
        self.ops += 1
        read = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        mutated = [v for a, v in zip(schema.arguments, args) if a.name in written] + \
            [v for k, v in kwargs.items() if k in written]
        for tensor in read:
            block = self._block(tensor)
            if block is not None:
                self._use(block, tensor, op, stream, tick)
        for tensor in [t for t in tree_leaves(mutated) if isinstance(t, torch.Tensor)]:
            block = self._block(tensor)
            if block is not None:
                block.write(_span(tensor), stream.name, tick,
                            "" if stream.name == block.owner else _where())
        fresh = not written and not any(r.alias_info is not None for r in schema.returns)
        if fresh:  # new tensors; or (a collective's output) written here
            for tensor in outputs:
                block = self._block(tensor, made=True, op=op)
                if block is not None:
                    block.write(_span(tensor), stream.name, tick,
                                "" if stream.name == block.owner else _where())
        if name in _HOST_WAITS:  # the host reads the result: it waits for the stream
            self.host.merge(stream.clock)
        return out

    def _use(self, block: _Block, tensor: torch.Tensor, op: str, stream: CheckedStream,
             tick: int) -> None:
        first, end = _span(tensor)
        for lo, hi, writer, written_at, wrote in block.writes:
            if lo < end and first < hi and writer != stream.name and \
                    not stream.reached(writer, written_at):
                where = _where() + (f"; written at {wrote}" if wrote else "")
                self._find(Finding("unordered", op, block.origin, writer, stream.name, where))
        if block.owner != stream.name:
            block.uses[stream.name] = (tick, op, _where())
