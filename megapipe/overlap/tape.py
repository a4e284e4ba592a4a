"""The tape: what a microbatch's forward, recorded node by node, leaves for its backward.

A ``Tape`` holds one ``LayerRecord`` per layer and one ``NodeRecord`` per node: where the node's
inputs come from, its detached inputs (every node boundary detaches: a fresh leaf that requires
grad exactly when the original did, so each node owns a small autograd graph of its own), its
outputs (the roots of that graph) and, during backward, its outputs' gradients as the nodes that
read them deliver them. The tape keeps this bookkeeping; the nodes themselves run in
``combined_step`` (``forward_node``, ``backward_node``: alone by ``record_forward`` and
``run_backward``, or beside another microbatch's by ``CombinedStep``). Each node's tensors are
dropped as soon as its backward has run.

The nodes perform exactly the operations of ``run_nodes``, so the results are bitwise those of
plain autograd over the same plan. Caveats, all shared with that guarantee:

- Anything that needs a gradient must flow through the node tuples. A tensor that a node leaves
  in the ``LayerState`` is cut off from autograd; the state is for metadata (indices, sizes).
- Gradients that meet at one tensor (a residual used by several nodes) are summed in the order
  plain autograd sums them: the engine runs a backward in decreasing creation order, the tape
  walks the nodes last first, and the gradient a later node returns for a passed-through tensor
  enters the earlier node's backward as the first term (tested with a tensor used five times).
- A tensor that needs grad and feeds several layers from outside (not via the previous layer's
  outputs) must be a leaf: its graph can be walked only once.

Layer boundaries: a recorded layer's outputs are fresh leaves too. A model that runs its layers
through a node runner may apply ordinary torch ops between layers ("glue"); their backward runs
when the next layer's input gradients are known.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from megapipe.overlap.plan import Fork, LayerState, Node, Source, Track, layer_graph
from megapipe.overlap.wgrad import WeightGradQueue

Values = tuple[Any, ...]
Grads = tuple[torch.Tensor | None, ...]


_Tensor = torch.Tensor


def detached(values: Sequence[Any]) -> Values:
    """Fresh leaves for the tensors in ``values``: same storage, requires_grad as the original."""
    return tuple([(v.detach().requires_grad_() if v.requires_grad else v.detach())
                  if isinstance(v, _Tensor) else v for v in values])


def checked(values: Any, where: str) -> Values:
    if type(values) is tuple:
        return values
    if not isinstance(values, (tuple, list)):
        raise TypeError(f"{where} must return a tuple of tensors, got {type(values).__name__}")
    return tuple(values)


class NodeRecord:
    """One node of one microbatch: where its inputs come from, its detached inputs, its outputs
    (the roots of its graph) and, during backward, its outputs' gradients as its readers give
    them (``waiting``: readers still to give theirs)."""

    __slots__ = ("node", "sources", "inputs", "outputs", "grads", "waiting", "readers", "sizes")

    def __init__(self, node: Node, sources: tuple[Source, ...], readers: int) -> None:
        self.node = node
        self.sources = sources
        self.inputs: Values | None = None
        self.outputs: Values | None = None
        self.grads: list[torch.Tensor | None] | None = None
        self.waiting = 0
        self.readers = readers
        self.sizes: tuple[int, ...] = ()  # how many inputs came from each source (a join)

    @property
    def live(self) -> bool:
        return self.outputs is not None

    def tensors(self) -> list[torch.Tensor]:
        held = list(self.inputs or ()) + list(self.outputs or ())
        return [t for t in held if isinstance(t, torch.Tensor)]


class LayerRecord:
    """One layer of one microbatch: the inputs it was given, its nodes (in the forward order of
    its ``LayerGraph``), the outputs handed to the caller, and how many nodes ran each way."""

    __slots__ = ("index", "nodes", "state", "given_inputs", "outputs", "kinds", "forward_count",
                 "backward_count")

    def __init__(self, index: int, nodes: list[NodeRecord], given_inputs: Values,
                 kinds: tuple[Any, ...]) -> None:
        self.index = index
        self.nodes = nodes
        self.state = LayerState()
        self.given_inputs = given_inputs
        self.outputs: Values | None = None
        self.kinds = kinds  # ``LayerGraph.kinds``, for the pair order
        self.forward_count = 0
        self.backward_count = 0

    @property
    def recorded(self) -> bool:
        return self.forward_count == len(self.nodes)

    @property
    def gone_backward(self) -> bool:
        return self.backward_count == len(self.nodes)

    @property
    def next_backward(self) -> int:
        """The last node whose backward has not run (-1 when all have, or none may yet)."""
        if not self.recorded:
            return -1
        return next((i for i in reversed(range(len(self.nodes)))
                     if self.nodes[i].outputs is not None), -1)


class Tape:
    """The layer records of one microbatch, in forward order (module docstring).

    ``begin_layer`` adds a layer; each node's forward then reports its outputs to
    ``node_ran_forward``. ``begin_layer_backward`` takes the last layer not yet gone
    backward; each node's backward reports its input gradients to ``node_ran_backward``, which
    delivers them to the nodes that made those inputs. ``route_input_grads``: the gradients of
    the first layer's inputs also flow on into the inputs' own graph or ``.grad``, as plain
    autograd would (else they are only kept in ``input_grads``). ``track`` is told of every
    tensor the tape keeps (the activation meter).
    """

    def __init__(self, route_input_grads: bool = True, track: Track | None = None) -> None:
        self.layers: list[LayerRecord] = []
        self.input_grads: Grads | None = None  # of the first layer's inputs, once they ran
        self.route_input_grads = route_input_grads
        self.track = track
        self._pending_grads: Grads | None = None  # of the layer next to go backward

    # ---- forward -------------------------------------------------------------------------
    def begin_layer(self, plan: Sequence[Any], inputs: Sequence[Any]) -> LayerRecord:
        """Start recording a layer (a plan of ``Node`` and ``Fork`` items) on ``inputs``; run
        its nodes with ``forward_node``."""
        if self.layers and not self.layers[-1].recorded:
            raise RuntimeError(
                f"layer {self.layers[-1].index} is still being recorded; finish it before the next"
            )
        if not plan:
            raise TypeError(f"a layer plan must be a non-empty list of Node, got {plan!r}")
        graph = layer_graph(plan)  # its items must be Node and Fork
        records = list(map(NodeRecord, graph.nodes, graph.sources, graph.readers))
        inputs = checked(inputs, "layer inputs")
        layer = LayerRecord(len(self.layers), records, inputs, graph.kinds)
        records[0].inputs = detached(inputs)
        if self.track is not None and self.layers:  # the first layer's: the stage's input
            self.track(inputs)
        self.layers.append(layer)
        return layer

    def node_ran_forward(self, layer: LayerRecord, index: int, outputs: Values) -> None:
        """Node ``index`` of ``layer`` ran forward and made ``outputs``; after the layer's last
        node the layer's outputs (fresh leaves) are set."""
        record = layer.nodes[index]
        if record.outputs is not None:
            raise RuntimeError(f"layer {layer.index}: node {index} already ran forward")
        record.outputs = outputs
        if self.track is not None:
            self.track(outputs)
        layer.forward_count += 1
        if layer.forward_count == len(layer.nodes):
            layer.outputs = detached(outputs)

    @property
    def outputs(self) -> Values:
        if not self.layers or not self.layers[-1].recorded:
            raise RuntimeError("the tape holds no finished layer")
        assert self.layers[-1].outputs is not None
        return self.layers[-1].outputs

    # ---- backward ------------------------------------------------------------------------
    def remaining_backward_layers(self) -> int:
        return sum(1 for layer in self.layers if not layer.gone_backward)

    def begin_layer_backward(self, grads: Sequence[torch.Tensor | None] | None = None,
                             wgrad: WeightGradQueue | None = None) -> LayerRecord:
        """Take the last layer whose backward has not run; ``grads`` are its outputs' gradients.

        ``grads`` is needed for the first layer to go backward (the tape's outputs; None reads
        their ``.grad``); later layers get theirs from the layer after them. ``wgrad`` becomes
        the layer state's ``wgrad_queue``, where its deferrable ops put their weight gradients.
        """
        layer = next((lay for lay in reversed(self.layers) if not lay.gone_backward), None)
        if layer is None:
            raise RuntimeError("every layer of the tape already ran backward")
        if not layer.recorded:
            raise RuntimeError(f"layer {layer.index} was never finished forward")
        assert layer.outputs is not None
        if grads is None:
            grads = self._pending_grads
        if grads is None:
            if layer is not self.layers[-1]:
                raise RuntimeError(f"layer {layer.index}: no gradients for its outputs")
            grads = tuple(o.grad if isinstance(o, torch.Tensor) and o.requires_grad else None
                          for o in layer.outputs)
        if len(grads) != len(layer.outputs):
            raise ValueError(f"layer {layer.index} has {len(layer.outputs)} outputs but got "
                             f"{len(grads)} gradients")
        self._pending_grads = None
        layer.outputs = None  # the leaves handed out are no longer needed
        layer.nodes[-1].grads = list(grads)
        layer.state.wgrad_queue = wgrad
        return layer

    def backward_grads(self, layer: LayerRecord, index: int) -> list[torch.Tensor | None]:
        """The gradients of node ``index``'s outputs, once every node that read them gave its
        share (an error naming the node otherwise)."""
        record = layer.nodes[index]
        if record.outputs is None:
            raise RuntimeError(f"layer {layer.index}: node {index} cannot run backward now")
        grads = record.grads
        if record.waiting or grads is None:
            raise RuntimeError(
                f"node {record.node.name!r}: the gradients of its outputs are not all known yet")
        if len(grads) != len(record.outputs):
            raise ValueError(f"node {record.node.name!r} has {len(record.outputs)} outputs but "
                             f"got {len(grads)} gradients")
        return grads

    def node_ran_backward(self, layer: LayerRecord, index: int) -> Grads:
        """Node ``index`` of ``layer`` ran backward: its inputs' gradients (in their ``.grad``)
        go to the nodes that made them, its tensors are dropped; after the layer's last node,
        the layer's input gradients go on (``_finish_layer_backward``). Returns them."""
        record = layer.nodes[index]
        inputs = record.inputs
        assert inputs is not None
        input_grads = tuple([x.grad if isinstance(x, _Tensor) and x.requires_grad else None
                             for x in inputs])
        record.inputs = record.outputs = record.grads = None
        layer.backward_count += 1
        sources = record.sources
        if len(sources) == 1:  # one source gave every input (a node of a chain)
            source, part = sources[0]
            if source >= 0:
                _deliver(layer.nodes[source], part, input_grads)
        else:
            start = 0
            for (source, part), size in zip(sources, record.sizes):
                if source >= 0:
                    _deliver(layer.nodes[source], part, input_grads[start:start + size])
                start += size
        if layer.backward_count == len(layer.nodes):
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

    # ---- accounting ----------------------------------------------------------------------
    def live_tensors(self) -> int:
        """How many node-boundary tensors the tape still holds (each keeps its graph alive)."""
        return sum(len(r.tensors()) for layer in self.layers for r in layer.nodes)

    def live_nodes(self) -> int:
        """How many nodes still hold their graph (recorded, backward not yet run)."""
        return sum(1 for layer in self.layers for r in layer.nodes if r.live)


def _deliver(record: NodeRecord, part: slice, grads: Sequence[torch.Tensor | None]) -> None:
    """Gradients for the outputs ``part`` of ``record``, from one node that read them."""
    assert record.outputs is not None
    if record.grads is None:
        if record.readers == 1 and part == slice(None):  # a chain: the reader gives them all
            record.grads = list(grads)
            return
        record.grads = [None] * len(record.outputs)
        record.waiting = record.readers
    for position, grad in zip(range(len(record.outputs))[part], grads):
        record.grads[position] = grad
    record.waiting -= 1
