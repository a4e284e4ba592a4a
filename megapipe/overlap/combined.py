"""The combined step and its tape: one microbatch's forward beside another's backward.

**The tape** (``Tape``) is what a microbatch's forward, recorded node by node, leaves for its
backward: per layer a ``LayerRecord``, per node a ``NodeRecord`` with where its inputs come from,
its detached inputs (a node boundary detaches: a fresh leaf that requires grad exactly when the
original did, so each node owns a small autograd graph), its outputs (that graph's roots) and,
during backward, its outputs' gradients as the nodes that read them deliver them. A node runs
forward with ``forward_node`` (its function on its inputs) and backward with ``backward_node``
(one call into autograd's engine, the call ``torch.autograd.backward`` makes, without its
argument checks); each node's tensors are dropped as its backward runs. These are the operations
of ``plan.run_nodes``, so the results are bitwise those of plain autograd over the same plan:

- anything that needs a gradient flows through the node tuples (the ``LayerState`` is for
  metadata such as routing indices); a node reads only what it uses (a layer's residual goes
  around the nodes between, as a fork's ``around`` tensors do: no node only passes it on);
- gradients that meet at one tensor are summed in plain autograd's order (the tape walks the
  nodes last first, and the gradient a later node returns enters the earlier node's backward as
  the first term);
- a tensor that needs grad and feeds several layers from outside the previous layer's outputs
  must be a leaf; ordinary torch ops between layers ("glue") run their backward when the next
  layer's input gradients are known.

**The combined step** (``CombinedStep(streams, backward)``) is a node runner: the stage's forward
hands it its layers one by one (``run_layer``); it records each on its tape and issues the
layer's nodes beside the next backward layer of the other microbatch's tape in the pair order
(``megapipe.pairing.order``: the table is in its docstring), each on its stream (``_issue``):
``forward_node``, ``backward_node``, or deferred weight gradients (W) on the compute stream.
``finish()`` runs the backward layers without a partner and the W items still waiting.

- **Dataflow.** A node waits only for the issues its ``Issue.needs`` name (an event wait, made
  on the other stream), never for a slot to end: a CUDA host issues a whole layer pair without
  waiting; a CPU host (its compute stream is the host thread) waits exactly when a compute node
  needs a comm node's output.
- **One comm stream.** Every comm node runs on the communication stream in the order's
  sequence, which depends on the layers' node kinds only, so every rank issues its collectives
  alike.
- **Little host work per node** (on CUDA): events only where the other stream waits, from a pool
  made once (``Stream.run``, ``recycle``); no stream switch on the compute stream (the device's
  current stream); ``record_stream`` only on tensors that cross streams; one autograd-engine
  call per backward node.
- **Nothing held by an event.** The events ``Stream.run`` gives carry no value (an issue's
  results live on the tape), so the step's events, kept to its end, hold no tensor: a
  gradient handed to the node before dies once that node has read it.
- **Bitwise.** The operations are those of the tape path (``sequential``), only their order
  differs, and the two sides belong to different microbatches. On CUDA autograd runs each
  backward op on the stream its forward op ran on, so a comm node's backward overlaps only when
  its forward also ran on the comm stream (every forward recorded here).

A lone forward or backward is a combined step with one half missing (the executor runs every
training step of a combined schedule this way); with ``a2a_waves`` k > 1 a layer without a
partner overlaps its own all-to-all waves.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil
from typing import Any, Callable, Sequence

import torch
from torch.autograd import Variable

from megapipe.overlap.node_trace import NodeTrace
from megapipe.overlap.plan import (
    LayerState, Node, Plan, Source, Track, UndeclaredState, WarnOnce, WavePlan, layer_graph,
    node_plan_of,
)
from megapipe.overlap.streams import Event, Stream, Streams
from megapipe.overlap.wgrad import WeightGradQueue
from megapipe.pairing.order import COMM, FILL, HEAD, REST, Issue, IssueOrder, queuing_positions

Values = tuple[Any, ...]
Grads = tuple[torch.Tensor | None, ...]
_run_backward = Variable._execution_engine.run_backward  # what torch.autograd.backward calls
_WHOLE = slice(None)
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


# ---- the tape ---------------------------------------------------------------------------


class NodeRecord:
    """One node of one microbatch: where its inputs come from, its detached inputs, its outputs
    and, during backward, its outputs' gradients as its readers give them (``waiting``: readers
    still to give theirs). ``stream``: the stream it last ran on (the combined step)."""

    __slots__ = ("node", "sources", "inputs", "outputs", "grads", "waiting", "readers", "sizes",
                 "stream")

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

    __slots__ = ("index", "nodes", "state", "given_inputs", "outputs", "kinds", "forward_count",
                 "backward_count")

    def __init__(self, index: int, nodes: list[NodeRecord], given_inputs: Values,
                 kinds: tuple[Any, ...], state: LayerState) -> None:
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
            raise RuntimeError(f"layer {self.layers[-1].index} is still being recorded; "
                               "finish it before the next")
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

    def begin_layer_backward(self, grads: Sequence[torch.Tensor | None] | None = None,
                             wgrad: WeightGradQueue | None = None) -> LayerRecord:
        """Take the last layer whose backward has not run; ``grads`` are its outputs' gradients
        (needed for the first layer to go backward; None reads their ``.grad``; later layers get
        theirs from the layer after them). ``wgrad`` becomes the layer state's ``wgrad_queue``,
        where its deferrable ops put their weight gradients."""
        layer = next((lay for lay in reversed(self.layers)
                      if lay.backward_count < len(lay.nodes)), None)
        if layer is None:
            raise RuntimeError("every layer of the tape already ran backward")
        if layer.outputs is None:
            raise RuntimeError(f"layer {layer.index} was never finished forward")
        grads = self.incoming_grads(layer, grads)
        if len(grads) != len(layer.outputs):
            raise ValueError(f"layer {layer.index} has {len(layer.outputs)} outputs but got "
                             f"{len(grads)} gradients")
        self._pending_grads = None
        layer.outputs = None  # the leaves handed out are no longer needed
        layer.nodes[-1].grads = list(grads)
        layer.state.wgrad_queue = wgrad
        return layer

    def incoming_grads(self, layer: LayerRecord,
                       grads: Sequence[torch.Tensor | None] | None = None
                       ) -> Sequence[torch.Tensor | None]:
        """The gradients of ``layer``'s outputs that ``begin_layer_backward(grads)`` hands to
        its last node: ``grads``, else those the layer after it gave, else (the last layer)
        its outputs' ``.grad``."""
        if grads is None:
            grads = self._pending_grads
        if grads is None:
            if layer is not self.layers[-1]:
                raise RuntimeError(f"layer {layer.index}: no gradients for its outputs")
            grads = tuple(o.grad if isinstance(o, torch.Tensor) and o.requires_grad else None
                          for o in layer.outputs or ())
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

    def live_tensors(self) -> int:
        """How many node-boundary tensors the tape still holds (each keeps its graph alive)."""
        return sum(len(r.tensors()) for layer in self.layers for r in layer.nodes)

    def live_nodes(self) -> int:
        """How many nodes still hold their graph (recorded, backward not yet run)."""
        return sum(1 for layer in self.layers for r in layer.nodes if r.outputs is not None)


