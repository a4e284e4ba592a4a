"""The node protocol: a layer described as a short sequence of compute and comm nodes.

A MoE layer is ``attention (+router) -> dispatch -> experts -> combine -> finish``; a dense layer
is one compute node. ``run_nodes`` runs a plan in order with plain autograd (the layer's own
``forward``); the co-scheduler interleaves the nodes of two microbatches instead, so the forward
code of a layer is written once.

A node's function takes the layer's per-microbatch ``LayerState`` (non-differentiable metadata
such as routing indices and split sizes, written by one node and read by a later one) and a
tuple of tensors, and returns a tuple of tensors: the inputs of the next node.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from types import SimpleNamespace
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch


class NodeKind(str, Enum):
    COMPUTE = "compute"
    COMM = "comm"


class LayerState(SimpleNamespace):
    """Scratch space of one layer for one microbatch: what a node leaves for a later node."""


NodeFn = Callable[[LayerState, tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class Node:
    """One step of a layer. ``group``: the process group a comm node drives (optional); the
    co-scheduler checks that each group is driven from one stream only."""

    name: str
    kind: NodeKind
    fn: NodeFn
    group: Any = None


@runtime_checkable
class NodeLayer(Protocol):
    """A layer that follows the node protocol and can therefore be overlapped."""

    def node_plan(self) -> Sequence[Node]: ...


def run_nodes(
    nodes: Sequence[Node], inputs: tuple[torch.Tensor, ...], state: LayerState | None = None
) -> tuple[torch.Tensor, ...]:
    """Run a node plan in order with ordinary autograd (no detaching)."""
    state = LayerState() if state is None else state
    values = inputs
    for node in nodes:
        values = node.fn(state, values)
    return values


@runtime_checkable
class NodeRunner(Protocol):
    """Runs one layer plan for a model's forward (``model.node_runner``): plainly
    (``PlainRunner``), recorded on a tape (``TapeRunner``) or co-scheduled with another
    microbatch's backward (``CombinedRunner``)."""

    def run_layer(
        self, nodes: Sequence[Node], inputs: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...]: ...


class PlainRunner:
    """Runs each layer plan with ordinary autograd (``run_nodes``): the default behaviour."""

    def run_layer(
        self, nodes: Sequence[Node], inputs: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...]:
        return run_nodes(nodes, tuple(inputs))
