"""The tape: a stage's forward recorded node by node, and its backward driven node by node.

``record_forward(layer_plans, inputs)`` runs each layer's nodes in order. Every node boundary
detaches the tensors (a fresh leaf that requires grad exactly when the original did), so each
node owns a small autograd graph of its own. ``run_backward(tape, grads)`` then walks the nodes
last first: ``torch.autograd.backward(node outputs, their gradients)`` accumulates parameter
gradients into ``.grad`` as ordinary autograd would and leaves the gradients of the node's
inputs in the inputs' ``.grad``; those are the gradients of the previous node's outputs. Each
node's tensors are dropped as soon as its backward has run.

Why: the co-scheduler must run the backward of one node (say the combine all-to-all) on one
stream while the forward of another microbatch's node runs on another; explicit node-sized
graphs make that possible, and because the nodes perform exactly the operations of
``run_nodes`` the results are bitwise equal to plain autograd over the same plan.

Layer boundaries: ``record_layer`` returns the layer's outputs as fresh leaves too. A model
that runs its layers through a ``TapeRunner`` may apply ordinary torch ops between layers
("glue"); their backward runs when the next layer's input gradients are known.

Caveats, all shared with the bitwise guarantee:
- Anything that needs a gradient must flow through the node tuples. A tensor that a node leaves
  in the ``LayerState`` is cut off from autograd; the state is for metadata (indices, sizes).
- Gradients that meet at one tensor (a residual used by several nodes) are summed in the order
  plain autograd sums them: on one device the engine runs a backward in decreasing creation
  order, the tape walks the nodes last first, and the gradient a later node returns for a
  passed-through tensor enters the earlier node's backward as the first term, so the left fold
  is the same (tested with a tensor used five times across three nodes).
- A tensor that needs grad and feeds several layers from outside (not via the previous layer's
  outputs) must be a leaf: its graph can be walked only once.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from megapipe.overlap.plan import Fork, Hold, LayerState, Node, layer_graph
from megapipe.overlap.records import (
    Grads, LayerRecord, NodeRecord, Values, check_values, deliver, detach_boundary, node_backward,
)
from megapipe.overlap.wgrad import WeightGradQueue

class Tape:
    """What a stage's backward needs: the layer records of one microbatch, in forward order.

    Build it with ``record_forward`` (or ``record_layer`` per layer / a ``TapeRunner``); walk it
    back with ``run_backward`` or, node by node, with ``begin_layer_backward`` and
    ``backward_step`` (the co-scheduler does that).
    """

    def __init__(self, route_input_grads: bool = True) -> None:
        self.layers: list[LayerRecord] = []
        # gradients of the first layer's inputs, once its backward ran
        self.input_grads: Grads | None = None
        # whether those also flow on into the inputs' own graph / .grad (as plain autograd would)
        self.route_input_grads = route_input_grads
        self._pending_grads: Grads | None = None  # gradients of the layer next to go backward
        # told of every tensor the tape takes hold of: node outputs, and the inputs of layers
        # after the first (glue between layers makes new ones)
        self.on_hold: Hold | None = None

    # ---- forward -------------------------------------------------------------------------
    def begin_layer(self, nodes: Sequence[Any], inputs: Sequence[Any]) -> LayerRecord:
        """Start recording a layer (a plan of ``Node`` and ``Fork`` items) on ``inputs``; run
        its nodes with ``forward_step``."""
        if self.layers and not self.layers[-1].recorded:
            raise RuntimeError(
                f"layer {self.layers[-1].index} is still being recorded; finish it before the next"
            )
        nodes = list(nodes)
        if not nodes or not all(isinstance(n, (Node, Fork)) for n in nodes):
            raise TypeError(f"a layer plan must be a non-empty list of Node, got {nodes!r}")
        graph = layer_graph(nodes)
        inputs = check_values(inputs, "layer inputs")
        records = [NodeRecord(n, src) for n, src in zip(graph.nodes, graph.sources)]
        for record in records:
            for index, _ in record.sources:
                if index >= 0:
                    records[index].readers += 1
        layer = LayerRecord(
            index=len(self.layers), nodes=records, state=LayerState(), given_inputs=inputs,
            shape=graph.shape,
        )
        records[0].inputs = detach_boundary(inputs)
        if self.on_hold is not None and self.layers:  # the first layer's: the stage's input
            self.on_hold(inputs)
        self.layers.append(layer)
        return layer

    def forward_inputs(self, layer: LayerRecord, index: int) -> Values:
        """The detached inputs of node ``index`` (gathered from its sources on first use)."""
        record = layer.nodes[index]
        if record.inputs is None:
            parts = []
            for source, part in record.sources:
                producer = layer.nodes[source] if source >= 0 else None
                if producer is not None and not producer.ran_forward:
                    raise RuntimeError(
                        f"node {record.node.name!r} reads node {producer.node.name!r}, whose "
                        "forward has not run"
                    )
                values = layer.given_inputs if producer is None else producer.outputs
                parts.append(tuple(values or ())[part])
            record.source_sizes = tuple(len(p) for p in parts)
            record.inputs = detach_boundary(tuple(v for p in parts for v in p))
        elif not record.source_sizes:
            record.source_sizes = (len(record.inputs),)
        return record.inputs

    def forward_step(self, layer: LayerRecord, index: int | None = None) -> NodeRecord:
        """Run the forward of node ``index`` (default: the next in the layer's forward order);
        after the layer's last node the layer's outputs are set."""
        index = layer.next_forward if index is None else index
        if index >= len(layer.nodes) or layer.nodes[index].ran_forward:
            raise RuntimeError(f"layer {layer.index}: node {index} already ran forward")
        record = layer.nodes[index]
        inputs = self.forward_inputs(layer, index)
        outputs = check_values(record.node.fn(layer.state, inputs), f"node {record.node.name!r}")
        record.outputs = outputs
        if self.on_hold is not None:
            self.on_hold(outputs)
        record.ran_forward = True
        if layer.recorded:
            layer.outputs = detach_boundary(layer.nodes[-1].outputs or ())
        return record

    def record_layer(self, nodes: Sequence[Node], inputs: Sequence[Any]) -> Values:
        """Record a whole layer; return its outputs as fresh leaves."""
        layer = self.begin_layer(nodes, inputs)
        while not layer.recorded:
            self.forward_step(layer)
        assert layer.outputs is not None
        return layer.outputs

    @property
    def outputs(self) -> Values:
        if not self.layers or not self.layers[-1].recorded:
            raise RuntimeError("the tape holds no finished layer")
        assert self.layers[-1].outputs is not None
        return self.layers[-1].outputs

    # ---- backward ------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def peek_backward_layer(self) -> LayerRecord | None:
        """The layer whose backward runs next (None when every layer's backward ran)."""
        for layer in reversed(self.layers):
            if not layer.backward_done:
                return layer
        return None

    def remaining_backward_layers(self) -> int:
        return sum(1 for layer in self.layers if not layer.backward_done)

    def begin_layer_backward(
        self,
        grads: Sequence[torch.Tensor | None] | None = None,
        wgrad: WeightGradQueue | None = None,
    ) -> LayerRecord:
        """Take the last layer whose backward has not run; ``grads`` are its outputs' gradients.

        ``grads`` is needed for the first layer to go backward (the tape's outputs); later
        layers get theirs from the layer after them. ``None`` for the first reads the
        ``.grad`` of the tape's outputs (e.g. after ``loss.backward()`` on them). ``wgrad`` (or
        None) becomes the layer state's ``wgrad_queue``, where its deferrable ops put their
        weight gradients.
        """
        pending = [layer for layer in self.layers if not layer.backward_done]
        if not pending:
            raise RuntimeError("every layer of the tape already ran backward")
        layer = pending[-1]
        if not layer.recorded:
            raise RuntimeError(f"layer {layer.index} was never finished forward")
        assert layer.outputs is not None
        if grads is None:
            grads = self._pending_grads
        if grads is None:
            if layer is not self.layers[-1]:
                raise RuntimeError(f"layer {layer.index}: no gradients for its outputs")
            grads = tuple(
                o.grad if isinstance(o, torch.Tensor) and o.requires_grad else None
                for o in layer.outputs
            )
        if len(grads) != len(layer.outputs):
            raise ValueError(
                f"layer {layer.index} has {len(layer.outputs)} outputs but got "
                f"{len(grads)} gradients"
            )
        self._pending_grads = None
        layer.outputs = None  # the leaves handed out are no longer needed
        layer.nodes[-1].pending_grads = list(grads)
        layer.state.wgrad_queue = wgrad
        return layer

    def backward_step(self, layer: LayerRecord, index: int | None = None) -> Grads:
        """Run the backward of node ``index`` (default: the last whose backward has not run);
        its outputs' gradients must all be known. Returns the gradients of its inputs."""
        index = layer.next_backward if index is None else index
        record = layer.nodes[index] if 0 <= index < len(layer.nodes) else None
        if record is None or record.ran_backward or not layer.recorded:
            raise RuntimeError(f"layer {layer.index}: node {index} cannot run backward now")
        if record.waiting or record.pending_grads is None:
            raise RuntimeError(
                f"node {record.node.name!r}: the gradients of its outputs are not all known yet"
            )
        grads, record.pending_grads = record.pending_grads, None
        input_grads = node_backward(record, grads)
        record.ran_backward = True
        start = 0
        for (source, part), size in zip(record.sources, record.source_sizes):
            if source >= 0:
                deliver(layer.nodes[source], part, input_grads[start : start + size])
            start += size
        if layer.backward_done:
            self._finish_layer_backward(layer, input_grads)
        return input_grads

    def _finish_layer_backward(self, layer: LayerRecord, input_grads: Grads) -> None:
        """Route the gradients of the layer's given inputs to where they came from."""
        given = layer.given_inputs
        layer.given_inputs = ()
        layer.state = LayerState()
        previous = self.layers[layer.index - 1] if layer.index > 0 else None
        prev_outputs = previous.outputs if previous is not None else None
        direct: dict[int, torch.Tensor] = {}
        roots, root_grads = [], []
        for value, grad in zip(given, input_grads):
            if grad is None or not isinstance(value, torch.Tensor) or not value.requires_grad:
                continue
            position = _position(prev_outputs, value)
            if position is not None and position not in direct:
                direct[position] = grad
            else:
                roots.append(value)
                root_grads.append(grad)
        if previous is None:
            self.input_grads = input_grads
            if roots and self.route_input_grads:
                torch.autograd.backward(roots, root_grads)
            return
        if roots:  # glue between layers, or a tensor given twice
            torch.autograd.backward(roots, root_grads)
        assert prev_outputs is not None
        grads: list[torch.Tensor | None] = []
        for i, out in enumerate(prev_outputs):
            g = direct.get(i)
            if isinstance(out, torch.Tensor) and out.grad is not None:
                g = out.grad if g is None else g + out.grad
            grads.append(g)
        self._pending_grads = tuple(grads)

    def backward_layer(
        self,
        grads: Sequence[torch.Tensor | None] | None = None,
        wgrad: WeightGradQueue | None = None,
    ) -> None:
        """Run the backward of the last pending layer, all its nodes in order."""
        layer = self.begin_layer_backward(grads, wgrad)
        while not layer.backward_done:
            self.backward_step(layer)

    # ---- accounting ----------------------------------------------------------------------
    def live_tensors(self) -> int:
        """How many node-boundary tensors the tape still holds (each keeps its graph alive)."""
        return sum(len(r.tensors()) for layer in self.layers for r in layer.nodes)

    def live_nodes(self) -> int:
        """How many nodes still hold their graph (recorded, backward not yet run)."""
        return sum(1 for layer in self.layers for r in layer.nodes if r.live)


def _position(values: Values | None, tensor: torch.Tensor) -> int | None:
    if values is None:
        return None
    for i, v in enumerate(values):
        if v is tensor:
            return i
    return None


def record_forward(
    layer_plans: Sequence[Sequence[Node]], inputs: Sequence[Any], on_hold: Hold | None = None
) -> tuple[Values, Tape]:
    """Run a stage's layer plans node by node; return (outputs as fresh leaves, tape).

    ``run_backward`` returns the gradients of ``inputs`` and leaves the caller's tensors alone
    (their ``.grad`` is not touched). ``on_hold`` becomes the tape's ``on_hold``.
    """
    tape = Tape(route_input_grads=False)
    tape.on_hold = on_hold
    values = check_values(inputs, "stage inputs")
    for plan in layer_plans:
        values = tape.record_layer(plan, values)
    return values, tape


def run_backward(
    tape: Tape,
    grad_outputs: Sequence[torch.Tensor | None] | None = None,
    wgrad: WeightGradQueue | None = None,
) -> Grads:
    """Run the whole backward of ``tape``; return the gradients of its first layer's inputs.

    ``grad_outputs`` are the gradients of the tape's outputs (None: read the outputs' ``.grad``,
    e.g. after ``loss.backward()`` on them). ``wgrad`` (a ``WeightGradQueue``) defers the weight
    gradients of ops that support it into the queue; the caller flushes the queue.
    """
    grads = grad_outputs
    while tape.remaining_backward_layers():
        tape.backward_layer(grads, wgrad)
        grads = None
    if tape.input_grads is None:
        raise RuntimeError("the tape's first layer never ran backward")
    return tape.input_grads


class TapeRunner:
    """Records the layers a model runs through ``run_layer`` (e.g. ``GPTStage.node_runner``).

    Gradients of tensors that enter the first layer flow on into them (their graph, or their
    ``.grad`` for leaves) as plain autograd would, and ``run_backward`` also returns them.
    """

    def __init__(self) -> None:
        self.tape = Tape(route_input_grads=True)

    def run_layer(self, nodes: Sequence[Node], inputs: Sequence[Any]) -> Values:
        return self.tape.record_layer(nodes, inputs)