def _part(layer: LayerRecord, source: int, part: slice, reader: NodeRecord) -> Values:
    values = layer.given_inputs if source < 0 else layer.nodes[source].outputs
    if values is None:
        raise RuntimeError(f"node {reader.node.name!r} reads node "
                           f"{layer.nodes[source].node.name!r}, whose forward has not run")
    return values if part == _WHOLE else values[part]


def node_inputs(layer: LayerRecord, index: int) -> Values:
    """The detached inputs of node ``index`` of ``layer``, gathered from its sources on first
    use (the previous node's outputs, for a node of a chain)."""
    record = layer.nodes[index]
    if record.inputs is not None:
        return record.inputs
    if len(record.sources) == 1:
        record.inputs = detached(_part(layer, *record.sources[0], record))
        return record.inputs
    parts = [_part(layer, source, part, record) for source, part in record.sources]
    record.sizes = tuple(len(p) for p in parts)
    record.inputs = detached(tuple(v for p in parts for v in p))
    return record.inputs


def forward_node(tape: Tape, layer: LayerRecord, index: int) -> Values:
    """Run the forward of node ``index`` of ``layer`` and record its outputs on ``tape``; after
    the layer's last node the layer's outputs (fresh leaves) are set."""
    record = layer.nodes[index]
    if record.outputs is not None:
        raise RuntimeError(f"layer {layer.index}: node {index} already ran forward")
    outputs = checked(record.node.fn(layer.state, node_inputs(layer, index)),
                      f"node {record.node.name!r}")
    record.outputs = outputs
    if tape.track is not None:
        tape.track(outputs)
    layer.forward_count += 1
    if layer.forward_count == len(layer.nodes):
        layer.outputs = detached(outputs)
    return outputs


