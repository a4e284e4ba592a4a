"""The records a tape keeps: one per node and one per layer of one microbatch.

A ``NodeRecord`` holds where its node's inputs come from (slices of earlier nodes' outputs, or
the layer's input), its detached inputs, its outputs (the roots of its own small autograd
graph) and, during backward, its outputs' gradients as the nodes that read them deliver them.
A ``LayerRecord`` holds a layer's records in the forward order of its ``LayerGraph``.
``node_backward`` runs one node's backward; ``deliver`` routes a node's input gradients to the
nodes that made those inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from megapipe.overlap.plan import LayerState, Node, Source

Values = tuple[Any, ...]
Grads = tuple[torch.Tensor | None, ...]


def detach_boundary(values: Sequence[Any]) -> Values:
    """Fresh leaves for the tensors in ``values``: same storage, requires_grad as the original."""
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            leaf = v.detach()
            if v.requires_grad:
                leaf.requires_grad_(True)
            out.append(leaf)
        else:
            out.append(v)
    return tuple(out)


def check_values(values: Any, where: str) -> Values:
    if not isinstance(values, (tuple, list)):
        raise TypeError(f"{where} must return a tuple of tensors, got {type(values).__name__}")
    return tuple(values)


@dataclass
class NodeRecord:
    """One node of one microbatch: where its inputs come from, its detached inputs, its outputs
    (the graph's roots) and, during backward, its outputs' gradients as its readers give them."""

    node: Node
    sources: tuple[Source, ...] = ((-1, slice(None)),)
    inputs: Values | None = None
    outputs: Values | None = None
    pending_grads: list[torch.Tensor | None] | None = None  # its outputs' gradients
    waiting: int = 0  # readers whose gradients have not arrived yet
    readers: int = 0  # nodes that read its outputs
    source_sizes: tuple[int, ...] = ()  # how many inputs came from each source
    ran_forward: bool = False
    ran_backward: bool = False

    @property
    def live(self) -> bool:
        return self.outputs is not None

    def tensors(self) -> list[torch.Tensor]:
        held = list(self.inputs or ()) + list(self.outputs or ())
        return [t for t in held if isinstance(t, torch.Tensor)]


@dataclass
class LayerRecord:
    """One layer of one microbatch: the inputs it was given, its nodes (in the forward order of
    its ``LayerGraph``), its returned outputs."""

    index: int
    nodes: list[NodeRecord]
    state: LayerState
    given_inputs: Values
    outputs: Values | None = None  # the fresh leaves handed to the caller
    shape: tuple[Any, ...] = ()  # the plan's shape (``LayerGraph.shape``), for the planner

    @property
    def next_forward(self) -> int:
        """The first node whose forward has not run (``len(nodes)`` when all have)."""
        return next((i for i, r in enumerate(self.nodes) if not r.ran_forward), len(self.nodes))

    @property
    def next_backward(self) -> int:
        """The last node whose backward has not run (-1 when all have, or none may yet)."""
        if not self.recorded:
            return -1
        return next((i for i in reversed(range(len(self.nodes)))
                     if not self.nodes[i].ran_backward), -1)

    @property
    def recorded(self) -> bool:
        return all(r.ran_forward for r in self.nodes)

    @property
    def backward_done(self) -> bool:
        return self.recorded and all(r.ran_backward for r in self.nodes)


def node_backward(record: NodeRecord, grads: Sequence[torch.Tensor | None]) -> Grads:
    """Run one node's backward with the gradients of its outputs; return its input gradients.

    Outputs that need no gradient, or whose gradient is None (unused downstream, or of an
    integer tensor), are left out, exactly as autograd leaves them out. The node's tensors are
    released afterwards.
    """
    if not record.live:
        raise RuntimeError(
            f"node {record.node.name!r}: backward already ran (or forward never did)"
        )
    outputs = record.outputs
    assert outputs is not None and record.inputs is not None
    if len(grads) != len(outputs):
        raise ValueError(
            f"node {record.node.name!r} has {len(outputs)} outputs but got {len(grads)} gradients"
        )
    roots, root_grads = [], []
    for out, grad in zip(outputs, grads):
        if grad is None or not isinstance(out, torch.Tensor) or not out.requires_grad:
            continue
        roots.append(out)
        root_grads.append(grad)
    if roots:
        torch.autograd.backward(roots, root_grads)
    input_grads = tuple(
        x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in record.inputs
    )
    record.inputs = None
    record.outputs = None
    return input_grads


def deliver(record: NodeRecord, part: slice, grads: Sequence[torch.Tensor | None]) -> None:
    """Gradients for the outputs ``part`` of ``record``, from one node that read them."""
    assert record.outputs is not None
    if record.pending_grads is None:
        record.pending_grads = [None] * len(record.outputs)
        record.waiting = record.readers
    for position, grad in zip(range(len(record.outputs))[part], grads):
        record.pending_grads[position] = grad
    record.waiting -= 1
