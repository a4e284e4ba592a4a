"""The tape: what a microbatch's forward, recorded node by node, leaves for its backward.

Per layer a ``LayerRecord``, per node a ``NodeRecord`` with where its inputs come from, its
detached inputs (a node boundary detaches: a fresh leaf that requires grad exactly when the
original did, so each node owns a small autograd graph), its outputs (that graph's roots) and,
during backward, its outputs' gradients as the nodes that read them deliver them. A node runs
forward with ``Tape.forward_node`` (its function on its inputs) and backward with
``Tape.backward_node`` (one call into autograd's engine, the call ``torch.autograd.backward``
makes, without its argument checks); each node's tensors are dropped as its backward runs.
These are the operations of ``plan.run_nodes``, so the results are bitwise those of plain
autograd over the same plan:

- anything that needs a gradient flows through the node tuples (the ``LayerState`` is for
  metadata such as routing indices); a node reads only what it uses (a layer's residual goes
  around the nodes between, as a fork's ``around`` tensors do: no node only passes it on);
- gradients that meet at one tensor are summed in plain autograd's order (the tape walks the
  nodes last first, and the gradient a later node returns enters the earlier node's backward as
  the first term);
- a tensor that needs grad and feeds several layers from outside the previous layer's outputs
  must be a leaf; ordinary torch ops between layers ("glue") run their backward when the next
  layer's input gradients are known.

The tape path (``sequential``) runs the nodes one after the other; the combined step
(``combined``) runs them beside another microbatch's, in the pair order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd import Variable

from megapipe.overlap.plan import (
    LayerState,
    Node,
    Plan,
    Source,
    Track,
    UndeclaredState,
    layer_graph,
)
from megapipe.overlap.streams import Stream
from megapipe.overlap.wgrad import WeightGradQueue

Values = tuple[Any, ...]
Grads = tuple[torch.Tensor | None, ...]
_run_backward = Variable._execution_engine.run_backward  # what torch.autograd.backward calls
_WHOLE = slice(None)
_Tensor = torch.Tensor


def detached(values: Sequence[Any]) -> Values:
    """Fresh leaves for the tensors in ``values``: same storage, requires_grad as the original."""
    return tuple(
        [
            (v.detach().requires_grad_() if v.requires_grad else v.detach())
            if isinstance(v, _Tensor)
            else v
            for v in values
        ]
    )


def checked(values: Any, where: str) -> Values:
    if type(values) is tuple:
        return values
    if not isinstance(values, (tuple, list)):
        raise TypeError(f"{where} must return a tuple of tensors, got {type(values).__name__}")
    return tuple(values)


class NodeRecord:
    """One node of one microbatch: where its inputs come from, its detached inputs, its outputs
    and, during backward, its outputs' gradients as its readers give them (``waiting``: readers
    still to give theirs). ``stream``: the stream it last ran on (the combined step)."""

    __slots__ = (
        "node",
        "sources",
        "inputs",
        "outputs",
        "grads",
        "waiting",
        "readers",
        "sizes",
        "stream",
    )

    def __init__(self, node: Node, sources: tuple[Source, ...], readers: int) -> None:
        self.node = node
        self.sources = sources
        self.inputs: Values | None = None
        self.outputs: Values | None = None
        self.grads: list[torch.Tensor | None] | None = None
        self.waiting = 0
        self.readers = readers
        self.sizes: tuple[int, ...] = ()  # how many inputs came from each source (a join)
        self.stream: Stream | None = None

    def tensors(self) -> list[torch.Tensor]:
        held = list(self.inputs or ()) + list(self.outputs or ())
        return [t for t in held if isinstance(t, torch.Tensor)]


class LayerRecord:
    """One layer of one microbatch: the inputs it was given, its nodes (in the forward order of
    its ``LayerGraph``), its state (of its plan's state type), the outputs handed to the
    caller, and how many nodes ran each way."""

    __slots__ = (
        "index",
        "nodes",
        "state",
        "given_inputs",
        "outputs",
        "kinds",
        "forward_count",
        "backward_count",
    )

    def __init__(
        self,
        index: int,
        nodes: list[NodeRecord],
        given_inputs: Values,
        kinds: tuple[Any, ...],
        state: LayerState,
    ) -> None:
        self.index = index
        self.nodes = nodes
        self.state = state
        self.given_inputs = given_inputs
        self.outputs: Values | None = None
        self.kinds = kinds  # ``LayerGraph.kinds``, for the pair order
        self.forward_count = 0
        self.backward_count = 0


class Tape:
    """The layer records of one microbatch, in forward order (module docstring).

    ``begin_layer`` adds a layer; ``forward_node`` runs its nodes. ``begin_layer_backward``
    takes the last layer not yet gone backward; ``backward_node`` runs its nodes and delivers
    their inputs' gradients to the nodes that made those inputs. ``route_input_grads``: the
    gradients of the first layer's inputs also flow on into the inputs' own graph or ``.grad``,
    as plain autograd would (else they are only kept in ``input_grads``). ``track`` is told of
    every tensor the tape keeps (the activation meter).
    """

    def __init__(self, route_input_grads: bool = True, track: Track | None = None) -> None:
        self.layers: list[LayerRecord] = []
        self.input_grads: Grads | None = None  # of the first layer's inputs, once they ran
        self.route_input_grads = route_input_grads
        self.track = track
        self._pending_grads: Grads | None = None  # of the layer next to go backward

    def begin_layer(self, plan: Sequence[Any], inputs: Sequence[Any]) -> LayerRecord:
        """Start recording a layer (a plan of ``Node`` and ``Fork`` items) on ``inputs``."""
        if self.layers and self.layers[-1].forward_count < len(self.layers[-1].nodes):
            raise RuntimeError(
                f"layer {self.layers[-1].index} is still being recorded; finish it before the next"
            )
        if isinstance(plan, Plan):
            graph, state = plan.graph, plan.state_type()  # the layer kind's state
        else:  # a plain list of nodes: a state that takes any name (``state_type_of``)
            graph, state = layer_graph(plan), UndeclaredState()
        records = list(map(NodeRecord, graph.nodes, graph.sources, graph.readers))
        inputs = checked(inputs, "layer inputs")
        layer = LayerRecord(len(self.layers), records, inputs, graph.kinds, state)
        records[0].inputs = detached(inputs)
        if self.track is not None and self.layers:  # the first layer's: the stage's input
            self.track(inputs)
        self.layers.append(layer)
        return layer

    @property
    def outputs(self) -> Values:
        last = self.layers[-1] if self.layers else None
        if last is None or last.outputs is None:
            raise RuntimeError("the tape holds no finished layer")
        return last.outputs

    def remaining_backward_layers(self) -> int:
        return sum(1 for layer in self.layers if layer.backward_count < len(layer.nodes))

    def begin_layer_backward(
        self,
        grads: Sequence[torch.Tensor | None] | None = None,
        wgrad: WeightGradQueue | None = None,
    ) -> LayerRecord:
        """Take the last layer whose backward has not run; ``grads`` are its outputs' gradients
        (needed for the first layer to go backward; None reads their ``.grad``; later layers get
        theirs from the layer after them). ``wgrad`` becomes the layer state's ``wgrad_queue``,
        where its deferrable ops put their weight gradients."""
        layer = next(
            (lay for lay in reversed(self.layers) if lay.backward_count < len(lay.nodes)), None
        )
        if layer is None:
            raise RuntimeError("every layer of the tape already ran backward")
        if layer.outputs is None:
            raise RuntimeError(f"layer {layer.index} was never finished forward")
        grads = self.incoming_grads(layer, grads)
        if len(grads) != len(layer.outputs):
            raise ValueError(
                f"layer {layer.index} has {len(layer.outputs)} outputs but got "
                f"{len(grads)} gradients"
            )
        self._pending_grads = None
        layer.outputs = None  # the leaves handed out are no longer needed
        layer.nodes[-1].grads = list(grads)
        layer.state.wgrad_queue = wgrad
        return layer

    def incoming_grads(
        self, layer: LayerRecord, grads: Sequence[torch.Tensor | None] | None = None
    ) -> Sequence[torch.Tensor | None]:
        """The gradients of ``layer``'s outputs that ``begin_layer_backward(grads)`` hands to
        its last node: ``grads``, else those the layer after it gave, else (the last layer)
        its outputs' ``.grad``."""
        if grads is None:
            grads = self._pending_grads
        if grads is None:
            if layer is not self.layers[-1]:
                raise RuntimeError(f"layer {layer.index}: no gradients for its outputs")
            grads = tuple(
                o.grad if isinstance(o, torch.Tensor) and o.requires_grad else None
                for o in layer.outputs or ()
            )
        return grads

    def _finish_layer_backward(self, layer: LayerRecord, input_grads: Grads) -> None:
        """Route the gradients of the layer's given inputs to where they came from."""
        given = layer.given_inputs
        layer.given_inputs = ()
        layer.state = type(layer.state)()  # its metadata dropped
        previous = self.layers[layer.index - 1] if layer.index > 0 else None
        prev_outputs = previous.outputs if previous is not None else None
        direct: dict[int, torch.Tensor] = {}
        roots, root_grads = [], []
        for value, grad in zip(given, input_grads):
            if grad is None or not isinstance(value, torch.Tensor) or not value.requires_grad:
                continue
            position = next((i for i, v in enumerate(prev_outputs or ()) if v is value), None)
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

    def forward_node(self, layer: LayerRecord, index: int) -> Values:
        """Run the forward of node ``index`` of ``layer`` and record its outputs; after
        the layer's last node the layer's outputs (fresh leaves) are set."""
        record = layer.nodes[index]
        if record.outputs is not None:
            raise RuntimeError(f"layer {layer.index}: node {index} already ran forward")
        outputs = checked(
            record.node.fn(layer.state, node_inputs(layer, index)), f"node {record.node.name!r}"
        )
        record.outputs = outputs
        if self.track is not None:
            self.track(outputs)
        layer.forward_count += 1
        if layer.forward_count == len(layer.nodes):
            layer.outputs = detached(outputs)
        return outputs

    def backward_node(self, layer: LayerRecord, index: int) -> Grads:
        """Run the backward of node ``index`` of ``layer`` (one autograd-engine call); deliver its
        inputs' gradients to the nodes that made them and drop its tensors; after the layer's last
        node route the layer's input gradients on. Returns its inputs' gradients."""
        record = layer.nodes[index]
        grads = record.grads
        if record.outputs is None:
            raise RuntimeError(f"layer {layer.index}: node {index} cannot run backward now")
        if record.waiting or grads is None:
            raise RuntimeError(
                f"node {record.node.name!r}: the gradients of its outputs are not all known yet"
            )
        if len(grads) != len(record.outputs):
            raise ValueError(
                f"node {record.node.name!r} has {len(record.outputs)} outputs but "
                f"got {len(grads)} gradients"
            )
        # an output without a gradient (unused, or an integer tensor) is left out, as autograd
        # leaves it out
        pairs = [
            (out, grad)
            for out, grad in zip(record.outputs, grads)
            if grad is not None and isinstance(out, _Tensor) and out.requires_grad
        ]
        inputs = record.inputs
        assert inputs is not None
        passed = _passed_through(pairs, inputs)
        if passed is not None:  # the node handed its inputs on unchanged: so are the gradients
            input_grads = passed
        else:
            if pairs:
                roots, root_grads = zip(*pairs)
                _run_backward(roots, root_grads, False, False, (), True, True)
            input_grads = tuple(
                [x.grad if isinstance(x, _Tensor) and x.requires_grad else None for x in inputs]
            )
        record.inputs = record.outputs = record.grads = None
        layer.backward_count += 1
        if len(record.sources) == 1:  # one source gave every input (a node of a chain)
            source, part = record.sources[0]
            if source >= 0:
                _deliver(layer.nodes[source], part, input_grads)
        else:
            start = 0
            for (source, part), size in zip(record.sources, record.sizes):
                if source >= 0:
                    _deliver(layer.nodes[source], part, input_grads[start : start + size])
                start += size
        if layer.backward_count == len(layer.nodes):
            self._finish_layer_backward(layer, input_grads)
        return input_grads

    def live_tensors(self) -> int:
        """How many node-boundary tensors the tape still holds (each keeps its graph alive)."""
        return sum(len(r.tensors()) for layer in self.layers for r in layer.nodes)

    def live_nodes(self) -> int:
        """How many nodes still hold their graph (recorded, backward not yet run)."""
        return sum(1 for layer in self.layers for r in layer.nodes if r.outputs is not None)


def source_values(layer: LayerRecord, source: int, part: slice, reader: NodeRecord) -> Values:
    """The values node ``reader`` reads from ``source`` (-1: the layer's given inputs)."""
    values = layer.given_inputs if source < 0 else layer.nodes[source].outputs
    if values is None:
        raise RuntimeError(
            f"node {reader.node.name!r} reads node "
            f"{layer.nodes[source].node.name!r}, whose forward has not run"
        )
    return values if part == _WHOLE else values[part]


def node_inputs(layer: LayerRecord, index: int) -> Values:
    """The detached inputs of node ``index`` of ``layer``, gathered from its sources on first
    use (the previous node's outputs, for a node of a chain)."""
    record = layer.nodes[index]
    if record.inputs is not None:
        return record.inputs
    if len(record.sources) == 1:
        record.inputs = detached(source_values(layer, *record.sources[0], record))
        return record.inputs
    parts = [source_values(layer, source, part, record) for source, part in record.sources]
    record.sizes = tuple(len(p) for p in parts)
    record.inputs = detached(tuple(v for p in parts for v in p))
    return record.inputs


def _passed_through(pairs: list[tuple[torch.Tensor, torch.Tensor]], inputs: Values) -> Grads | None:
    """The input gradients of a node whose outputs with a gradient are all its own input
    leaves, each once (a comm node with nothing to exchange: expert parallelism 1, no link):
    each input's gradient is its output's, the very values autograd would copy into the
    leaf's ``.grad`` (which costs a copy kernel per tensor). None for any other node."""
    if not pairs:
        return None
    given: dict[int, torch.Tensor] = {}
    for out, grad in pairs:
        if out.grad_fn is not None or id(out) in given or not any(out is x for x in inputs):
            return None
        given[id(out)] = grad
    return tuple([given.get(id(x)) if isinstance(x, _Tensor) else None for x in inputs])


def _deliver(record: NodeRecord, part: slice, grads: Sequence[torch.Tensor | None]) -> None:
    """Gradients for the outputs ``part`` of ``record``, from one node that read them."""
    assert record.outputs is not None
    if record.grads is None:
        if record.readers == 1 and part == _WHOLE:  # a chain: the reader gives them all
            record.grads = list(grads)
            return
        record.grads = [None] * len(record.outputs)
        record.waiting = record.readers
    for position, grad in zip(range(len(record.outputs))[part], grads):
        record.grads[position] = grad
    record.waiting -= 1