def backward_node(tape: Tape, layer: LayerRecord, index: int) -> Grads:
    """Run the backward of node ``index`` of ``layer`` (one autograd-engine call); deliver its
    inputs' gradients to the nodes that made them and drop its tensors; after the layer's last
    node route the layer's input gradients on. Returns its inputs' gradients."""
    record = layer.nodes[index]
    grads = record.grads
    if record.outputs is None:
        raise RuntimeError(f"layer {layer.index}: node {index} cannot run backward now")
    if record.waiting or grads is None:
        raise RuntimeError(
            f"node {record.node.name!r}: the gradients of its outputs are not all known yet")
    if len(grads) != len(record.outputs):
        raise ValueError(f"node {record.node.name!r} has {len(record.outputs)} outputs but "
                         f"got {len(grads)} gradients")
    # an output without a gradient (unused, or an integer tensor) is left out, as autograd
    # leaves it out
    pairs = [(out, grad) for out, grad in zip(record.outputs, grads)
             if grad is not None and isinstance(out, _Tensor) and out.requires_grad]
    inputs = record.inputs
    assert inputs is not None
    passed = _passed_through(pairs, inputs)
    if passed is not None:  # the node handed its inputs on unchanged: so are the gradients
        input_grads = passed
    else:
        if pairs:
            roots, root_grads = zip(*pairs)
            _run_backward(roots, root_grads, False, False, (), True, True)
        input_grads = tuple([x.grad if isinstance(x, _Tensor) and x.requires_grad else None
                             for x in inputs])
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
                _deliver(layer.nodes[source], part, input_grads[start:start + size])
            start += size
    if layer.backward_count == len(layer.nodes):
        tape._finish_layer_backward(layer, input_grads)
    return input_grads


def _passed_through(pairs: list[tuple[torch.Tensor, torch.Tensor]], inputs: Values
                    ) -> Grads | None:
    """The input gradients of a node whose outputs with a gradient are all its own input
    leaves, each once (a comm node with nothing to exchange: expert parallelism 1, no link):
    each input's gradient is its output's, the very values autograd would copy into the
    leaf's ``.grad`` (which costs a copy kernel per tensor). None for any other node."""
    if not pairs:
        return None
    given: dict[int, torch.Tensor] = {}
    for out, grad in pairs:
        if out.grad_fn is not None or id(out) in given or \
                not any(out is x for x in inputs):
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


# ---- the combined step ------------------------------------------------------------------


@dataclass
class BackwardHalf:
    """The backward half of a combined step: a recorded tape and its outputs' gradients.

    ``grads`` None reads the ``.grad`` of the tape's outputs. ``wgrad`` collects the weight
    gradients its deferrable ops put aside (``delay_wgrad_compute``, or an I action); with
    ``run_wgrad`` they run on the compute stream in the gaps the pair order gives them, without
    it they stay queued for the caller (an I half whose W comes later).
    """

    tape: Tape
    grads: Sequence[torch.Tensor | None] | None = None
    microbatch: int | None = None
    wgrad: WeightGradQueue | None = None
    run_wgrad: bool = True


