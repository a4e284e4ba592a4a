"""One captured copy of a node (``Instance``), the lease that holds it busy from a forward
replay to its backward (``Lease``), and the static tensors instances hand out (``Handed``).

A node's input that is another instance's static output (a MoE layer's experts take the rows
the attention node made, through an all-to-all that moves nothing at ep 1; finish takes the
attention node's probabilities and routing indices) is read *in place*: the instance captured
later takes that very memory as its static input, so its replay copies nothing in, and its
backward graph writes the input's gradient straight into the producer's static output-gradient
buffer, so the producer's backward copies nothing in either. Safe because the producer is busy
(its outputs not rewritten) from its forward replay until its own backward, which comes after
the consumer's; an instance whose in-place input is at another address does not fit (another
is captured for that producer instance).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, eq=False)
class HandedTensor:
    """A static tensor an instance hands out: an output (``grad``: its static gradient buffer,
    None when it needs none) or a state write (``grad`` None)."""

    tensor: torch.Tensor
    grad: torch.Tensor | None
    owner: Instance
    layer: int  # the layer plan whose node made it


class Handed:
    """The static tensors the instances of one executor hand out, by address, so that a node
    of the same layer captured later reads them in place (module docstring; not across layers:
    each new instance of a layer's last node would pin a new one of every node after it)."""

    def __init__(self) -> None:
        self._by_address: dict[int, list[HandedTensor]] = {}

    def add(self, instance: Instance, layer: int) -> None:
        """Register what ``instance`` hands out (call once it is captured)."""
        grads = instance.grad_outputs
        tensors = [(o, g) for o, g in zip(instance.outputs, grads)] + [
            (v, None) for v in instance.writes.values() if isinstance(v, torch.Tensor)
        ]
        for tensor, grad in tensors:
            if tensor.numel():
                self._by_address.setdefault(tensor.data_ptr(), []).append(
                    HandedTensor(tensor, grad, instance, layer)
                )

    def find(self, value: torch.Tensor, layer: int) -> HandedTensor | None:
        """The handed tensor of ``layer`` that ``value`` is (same address and layout), or None."""
        if not value.numel():
            return None
        return next(
            (
                h
                for h in self._by_address.get(value.data_ptr(), ())
                if h.layer == layer and same_layout(value, h.tensor)
            ),
            None,
        )


class Loans:
    """What one capture reads in place: per handed tensor borrowed, its views before; once the
    capture is done, ``settle`` has each owner count the views the new instance keeps."""

    def __init__(self, handed: Handed, layer: int) -> None:
        self.handed, self.layer = handed, layer
        self._before: dict[int, tuple[HandedTensor, int]] = {}

    def borrow(self, value: torch.Tensor) -> HandedTensor | None:
        """The handed tensor ``value`` is (``Handed.find``), now borrowed, or None."""
        found = self.handed.find(value, self.layer)
        if found is not None and id(found) not in self._before:
            self._before[id(found)] = (found, views(found.tensor))
        return found

    def settle(self) -> None:
        for found, before in self._before.values():
            found.owner.lend(found.tensor, views(found.tensor) - before)
        self._before.clear()


class Instance:
    """One captured copy of a node: its graphs, static buffers, state writes and guards."""

    def __init__(self, api: Any) -> None:
        self.api = api
        # busy while a forward awaits its backward: a weak reference, so that the lease dies
        # (and frees the instance) with the forward's autograd record when no backward comes
        self.lease: weakref.ref[Lease] | None = None
        self.guards: dict[str, Any] = {}
        self.state_inputs: dict[str, torch.Tensor] = {}  # state tensors read: static buffers
        self.in_place_state: frozenset[str] = frozenset()  # of them: another instance's
        self.inputs: tuple[torch.Tensor, ...] = ()
        self.in_place: tuple[bool, ...] = ()  # per input: another instance's static output
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.writes: dict[str, Any] = {}
        self.logged: list[list[torch.Tensor]] = []
        self.grad_outputs: list[torch.Tensor | None] = []
        self.grad_inputs: tuple[torch.Tensor | None, ...] = ()
        # parameters whose gradient the backward graph adds into their main_grad, and those
        # buffers as captured (the graph writes their addresses)
        self.accumulated: tuple[torch.Tensor, ...] = ()
        self.main_grads: tuple[torch.Tensor, ...] = ()
        self.fwd: Any = None
        self.bwd: Any = None
        self.bytes = 0
        self.handed: tuple[torch.Tensor, ...] = ()
        self.counts: list[int] = []

    def fits(self, state: Any, inputs: Sequence[torch.Tensor]) -> bool:
        """Free (no forward whose autograd record lives, no tensor outside viewing what it
        handed out beyond what it lends: a deferred weight gradient may keep an output), its
        guards hold, and what it reads in place is where it was captured."""
        return (
            (self.lease is None or self.lease() is None)
            and all(getattr(state, name) == value for name, value in self.guards.items())
            and all(views(t) <= count for t, count in zip(self.handed, self.counts))
            and all(
                same_layout(getattr(state, name), static)
                and (name not in self.in_place_state or _same_address(getattr(state, name), static))
                for name, static in self.state_inputs.items()
            )
            and all(
                _same_address(x, static)
                for x, static, kept in zip(inputs, self.inputs, self.in_place)
                if kept
            )
        )

    def fill(self, state: Any, inputs: Sequence[torch.Tensor]) -> None:
        """Copy the inputs and state tensors into the static buffers, except what is there."""
        for static, x in zip(self.inputs, inputs):
            if not _same_address(x, static):
                static.copy_(x)
        for name, static in self.state_inputs.items():
            value = getattr(state, name)
            if not _same_address(value, static):
                static.copy_(value)

    def take_grads(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Copy the output gradients into their static buffers, except what a consumer's
        backward graph wrote there already."""
        for static, grad in zip(self.grad_outputs, grads):
            if static is None:
                continue
            if grad is None:
                raise RuntimeError(
                    "a captured node's output got no gradient, but its graph was "
                    "captured with one for every output that requires grad"
                )
            if not _same_address(grad, static):
                static.copy_(grad)

    def returned(self) -> tuple[torch.Tensor | None, ...]:
        """The input and parameter gradients a backward hands autograd: a producer's gradient
        buffer (an input read in place) detached, so that autograd takes it as the input's
        ``.grad`` without a copy and the producer finds it where it reads it; the others not
        (autograd copies them, never keeping the buffer, which the next replay writes)."""
        kept = self.in_place + (False,) * (len(self.grad_inputs) - len(self.in_place))
        return tuple(
            g.detach() if g is not None and k else g for g, k in zip(self.grad_inputs, kept)
        )

    def hand_out(self) -> None:
        """Count the views of what replays hand out (outputs, state tensors) at rest."""
        seen: dict[int, torch.Tensor] = {}
        for t in self.outputs + tuple(
            v for v in self.writes.values() if isinstance(v, torch.Tensor)
        ):
            seen.setdefault(t.untyped_storage().data_ptr(), t)
        self.handed = tuple(seen.values())
        self.counts = [views(t) for t in self.handed]

    def lend(self, tensor: torch.Tensor, views: int) -> None:
        """A later instance reads ``tensor`` in place and keeps ``views`` more views of it."""
        for i, t in enumerate(self.handed):
            if t.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
                self.counts[i] += views


class Lease:
    """Holds an instance busy from one forward replay until its backward replayed (or the
    autograd record of that forward is dropped without one)."""

    __slots__ = ("instance", "backward_done", "__weakref__")

    def __init__(self, instance: Instance) -> None:
        instance.lease = weakref.ref(self)
        self.instance = instance
        self.backward_done = False

    def release(self) -> None:
        if self.instance.lease is not None and self.instance.lease() is self:
            self.instance.lease = None

    def __del__(self) -> None:
        self.release()


def same_layout(value: Any, static: torch.Tensor) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.shape == static.shape
        and value.stride() == static.stride()
        and value.dtype == static.dtype
    )


def _same_address(value: torch.Tensor, static: torch.Tensor) -> bool:
    return value.data_ptr() == static.data_ptr() and same_layout(value, static)


def views(tensor: torch.Tensor) -> int:
    """How many tensors view ``tensor``'s storage (plus one: the storage object asked)."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def static_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
