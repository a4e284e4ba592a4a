"""A test-only instrument: every host sync made while it is on, and the node that made it.

On CUDA a host sync (reading a device value on the host, or an op whose output shape depends on
device data) stalls the one host thread that issues both streams. On CPU nothing stalls, but the
same calls are made, so they can be counted: ``HostSyncs`` records

- ``Tensor.item``, ``int()``/``float()``/``bool()`` of a tensor (``aten._local_scalar_dense``),
  ``torch.equal``, ``nonzero`` (also ``torch.where(cond)``), ``bincount``, ``masked_select``,
  ``unique``, boolean indexing (``aten.index``/``index_put`` with a bool index),
  ``repeat_interleave`` without ``output_size`` — seen by a ``TorchDispatchMode``;
- ``Tensor.tolist``, ``Tensor.cpu`` and ``Tensor.numpy`` — which dispatch nothing for CPU
  tensors, so the methods are wrapped;

each with the node running on that thread (the tape's forward or backward action of a node
plan; None outside every node), its direction and the innermost megapipe function on the stack.
A dispatch mode is per thread, so it is entered on the calling thread for the whole ``with``
block and, inside every node step, on whichever thread runs it (the CPU comm stream's worker).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megapipe.overlap.tape import Tape as nodes  # its forward_node, backward_node wrapped

SYNC_OPS = {
    "_local_scalar_dense": "item", "equal": "equal", "is_nonzero": "item", "nonzero": "nonzero",
    "bincount": "bincount", "masked_select": "masked_select", "_unique": "unique",
    "_unique2": "unique", "unique_dim": "unique", "unique_consecutive": "unique",
}
INDEX_OPS = ("index", "index_put", "index_put_", "_index_put_impl_")
WRAPPED_METHODS = ("tolist", "cpu", "numpy")


@dataclass(frozen=True)
class HostSync:
    """One host sync: what, in which node (None: outside nodes), where in megapipe."""

    op: str
    node: str | None
    direction: str | None
    where: str
    thread: str


def the_one_point(event: HostSync) -> bool:
    """The documented host read: forward dispatch, HostCounts.wait, on the comm stream."""
    return (
        event.op == "tolist"
        and event.where == "megapipe/moe/dispatcher.py:HostCounts.wait"
        and event.direction == "F"
        and event.node is not None
        and event.node.endswith(".dispatch")
    )


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()
    )


def sync_op(func: Any, args: tuple, kwargs: dict) -> str | None:
    """The kind of host sync ``func(*args, **kwargs)`` makes, or None."""
    name = func.overloadpacket.__name__
    if name in SYNC_OPS:
        return SYNC_OPS[name]
    if name in INDEX_OPS and _bool_index(args):
        return "boolean indexing"
    if name == "repeat_interleave" and kwargs.get("output_size") is None and isinstance(
        args[0], torch.Tensor
    ) and len(args) == 1:
        return "repeat_interleave"
    return None


def library_site(frame: Any) -> str | None:
    """``megapipe/<module path>.py:<function>`` when ``frame`` runs megapipe's code, else None.

    Judged by the frame's module (``megapipe`` or ``megapipe.*``), never by its file's path: a
    checkout may itself sit in a folder named ``megapipe``, where every test helper's path
    contains ``/megapipe/`` too."""
    module = frame.f_globals.get("__name__", "")
    if module != "megapipe" and not module.startswith("megapipe."):
        return None
    package = str(frame.f_globals.get("__file__", "")).endswith("__init__.py")
    file = module.replace(".", "/") + ("/__init__.py" if package else ".py")
    return f"{file}:{frame.f_code.co_qualname}"


def _megapipe_frame() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        site = library_site(frame)
        if site is not None:
            return site
        frame = frame.f_back
    return "outside megapipe"


class _Mode(TorchDispatchMode):
    def __init__(self, syncs: HostSyncs) -> None:
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = sync_op(func, args, kwargs)
        if op is not None:
            self.syncs.record(op)
        return func(*args, **kwargs)


class HostSyncs:
    """``with HostSyncs() as syncs: ...`` then ``syncs.events`` (see the module docstring)."""

    def __init__(self) -> None:
        self.events: list[HostSync] = []
        self._lock = threading.Lock()
        self._local = threading.local()
        self._saved: dict[str, Any] = {}
        self._mode: _Mode | None = None

    # ---- recording -----------------------------------------------------------------------
    def record(self, op: str) -> None:
        if getattr(self._local, "muted", False):
            return
        node, direction = (getattr(self._local, "nodes", None) or [(None, None)])[-1]
        event = HostSync(op, node, direction, _megapipe_frame(), threading.current_thread().name)
        with self._lock:
            self.events.append(event)

    def outside(self, allowed: Callable[[HostSync], bool]) -> list[HostSync]:
        """The recorded syncs that ``allowed`` does not accept."""
        return [e for e in self.events if not allowed(e)]

    # ---- wrapping ------------------------------------------------------------------------
    def _wrap_method(self, name: str) -> None:
        original = getattr(torch.Tensor, name)
        self._saved[name] = original
        syncs = self

        def wrapped(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            syncs.record(name)
            syncs._local.muted = True  # the method's own ops are part of this one sync
            try:
                return original(tensor, *args, **kwargs)
            finally:
                syncs._local.muted = False

        setattr(torch.Tensor, name, wrapped)

    def _wrap_node(self, name: str, direction: str) -> None:
        original = getattr(nodes, name)
        self._saved[f"nodes.{name}"] = original
        syncs = self

        def run(tape: Any, layer: Any, index: int) -> Any:
            stack = getattr(syncs._local, "nodes", None)
            if stack is None:
                stack = syncs._local.nodes = []
            stack.append((layer.nodes[index].node.name, direction))
            # a dispatch mode is per thread: enter one here unless this thread has one on
            mode = _Mode(syncs) if not getattr(syncs._local, "mode_on", False) else None
            try:
                if mode is None:
                    return original(tape, layer, index)
                syncs._local.mode_on = True
                with mode:
                    return original(tape, layer, index)
            finally:
                if mode is not None:
                    syncs._local.mode_on = False
                stack.pop()

        setattr(nodes, name, run)

    def __enter__(self) -> HostSyncs:
        for name in WRAPPED_METHODS:
            self._wrap_method(name)
        self._wrap_node("forward_node", "F")
        self._wrap_node("backward_node", "B")
        self._mode = _Mode(self)
        self._local.mode_on = True
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._mode is not None
        self._mode.__exit__(*exc)
        self._local.mode_on = False
        for name, original in self._saved.items():
            if name.startswith("nodes."):
                setattr(nodes, name[len("nodes.") :], original)
            else:
                setattr(torch.Tensor, name, original)
        self._saved.clear()
