"""The combined step: one microbatch's forward beside another's backward, node by node.

A node runs forward with ``forward_node`` (its function on its detached inputs) and backward
with ``backward_node`` (one call into autograd's engine: the call ``torch.autograd.backward``
makes, without its argument checks, since the gradients come from autograd itself); the tape
(``tape.Tape``) keeps what each leaves for the other. ``sequential`` runs a stage's nodes one
after the other with them (the tape path, bitwise plain autograd).

``CombinedStep(streams, backward)`` is a node runner: the stage's forward hands it its layers
one by one (``run_layer``), it records each on a new tape and issues the layer's nodes beside
the next backward layer of the other microbatch's tape in the order ``megapipe.schedule.
pair_order`` gives (the one statement of the pair order; its docstring has the table), each on
its stream (``_issue``): ``forward_node``, ``backward_node``, or deferred weight gradients (W)
from a ``WeightGradQueue`` on the compute stream. ``finish()`` runs the backward layers that
had no partner and the W items still waiting, and orders the compute stream after the comm
stream.

- **Dataflow.** A node waits only for the nodes its ``Issue.needs`` name (an event wait, made on
  the other stream), never for a slot to end: on CUDA the host issues a whole layer pair
  without waiting; on CPU (the compute stream is the host thread) the host waits exactly when a
  compute node needs a comm node's output.
- **One comm stream.** Every comm node runs on the communication stream in the order's sequence,
  which depends on the layers' node kinds only, so every rank issues its collectives alike.
- **Bitwise.** The operations are those of the tape path (``sequential.record_forward``,
  ``run_backward``, the same W GEMMs), only their order differs, and the two sides belong to
  different microbatches. On CUDA, autograd runs each backward op on the stream its forward op
  ran on, so a comm node's backward overlaps only when its forward also ran on the comm stream
  (every forward recorded here).

A lone forward or backward is a combined step with one half missing (the executor runs every
training step of a combined schedule this way), and with ``a2a_chunks`` k > 1 a layer without a
partner overlaps its own all-to-all chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil
from typing import Any, Callable, Sequence

import torch
from torch.autograd import Variable

from megapipe.overlap.node_trace import NodeTrace
from megapipe.overlap.plan import Node, Track, WarnOnce, node_plan_of
from megapipe.overlap.streams import Event, Stream, Streams
from megapipe.overlap.tape import Grads, LayerRecord, Tape, Values, checked, detached
from megapipe.overlap.wgrad import WeightGradQueue
from megapipe.schedule.node_timing import NodeTimes
from megapipe.schedule.kept_orders import PairOrders, ReusedOrder
from megapipe.schedule.pair_order import (
    COMM, FILL, HEAD, REST, Issue, IssueOrder, compute_first_positions,
)

_run_backward = Variable._execution_engine.run_backward  # what torch.autograd.backward calls
_WHOLE = slice(None)


def node_inputs(layer: LayerRecord, index: int) -> Values:
    """The detached inputs of node ``index`` of ``layer``, gathered from its sources on first
    use (the previous node's outputs, for a node of a chain)."""
    record = layer.nodes[index]
    if record.inputs is not None:
        return record.inputs
    if len(record.sources) == 1:  # one source (a node of a chain: the node before it)
        source, part = record.sources[0]
        values = layer.given_inputs if source < 0 else layer.nodes[source].outputs
        if values is None:
            raise RuntimeError(f"node {record.node.name!r} reads node "
                               f"{layer.nodes[source].node.name!r}, whose forward has not run")
        record.inputs = detached(values if part == _WHOLE else values[part])
        return record.inputs
    parts = []
    for source, part in record.sources:
        values = layer.given_inputs if source < 0 else layer.nodes[source].outputs
        if values is None:
            raise RuntimeError(f"node {record.node.name!r} reads node "
                               f"{layer.nodes[source].node.name!r}, whose forward has not run")
        parts.append(values[part])
    record.sizes = tuple(len(p) for p in parts)
    record.inputs = detached(tuple(v for p in parts for v in p))
    return record.inputs


def forward_node(tape: Tape, layer: LayerRecord, index: int) -> Values:
    """Run the forward of node ``index`` of ``layer`` (recorded on ``tape``)."""
    record = layer.nodes[index]
    outputs = checked(record.node.fn(layer.state, node_inputs(layer, index)),
                      f"node {record.node.name!r}")
    tape.node_ran_forward(layer, index, outputs)
    return outputs


def backward_node(tape: Tape, layer: LayerRecord, index: int) -> Grads:
    """Run the backward of node ``index`` of ``layer``; returns its inputs' gradients."""
    grads = tape.backward_grads(layer, index)
    # an output without a gradient (unused, or an integer tensor) is left out, as autograd
    # leaves it out
    pairs = [(out, grad) for out, grad in zip(layer.nodes[index].outputs or (), grads)
             if grad is not None and isinstance(out, torch.Tensor) and out.requires_grad]
    if pairs:
        roots, root_grads = zip(*pairs)
        _run_backward(roots, root_grads, False, False, (), True, True)
    return tape.node_ran_backward(layer, index)


@dataclass
class BackwardHalf:
    """The backward half of a combined step: a recorded tape and its outputs' gradients.

    ``grads`` None reads the ``.grad`` of the tape's outputs. ``wgrad`` collects the weight
    gradients its deferrable ops put aside (``delay_wgrad_compute``, or an I step); with
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
    ``on_backward_done(grads)`` is called on the host as soon as the backward's last node has run
    (the executor sends the gradient on from there). ``a2a_chunks`` k > 1 records every layer
    whose plan is a ``ChunkedPlan`` in its k-chunk form. ``track``: the activation meter.
    ``orders``: the runner's ``PairOrders``, so a step shaped like an earlier one takes its
    order instead of planning it again (count rule; nodes with times plan each step).
    """

    def __init__(
        self,
        streams: Streams,
        backward: BackwardHalf | None = None,
        *,
        trace: NodeTrace | None = None,
        fwd_microbatch: int | None = None,
        route_input_grads: bool = True,
        on_backward_done: Callable[[Grads], None] | None = None,
        a2a_chunks: int = 1,
        track: Track | None = None,
        orders: PairOrders | None = None,
    ) -> None:
        self.streams = streams
        self.tape = Tape(route_input_grads, track)
        self.backward = backward
        self.trace = trace
        self.microbatch = {"F": fwd_microbatch, "B": backward.microbatch if backward else None}
        self.on_backward_done = on_backward_done
        self.a2a_chunks = a2a_chunks
        self.warn_once = WarnOnce()  # layer types without a node plan, warned about once each
        b_layers = backward.tape.layers if backward is not None else []
        if any(layer.backward_count or not layer.recorded for layer in b_layers):
            raise RuntimeError("a combined step needs a recorded tape whose backward has not begun")
        times = [_times(layer.nodes) for layer in b_layers]
        defer = backward is not None and backward.run_wgrad and backward.wgrad is not None
        host = streams.compute.runs_on_host
        kinds = [layer.kinds for layer in b_layers]
        self.order: IssueOrder | ReusedOrder
        if all(t is not None for t in times) and b_layers:  # the time rule: planned each step
            self.order = IssueOrder(kinds, defer, times, host)  # type: ignore[arg-type]
        else:  # the count rule: planned once per shape of step (kept in the runner's orders)
            self.order = (orders or PairOrders()).order(kinds, defer, host)
        # deferring: one W queue per backward layer, so the order can run a layer's in parts
        self._layer_wgrad = [WeightGradQueue(backward.wgrad.track) for _ in b_layers] \
            if defer and backward is not None and backward.wgrad is not None else None
        self._forward: list[LayerRecord] = []
        self._events: list[Event | None] = []  # per issue: its event (None for W)
        self._trace_slots: dict[int, int] = {}
        self._finished = False

    # ---- public --------------------------------------------------------------------------
    def plan_of(self, layer: Any) -> list[Any]:
        """The node plan ``run_layer`` records for ``layer`` (``plan.node_plan_of``)."""
        return node_plan_of(layer, self.warn_once, self.a2a_chunks)

    def run_layer(self, layer: Any, inputs: Sequence[Any]) -> Values:
        """Record one forward layer, beside the next backward layer; return its outputs."""
        if self._finished:
            raise RuntimeError("CombinedStep.run_layer after finish()")
        record = self.tape.begin_layer(self.plan_of(layer), inputs)
        self._forward.append(record)
        times = _times(record.nodes) if self.order.clock is not None else None  # time rule
        self._issue(self.order.forward_layer(record.kinds, times))
        return self._on_compute(("F", len(self._forward) - 1, len(record.nodes) - 1),
                                lambda: record.outputs)

    def finish(self) -> Grads | None:
        """Run the leftover backward layers and the W items still waiting; order the compute
        stream after the comm stream (on CPU: wait for the comm thread). Returns the gradients
        of the backward tape's inputs (None without one)."""
        if self._finished:
            raise RuntimeError("CombinedStep.finish() called twice")
        self._finished = True
        self._issue(self.order.finish())
        compute = self.streams.compute
        compute.wait_event(self.streams.comm.record_event())
        if self.backward is None:
            return None
        grads = self.backward.tape.input_grads
        compute.record_use(grads)
        return grads

    # ---- carrying out the order ----------------------------------------------------------
    def _issue(self, issues: Sequence[Issue]) -> None:
        """Put each issue on its stream, in host order (``compute_first`` on a queuing host): a
        node after the events it needs, as ``forward_node`` or ``_backward_node``; W items as a
        run of their queues on the compute stream."""
        streams = self.streams
        start = len(self._events)
        self._events += [None] * len(issues)
        positions = range(len(issues)) if streams.compute.runs_on_host else \
            compute_first_positions(issues)
        try:
            for n in positions:
                issue = issues[n]
                if issue.side == "W":
                    self._issue_wgrad(issue)
                    continue
                comm = issue.stream == COMM
                stream = streams.comm if comm else streams.compute
                for need in issue.needs:  # made on the other stream: wait for its event
                    stream.wait_event(self._events[need])  # type: ignore[arg-type]
                crossed = bool(issue.needs)
                forward = issue.side == "F"
                if forward:
                    tape, layer = self.tape, self._forward[issue.layer]
                else:
                    assert self.backward is not None
                    tape, layer = self.backward.tape, self.backward.tape.layers[issue.layer]
                node = layer.nodes[issue.node].node
                if comm:
                    if self._reads_caller(issue):  # what the caller made on the compute stream
                        stream.wait_event(streams.compute.record_event())
                        crossed = True
                    if node.group is not None:
                        streams.claim(node.group, stream)
                keep = crossed and stream.keeps_memory  # made on the other stream, used here
                if forward:
                    if keep:  # the producers' outputs: a CUDA host issued them already
                        stream.record_use([layer.given_inputs if s < 0 else layer.nodes[s].outputs
                                           for s, _ in layer.nodes[issue.node].sources])
                    run, args = forward_node, (tape, layer, issue.node)
                else:  # its output gradients are known once its layer's backward began
                    run, args = self._backward_node, (tape, layer, issue.node,
                                                      stream if keep else None)
                if self.trace is not None:
                    run = self._traced(run, stream, issue, node)
                self._events[start + n] = stream.submit(run, *args)
                if not forward and issue.layer == 0 and issue.node == 0:
                    self._backward_done()
        except BaseException:
            _quietly_wait(streams.comm.record_event())  # never abandon a tape in use
            raise

    def _reads_caller(self, issue: Issue) -> bool:
        """Whether a node reads what the caller gave: a forward layer's input (it reads no node
        of its layer), or the backward's very first node (the given gradients)."""
        order = self.order
        if issue.side == "F":
            return not order.forward_layers[issue.layer].reads[issue.node]
        return issue.layer == len(order.backward_layers) - 1 and \
            not order.backward_layers[issue.layer].readers[issue.node]

    def _backward_node(self, tape: Tape, layer: LayerRecord, index: int,
                       keep_on: Stream | None) -> Grads:
        """``backward_node``; the layer's first backward node begins the layer on its stream
        (after the layer before it ended there or on the other stream). ``keep_on``: the stream
        the output gradients cross to (their memory is kept for it: CUDA)."""
        assert self.backward is not None
        if index == len(layer.nodes) - 1:
            grads = self.backward.grads if layer.index == len(tape.layers) - 1 else None
            wgrad = self.backward.wgrad if self._layer_wgrad is None \
                else self._layer_wgrad[layer.index]
            begun = tape.begin_layer_backward(None if grads is None else tuple(grads), wgrad)
            assert begun is layer, (begun.index, layer.index)
        if keep_on:
            keep_on.record_use(layer.nodes[index].grads)
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
        compute.submit(run)

    def _backward_done(self) -> None:
        """The backward's last node was issued: hand its input gradients to the caller."""
        if self.on_backward_done is not None:
            assert self.backward is not None
            tape = self.backward.tape
            self.on_backward_done(self._on_compute(("B", 0, 0), lambda: tape.input_grads))

    def _on_compute(self, made_by: tuple[str, int, int], values: Callable[[], Any]) -> Any:
        """``values()``, made by the node ``made_by`` (side, layer, node), made safe for the
        caller's work on the compute stream: when that node ran on the comm stream, the compute
        stream waits for it first (on CPU: for the comm thread; its error is raised here)."""
        position = self.order.position[made_by]
        if self.order.issues[position].stream != COMM:
            return values()
        compute = self.streams.compute
        try:
            compute.wait_event(self._events[position])  # type: ignore[arg-type]
        except BaseException:
            _quietly_wait(self.streams.comm.record_event())
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


def _times(nodes: Sequence[Any]) -> tuple[NodeTimes, ...] | None:
    """The nodes' expected times (``Node.times``), or None unless every node has them."""
    times = tuple(record.node.times for record in nodes)
    return None if any(t is None for t in times) else times  # type: ignore[return-value]


def _quietly_wait(event: Event) -> None:
    try:
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
    orders: PairOrders | None = None,
) -> tuple[Values, Tape, Grads | None]:
    """Forward of ``fwd_plans`` on ``fwd_inputs`` beside the backward of ``bwd_tape``.

    Returns ``(forward outputs, forward tape, gradients of the backward tape's inputs)``; the
    forward outputs and tape are exactly those ``record_forward`` would give, the gradients
    those of ``run_backward`` (followed by running the deferred weight gradients, which
    ``delay_wgrad_compute`` or a given ``wgrad`` queue defer). ``orders``: as ``CombinedStep``'s.
    """
    if wgrad is None and delay_wgrad_compute:
        wgrad = WeightGradQueue()
    backward = None
    if bwd_tape is not None:
        backward = BackwardHalf(bwd_tape, bwd_grads, bwd_microbatch, wgrad)
    step = CombinedStep(streams, backward, trace=trace, fwd_microbatch=fwd_microbatch,
                        route_input_grads=False, orders=orders)
    values: Values = tuple(fwd_inputs)
    try:
        for plan in fwd_plans:
            values = step.run_layer(plan, values)
    except BaseException:
        _quietly_wait(streams.comm.record_event())
        raise
    grads = step.finish()
    return values, step.tape, grads
