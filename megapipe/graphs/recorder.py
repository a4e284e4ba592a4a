"""The layer state a node sees while it is captured (``graphs.capture``): writes kept, reads
recorded.

A plain value the node reads becomes a guard of its instance; a tensor it reads becomes a
static buffer of the instance, filled from the real state before each replay, unless it is a
static tensor another captured instance hands out (``graphs.instance.Handed``: a routing index
the attention node wrote), which the graph then reads in place. A write of a name the real
state's type does not declare raises, as it would on that state (an ``UndeclaredState`` takes
any name). Its deferred weight-gradient queue reads None: a captured node computes its weight
gradients inside its backward graph.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import torch

from megapipe.graphs.instance import Loans
from megapipe.overlap.plan import LayerState


class StateRecorder(LayerState):
    """The recording layer state (module docstring); ``loans``: the handed-out static tensors
    the capture may read in place."""

    __slots__ = ("_base", "_writes", "_reads", "_fields", "_node", "_state_inputs", "_loans")

    def __init__(self, base: LayerState, node: str, loans: Loans) -> None:
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_writes", {})
        object.__setattr__(self, "_reads", {})
        declared = (
            None if hasattr(base, "__dict__") else frozenset(f.name for f in fields(type(base)))
        )
        object.__setattr__(self, "_fields", declared)
        object.__setattr__(self, "_node", node)
        object.__setattr__(self, "_state_inputs", {})
        object.__setattr__(self, "_loans", loans)

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("_"):
            return object.__getattribute__(self, name)
        writes = object.__getattribute__(self, "_writes")
        if name in writes:
            return writes[name]
        value = getattr(object.__getattribute__(self, "_base"), name)
        if name == "wgrad_queue":  # the node's weight gradients run inside its backward graph
            return None
        if isinstance(value, torch.Tensor):
            return object.__getattribute__(self, "_tensor")(name, value)
        object.__getattribute__(self, "_reads")[name] = value
        return value

    def _tensor(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """A state tensor the node reads: a static buffer of its instance (another instance's
        static tensor, read in place, or a copy filled before each replay, as a node input
        is); one needing a gradient is refused."""
        no_grad_read(self._node, name, value)
        static = self._state_inputs.get(name)
        if static is None:
            found = self._loans.borrow(value)
            if found is not None and not found.tensor.requires_grad:
                static = found.tensor
            else:
                with torch.no_grad():
                    static = torch.empty_strided(
                        value.shape, value.stride(), dtype=value.dtype, device=value.device
                    ).copy_(value)
            self._state_inputs[name] = static
        return static

    def __setattr__(self, name: str, value: Any) -> None:
        if self._fields is not None and name not in self._fields:
            raise AttributeError(f"{type(self._base).__name__} declares no field {name!r}")
        self._writes[name] = value


def forget_writes(recorder: StateRecorder) -> None:
    """Forget the writes of a previous run of the node (the warm-up's, before a capture); a
    function, as the recorder's own attributes are the state's fields."""
    object.__setattr__(recorder, "_writes", {})


def no_grad_read(node: str, name: str, value: torch.Tensor) -> None:
    """Refuse a state tensor that needs a gradient (a captured node takes those as inputs)."""
    if value.requires_grad:
        raise RuntimeError(
            f"node {node!r} cannot be captured: it reads state.{name}, a tensor "
            "that needs a gradient; a captured node takes those through its "
            "inputs"
        )