class CombinedStep:
    """Runs a forward layer by layer (``run_layer``) beside the backward of another microbatch.

    Give it the backward half (None: a forward alone), drive the forward through ``run_layer``
    (from the stage's layer plans, or from a model's own forward as its ``node_runner``), then
    call ``finish()``; it returns the gradients of the backward tape's inputs. The forward is
    recorded on ``self.tape``. ``route_input_grads``: the forward tape's input gradients also
    flow on into its inputs (a model forward may transform its input before the first layer).
    ``a2a_waves`` k > 1 records every layer whose plan is a ``WavePlan`` in its k-wave form.
    ``track``: the activation meter. ``backward_done(grads)``, the one hand-over to the caller,
    is told on the host as soon as the backward's last node has been issued (the executor's
    ``pipeline.p2p.PairSends`` hands the gradient on from there); the step drops it at
    ``finish()``, and nothing the step is given points back at it, so no reference cycle
    outlives the step.
    """

    def __init__(
        self,
        streams: Streams,
        backward: BackwardHalf | None = None,
        *,
        backward_done: Callable[[Grads], None] | None = None,
        trace: NodeTrace | None = None,
        fwd_microbatch: int | None = None,
        route_input_grads: bool = True,
        a2a_waves: int = 1,
        track: Track | None = None,
    ) -> None:
        self.streams = streams
        self.tape = Tape(route_input_grads, track)
        self.backward = backward
        self._hand_over = backward_done
        self.trace = trace
        self.microbatch = {"F": fwd_microbatch, "B": backward.microbatch if backward else None}
        self.a2a_waves = a2a_waves
        self.warn_once: WarnOnce | None = None  # layers without a node plan, warned once each
        b_layers = backward.tape.layers if backward is not None else []
        if any(layer.backward_count or layer.outputs is None for layer in b_layers):
            raise RuntimeError("a combined step needs a recorded tape whose backward has not begun")
        times = [_times(layer.nodes) for layer in b_layers]
        defer = backward is not None and backward.run_wgrad and backward.wgrad is not None
        time_rule = bool(b_layers) and all(t is not None for t in times)
        self.order = IssueOrder([layer.kinds for layer in b_layers], defer,
                                times if time_rule else None,  # type: ignore[arg-type]
                                streams.compute.runs_on_host)
        # deferring: one W queue per backward layer, so the order can run a layer's in parts
        self._layer_wgrad = [WeightGradQueue(backward.wgrad.track) for _ in b_layers] \
            if defer and backward is not None and backward.wgrad is not None else None
        self._forward: list[LayerRecord] = []
        self._events: list[Event | None] = []  # per issue: its event (None: none recorded)
        self._trace_slots: dict[int, int] = {}
        self._finished = False

    # ---- public --------------------------------------------------------------------------
    def plan_of(self, layer: Any) -> list[Any]:
        """The node plan ``run_layer`` records for ``layer`` (``plan.node_plan_of``)."""
        if isinstance(layer, Plan) and (self.a2a_waves == 1 or
                                        not isinstance(layer, WavePlan)):
            return layer
        if self.warn_once is None:
            self.warn_once = WarnOnce()
        return node_plan_of(layer, self.warn_once, self.a2a_waves)

    def run_layer(self, layer: Any, inputs: Sequence[Any]) -> Values:
        """Record one forward layer, beside the next backward layer; return its outputs."""
        if self._finished:
            raise RuntimeError("CombinedStep.run_layer after finish()")
        record = self.tape.begin_layer(self.plan_of(layer), inputs)
        self._forward.append(record)
        times = _times(record.nodes) if self.order.clock is not None else None  # time rule
        self._issue(self.order.forward_layer(record.kinds, times))
        return self._on_compute(self.order.side_end["F"], lambda: record.outputs)

    def finish(self) -> Grads | None:
        """Run the leftover backward layers and the W items still waiting; order the compute
        stream after the comm stream (on CPU: wait for the comm thread). Returns the gradients
        of the backward tape's inputs (None without one)."""
        if self._finished:
            raise RuntimeError("CombinedStep.finish() called twice")
        self._finished = True
        self._issue(self.order.finish())
        streams = self.streams
        streams.compute.wait_event(streams.comm.run(None))  # type: ignore[arg-type]
        streams.recycle()  # every wait on this step's events is issued
        self._hand_over = None
        if self.backward is None:
            return None
        grads = self.backward.tape.input_grads
        streams.compute.record_use(grads)
        return grads

    # ---- carrying out the order ----------------------------------------------------------
    def _issue(self, issues: Sequence[Issue]) -> None:
        """Put each issue on its stream, in host order (``queuing_positions`` on a host that
        only queues work): a node after the events it needs, W items as a drain of their queues
        on the compute stream; the backward's last node hands its gradients on."""
        streams = self.streams
        events = self._events
        start = len(events)
        events += [None] * len(issues)
        positions = range(len(issues)) if streams.compute.runs_on_host else \
            queuing_positions(issues)
        try:
            for n in positions:
                issue = issues[n]
                if issue.side == "W":
                    self._issue_wgrad(issue)
                    continue
                comm = issue.stream == COMM
                stream = streams.comm if comm else streams.compute
                for need in issue.needs:  # made on the other stream: wait for its event
                    stream.wait_event(self._event(need))
                forward = issue.side == "F"
                if forward:
                    tape, layer = self.tape, self._forward[issue.layer]
                else:
                    tape = self.backward.tape  # type: ignore[union-attr]
                    layer = tape.layers[issue.layer]
                record = layer.nodes[issue.node]
                if comm:
                    if issue.reads_caller:  # what the caller made on the compute stream
                        stream.wait_event(streams.compute.run(None))  # type: ignore[arg-type]
                    if record.node.group is not None:
                        streams.claim(record.node.group, stream)
                if stream.keeps_memory and (issue.needs or issue.reads_caller):  # CUDA
                    self._keep_crossing(stream, layer, record, forward)
                record.stream = stream
                run, args = (forward_node, (tape, layer, issue.node)) if forward else \
                    (self._backward_node, (tape, layer, issue.node))
                if self.trace is not None:
                    run = self._traced(run, stream, issue, record.node)
                events[start + n] = stream.run(run, args, comm or issue.signals)
                if not forward and issue.layer == 0 and issue.node == 0:
                    self._backward_done()
        except BaseException:
            _quietly_wait(streams.comm.run(None))  # never abandon a tape in use
            raise

    def _event(self, position: int) -> Event:
        """The event of the issue at ``position`` (recorded now, on its stream, if it had none:
        later than needed, never too early)."""
        event = self._events[position]
        if event is None:
            issue = self.order.issues[position]
            stream = self.streams.comm if issue.stream == COMM else self.streams.compute
            event = self._events[position] = stream.run(None)
        return event  # type: ignore[return-value]

    def _keep_crossing(self, stream: Stream, layer: LayerRecord, record: NodeRecord,
                       forward: bool) -> None:
        """``record_use`` on ``stream`` of what a node that waits for the other stream reads:
        forward, its sources' outputs made on another stream (or given by the caller) and the
        tensors its layer's state lets cross (``LayerState.crossing``: kept once, in the
        forward that makes them, for all their uses); backward, the gradients its readers on
        another stream gave (for the layer's last node, all the layer's incoming gradients,
        from the next layer or the caller, which ``begin_layer_backward`` hands it only when
        it runs)."""
        if not forward:
            grads = record.grads
            index = layer.nodes.index(record)
            if index == len(layer.nodes) - 1:
                tape = self.backward.tape  # type: ignore[union-attr]
                stream.record_use(tape.incoming_grads(layer, self._given_grads(tape, layer)))
                return
            for reader in layer.nodes:
                if reader.stream is not stream:
                    for source, part in reader.sources:
                        if source == index:
                            stream.record_use(grads[part])  # type: ignore[index]
            return
        for source, part in record.sources:
            if source < 0 or layer.nodes[source].stream is not stream:
                stream.record_use(_part(layer, source, part, record))
        stream.record_use(layer.state.crossing(record.node.kind))

    def _given_grads(self, tape: Tape, layer: LayerRecord) -> Grads | None:
        """The gradients the caller gave the backward half, for the tape's last layer only
        (the others get theirs from the layer after them)."""
        assert self.backward is not None
        return self.backward.grads if layer.index == len(tape.layers) - 1 else None

    def _backward_node(self, tape: Tape, layer: LayerRecord, index: int) -> Grads:
        """``backward_node``; the layer's last node (its first backward) begins the layer."""
        assert self.backward is not None
        if index == len(layer.nodes) - 1:
            grads = self._given_grads(tape, layer)
            wgrad = self.backward.wgrad if self._layer_wgrad is None \
                else self._layer_wgrad[layer.index]
            tape.begin_layer_backward(None if grads is None else tuple(grads), wgrad)
        return backward_node(tape, layer, index)

    def _issue_wgrad(self, issue: Issue) -> None:
        assert self.backward is not None
        layers = self._layer_wgrad or []
        if issue.node == REST:
            queues = [q for q in layers + [self.backward.wgrad] if q is not None and len(q)]
        else:
            queues = [layers[issue.layer]] if len(layers[issue.layer]) else []
        if not queues:
            return
        count = issue.count if issue.node == FILL else None

        def run() -> None:
            for queue in queues:
                queue.run(ceil(len(queue) / 2) if issue.node == HEAD else count)

        compute = self.streams.compute
        if self.trace is not None:
            run = self._traced(run, compute, issue, None)
        compute.run(run, (), False)

    def _backward_done(self) -> None:
        """The backward's last node was issued: hand its input gradients to the caller."""
        backward, done = self.backward, self._hand_over
        assert backward is not None
        if done is not None:
            tape = backward.tape
            done(self._on_compute(self.order.side_end["B"], lambda: tape.input_grads))

    def _on_compute(self, position: int | None, values: Callable[[], Any]) -> Any:
        """``values()``, made by the issue at ``position``, made safe for the caller's work on
        the compute stream: when that issue ran on the comm stream, the compute stream waits for
        it first (on CPU: for the comm thread; its error is raised here)."""
        if position is None or self.order.issues[position].stream != COMM:
            return values()
        compute = self.streams.compute
        try:
            compute.wait_event(self._event(position))
        except BaseException:
            _quietly_wait(self.streams.comm.run(None))
            raise
        made = values()
        compute.record_use(made)
        return made

    def _traced(self, run: Callable[..., Any], stream: Stream, issue: Issue,
                node: Node | None) -> Callable[..., Any]:
        trace = self.trace
        assert trace is not None
        slot = self._trace_slots.get(issue.slot)
        if slot is None:
            slot = self._trace_slots[issue.slot] = trace.new_slot()
        side = "B" if issue.side == "W" else issue.side
        name, kind = ("wgrad", "compute") if node is None else (node.name, node.kind.value)
        label = (self.microbatch[side], max(issue.layer, 0), name, issue.side, stream, kind, slot)

        def traced(*args: Any) -> Any:
            with trace.span(*label):
                return run(*args)

        return traced


