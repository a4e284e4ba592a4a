"""The node protocol: a layer described as a short sequence of compute and comm nodes.

A MoE layer is ``attention (+router) -> dispatch -> experts -> combine -> finish``; a dense layer
is one compute node. ``run_nodes`` runs a plan in order with plain autograd (the layer's own
``forward``); the co-scheduler interleaves the nodes of two microbatches instead, so the forward
code of a layer is written once.

A node's function takes the layer's per-microbatch ``LayerState`` and a tuple of tensors, and
returns a tuple of tensors: the inputs of the next node. The state carries what one node leaves
for a later node of the same layer (non-differentiable metadata such as routing indices and
split sizes, as attributes the layer names) and one field the engine owns, ``wgrad_queue``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence, runtime_checkable

import torch

if TYPE_CHECKING:
    from megapipe.overlap.wgrad import WeightGradQueue


class NodeKind(str, Enum):
    COMPUTE = "compute"
    COMM = "comm"


@dataclass(eq=False)
class LayerState:
    """Scratch space of one layer for one microbatch.

    ``wgrad_queue`` is set by the engine for the duration of the layer's backward: deferrable
    ops (``overlap.wgrad.grouped_matmul``, given this state at forward time) put their weight
    gradient into it instead of computing it at once; None computes it at once. Everything else
    on the state is the layer's own metadata, written by one node and read by a later one.
    """

    wgrad_queue: "WeightGradQueue | None" = None


NodeFn = Callable[[LayerState, tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class Node:
    """One step of a layer. ``group``: the process group a comm node drives (optional); the
    co-scheduler checks that each group is driven from one stream only."""

    name: str
    kind: NodeKind
    fn: NodeFn
    group: Any = None


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
    """Runs one layer plan for a model's forward (a ``StageModule``'s ``node_runner``):
    recorded on a tape (``TapeRunner``) or co-scheduled with another microbatch's backward
    (``CoScheduler``)."""

    def run_layer(
        self, nodes: Sequence[Node], inputs: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...]: ...