def _times(nodes: Sequence[NodeRecord]) -> tuple | None:
    """The nodes' expected times (``Node.times``), or None unless every node has them."""
    times = tuple(record.node.times for record in nodes)
    return None if any(t is None for t in times) else times


def _quietly_wait(event: Event | None) -> None:
    try:
        if event is not None:
            event.synchronize()
    except BaseException:  # the caller is already raising the first error
        pass


def combined_step(
    fwd_plans: Sequence[Any],
    fwd_inputs: Sequence[Any],
    bwd_tape: Tape | None,
    bwd_grads: Sequence[torch.Tensor | None] | None,
    streams: Streams,
    *,
    delay_wgrad_compute: bool = False,
    wgrad: WeightGradQueue | None = None,
    trace: NodeTrace | None = None,
    fwd_microbatch: int | None = None,
    bwd_microbatch: int | None = None,
) -> tuple[Values, Tape, Grads | None]:
    """Forward of ``fwd_plans`` on ``fwd_inputs`` beside the backward of ``bwd_tape``.

    Returns ``(forward outputs, forward tape, gradients of the backward tape's inputs)``; the
    forward outputs and tape are exactly those ``record_forward`` would give, the gradients
    those of ``run_backward`` (followed by running the deferred weight gradients, which
    ``delay_wgrad_compute`` or a given ``wgrad`` queue defer).
    """
    if wgrad is None and delay_wgrad_compute:
        wgrad = WeightGradQueue()
    backward = None
    if bwd_tape is not None:
        backward = BackwardHalf(bwd_tape, bwd_grads, bwd_microbatch, wgrad)
    step = CombinedStep(streams, backward, trace=trace, fwd_microbatch=fwd_microbatch,
                        route_input_grads=False)
    values: Values = tuple(fwd_inputs)
    try:
        for plan in fwd_plans:
            values = step.run_layer(plan, values)
    except BaseException:
        _quietly_wait(streams.comm.run(None))
        raise
    grads = step.finish()
    return values, step.tape, grads
