"""The co-scheduler: one microbatch's forward beside another's backward, node by node.

Forward layer k of microbatch i runs beside the next backward layer of microbatch j (the
backward walks its tape last layer first), counting only layers with a comm node; layers without
one (dense, embedding, head) run alone where they stand. Which nodes go side by side, in which
order each stream gets them, and where the deferred weight gradients go is decided by one pure
rule, ``megapipe.sim.pair_plan`` (shared with the simulator; its docstring has the table of the
four pairs). This module carries that plan out on the streams:

- **Dataflow.** Each node waits only for its own input: the previous node of its side, through
  an event when that ran on the other stream. There are no per-slot joins, so on CUDA the host
  issues a whole layer pair without waiting; on CPU (the compute stream is the host thread) the
  host waits exactly when a compute node needs a comm node's output.
- **One comm stream.** Every comm node runs on the communication stream, in the plan's order,
  which depends only on the layers' node kinds: every rank of a group issues its collectives in
  the same order.
- **Deferred weight gradients** (``delay_wgrad_compute``): each backward layer's W items go into
  a queue of their own; the plan runs the first half beside that layer's backward dispatch and
  holds the rest for the next backward combine, where the forward's attention leaves the compute
  stream idle (the count rule). When every node carries its expected times (``Node.times``) the
  plan instead runs them where the compute stream would wait, by time (the time rule,
  ``megapipe.sim.wgrad_fill``). ``finish`` runs whatever is left.
- **Stream-ordered end.** ``finish`` makes the compute stream wait for the comm stream (an event
  wait): on CUDA the host runs ahead; on CPU this blocks until the comm thread is done, as before.

The operations are exactly those of the sequential path (forward via the tape, backward via the
tape, the same weight-gradient GEMMs), so results are bitwise equal; only their order differs,
and the two sides of a pair belong to different microbatches and share no data. On CUDA, autograd
runs each backward op on the stream its forward op ran on, so a comm node's backward overlaps
only when its forward also ran on the comm stream (every forward recorded by this co-scheduler).
A node should not block the host: on CUDA the host issues both streams' work.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil
from typing import Any, Callable, Sequence

import torch

from megapipe.overlap.node_trace import NodeTrace
from megapipe.overlap.plan import Node, WarnOnce, node_plan_of
from megapipe.overlap.streams import Event, Stream, Streams
from megapipe.overlap.tape import Grads, LayerRecord, Tape, Values
from megapipe.overlap.wgrad import WeightGradQueue
from megapipe.sim.layer_shape import LayerShape, layer_shape
from megapipe.sim.pair_plan import COMM, FILL, HEAD, REST, Issue, StepPlanner, compute_first
from megapipe.sim.wgrad_fill import NodeTimes


@dataclass
class TapeBackward:
    """The backward half a ``CoScheduler`` walks: a recorded tape and its outputs' gradients.

    ``grads`` None reads the ``.grad`` of the tape's outputs. ``wgrad`` collects the weight
    gradients its deferrable ops put aside (``delay_wgrad_compute``, or an I step); with
    ``run_wgrad`` they run on the compute stream beside backward comm nodes and in
    ``finish``, without it they stay queued for the caller (an I half whose W comes later).
    """

    tape: Tape
    grads: Sequence[torch.Tensor | None] | None = None
    microbatch: int | None = None
    wgrad: WeightGradQueue | None = None
    run_wgrad: bool = True


class CoScheduler:
    """Runs a forward layer by layer (``run_layer``) beside the backward of another microbatch.

    Construct it with the backward half (a ``TapeBackward``, or None for a forward alone),
    drive the forward through ``run_layer`` (directly, or from a model's own forward as its
    ``node_runner``), then call ``finish()``: it runs the backward layers that had no forward
    partner and the deferred weight gradients, orders the compute stream after the comm stream
    and returns the gradients of the backward tape's inputs. The forward is recorded on
    ``self.tape`` for its own backward. ``route_input_grads``: whether the forward tape's input
    gradients also flow on into its inputs (a model forward may transform its input before the
    first layer). ``on_backward_done(grads)`` is called on the host as soon as the backward's
    last node has run (its gradients safe for the compute stream), possibly before ``finish``:
    the executor sends the gradient on from there. ``a2a_chunks`` k > 1 records every layer
    whose plan is a ``ChunkedPlan`` in its k-chunk form (a layer without a partner then
    overlaps its own chunks).
    """

    def __init__(
        self,
        streams: Streams,
        backward: TapeBackward | None = None,
        *,
        trace: NodeTrace | None = None,
        fwd_microbatch: int | None = None,
        route_input_grads: bool = True,
        on_backward_done: Callable[[Grads], None] | None = None,
        a2a_chunks: int = 1,
    ) -> None:
        self.streams = streams
        self.tape = Tape(route_input_grads=route_input_grads)
        self.backward = backward
        self.wgrad = backward.wgrad if backward is not None else None
        self.run_wgrad = backward.run_wgrad if backward is not None else True
        self.trace = trace
        self.fwd_microbatch = fwd_microbatch
        self.bwd_microbatch = backward.microbatch if backward is not None else None
        self.warn_once = WarnOnce()  # layer types without a node plan, warned about once each
        self.on_backward_done = on_backward_done
        defer = self.run_wgrad and self.wgrad is not None
        shapes, times = self._backward_layers()
        self.planner = StepPlanner(shapes, defer_wgrad=defer, backward_times=times,
                                   host_runs_compute=streams.compute.runs_on_host)
        # one queue per backward layer, so the plan can run a layer's W items in two parts
        hold = self.wgrad.on_hold if self.wgrad is not None else None
        self._layer_wgrad = {
            i: WeightGradQueue(hold) for i in range(len(self.planner.backward_layers))
        }
        self.a2a_chunks = a2a_chunks
        self._finished = False
        self._backward_started = False
        self._forward_layer: LayerRecord | None = None
        self._forward_shapes: list[LayerShape] = []
        self._events: dict[int, tuple[Stream, Event]] = {}  # issue position -> its stream, event
        self._trace_slots: dict[int, int] = {}

    # ---- public --------------------------------------------------------------------------
    def plan_of(self, layer: Any) -> list[Any]:
        """The node plan ``run_layer`` records for ``layer`` (``plan.node_plan_of``), in its
        chunked form when ``a2a_chunks`` > 1 and the layer offers one."""
        return node_plan_of(layer, self.warn_once, self.a2a_chunks)

    def run_layer(self, layer: Any, inputs: Sequence[Any]) -> Values:
        """Record one forward layer, co-scheduled with the next pending backward layer."""
        if self._finished:
            raise RuntimeError("CoScheduler.run_layer after finish()")
        record = self.tape.begin_layer(self.plan_of(layer), tuple(inputs))
        self._forward_layer = record
        self._forward_shapes.append(layer_shape(record.shape))
        times = _times([node.node for node in record.nodes])
        self._execute(self.planner.forward_layer(record.shape, times))
        return self._forward_outputs(record)

    def finish(self) -> Grads | None:
        """Run the leftover backward layers and the deferred weight gradients; order the compute
        stream after the comm stream (on CPU: wait for the comm thread). Returns the gradients
        of the backward tape's inputs (None without one)."""
        if self._finished:
            raise RuntimeError("CoScheduler.finish() called twice")
        self._finished = True
        self._execute(self.planner.finish())
        streams = self.streams
        streams.compute.wait_event(streams.comm.record_event())
        if self.backward is None:
            return None
        grads = self.backward.tape.input_grads
        streams.compute.hold(grads)
        return grads

    # ---- carrying out the plan -----------------------------------------------------------
    def _backward_layers(self) -> tuple[list[Any], list[tuple[NodeTimes, ...]] | None]:
        """The backward tape's layer shapes, and their node times (None unless every node
        has times: the plan's count rule)."""
        if self.backward is None:
            return [], None
        layers = self.backward.tape.layers
        if any(layer.backward_done or not layer.recorded for layer in layers):
            raise RuntimeError("a CoScheduler needs a recorded tape whose backward has not begun")
        times = [_times([record.node for record in layer.nodes]) for layer in layers]
        timed = [t for t in times if t is not None]
        return [layer.shape for layer in layers], timed if len(timed) == len(times) else None

    def _execute(self, issues: Sequence[Issue]) -> None:
        start = len(self.planner.issues) - len(issues)
        position = {id(issue): start + n for n, issue in enumerate(issues)}
        order = issues if self.streams.compute.runs_on_host else compute_first(issues)
        try:
            for issue in order:
                if issue.side == "W":
                    self._issue_wgrad(issue)
                    continue
                self._events[position[id(issue)]] = self._issue_node(issue)
                if issue.side == "B" and issue.layer == 0 and issue.node == 0:
                    self._backward_done()
        except BaseException:
            _quietly_wait(self.streams.comm.record_event())  # never abandon a tape in use
            raise

    def _issue_node(self, issue: Issue) -> tuple[Stream, Event]:
        streams = self.streams
        stream = streams.comm if issue.stream == COMM else streams.compute
        for need in issue.needs:  # inputs made on the other stream: wait for their events
            stream.wait_event(self._events[need][1])
        cross = bool(issue.needs)
        if stream is streams.comm and self._reads_callers_input(issue):
            stream.wait_event(streams.compute.record_event())
            cross = True
        if issue.side == "F":
            node, step = self._forward_step(issue, stream, cross)
            microbatch = self.fwd_microbatch
        else:
            node, step = self._backward_step(issue, stream, cross)
            microbatch = self.bwd_microbatch
        if stream is streams.comm:
            streams.claim(node.group, stream)
        if self.trace is not None:
            label = (microbatch, issue.layer, node.name, issue.side, node.kind.value)
            step = self._traced(step, stream, label, issue)
        return stream, stream.submit(step)

    def _reads_callers_input(self, issue: Issue) -> bool:
        """Whether the node reads what the caller made on the compute stream: a forward layer's
        first node (its inputs), or the backward's very first node (the given gradients)."""
        if issue.side == "F":
            return not self._forward_shapes[issue.layer].reads[issue.node]
        return issue.layer == len(self.planner.backward_layers) - 1 and not (
            self.planner.backward_layers[issue.layer].readers[issue.node]
        )

    def _forward_step(
        self, issue: Issue, stream: Stream, cross: bool
    ) -> tuple[Node, Callable[[], Any]]:
        layer = self._forward_layer
        assert layer is not None
        record = layer.nodes[issue.node]

        def step() -> Values:
            inputs = self.tape.forward_inputs(layer, issue.node)
            if cross:
                stream.hold(inputs)
            return self.tape.forward_step(layer, issue.node).outputs

        return record.node, step

    def _backward_step(
        self, issue: Issue, stream: Stream, cross: bool
    ) -> tuple[Node, Callable[[], Any]]:
        assert self.backward is not None
        tape = self.backward.tape
        layer = tape.layers[issue.layer]
        first = issue.node == len(layer.nodes) - 1

        def step() -> Grads:
            # runs on ``stream`` after the previous backward node: begin the layer there
            if first:
                self._begin_backward_layer(issue.layer)
            if cross:
                stream.hold(layer.nodes[issue.node].pending_grads)
            return tape.backward_step(layer, issue.node)

        return layer.nodes[issue.node].node, step

    def _begin_backward_layer(self, index: int) -> None:
        assert self.backward is not None
        grads = None
        if not self._backward_started and self.backward.grads is not None:
            grads = tuple(self.backward.grads)
        self._backward_started = True
        wgrad = self._layer_wgrad[index] if self.planner.defer_wgrad else self.wgrad
        layer = self.backward.tape.begin_layer_backward(grads, wgrad=wgrad)
        assert layer.index == index, (layer.index, index)

    def _issue_wgrad(self, issue: Issue) -> None:
        if issue.node == REST:
            queues = list(self._layer_wgrad.values()) + [self.wgrad]
        else:
            queues = [self._layer_wgrad[issue.layer]]
        if not any(queue is not None and len(queue) for queue in queues):
            return

        def run() -> None:
            for queue in queues:
                if queue is None:
                    continue
                if issue.node == HEAD:
                    queue.run(ceil(len(queue) / 2))
                else:
                    queue.run(issue.count if issue.node == FILL else None)

        compute = self.streams.compute
        if self.trace is not None:
            label = (self.bwd_microbatch, max(issue.layer, 0), "wgrad", "W", "compute")
            run = self._traced(run, compute, label, issue)
        compute.submit(run)

    def _backward_done(self) -> None:
        """The backward's last node was issued: hand its input gradients to the hook."""
        if self.on_backward_done is None:
            return
        assert self.backward is not None
        stream, event = self._events[self.planner.positions[("B", 0, 0)]]
        compute = self.streams.compute
        if stream is not compute:
            compute.wait_event(event)  # on CPU: wait for the comm thread
        grads = self.backward.tape.input_grads
        assert grads is not None
        compute.hold(grads)
        self.on_backward_done(grads)

    def _forward_outputs(self, layer: LayerRecord) -> Values:
        """The layer's outputs, made safe for the caller's work on the compute stream."""
        last = ("F", len(self._forward_shapes) - 1, len(layer.nodes) - 1)
        stream, event = self._events[self.planner.positions[last]]
        compute = self.streams.compute
        crossed = stream is not compute
        if crossed:  # the layer ended with a comm node
            try:
                compute.wait_event(event)  # on CPU: wait for the comm thread (re-raises its error)
            except BaseException:
                _quietly_wait(self.streams.comm.record_event())
                raise
        assert layer.outputs is not None
        if crossed:
            compute.hold(layer.outputs)
        return layer.outputs

    def _traced(
        self, fn: Callable[[], Any], stream: Stream, label: tuple, issue: Issue
    ) -> Callable[[], Any]:
        trace = self.trace
        assert trace is not None
        slot = self._trace_slots.get(issue.slot)
        if slot is None:
            slot = self._trace_slots[issue.slot] = trace.new_slot()
        microbatch, layer, name, direction, kind = label

        def run() -> Any:
            with trace.span(microbatch, layer, name, direction, stream, kind, slot):
                return fn()

        return run


def _times(nodes: Sequence[Node]) -> tuple[NodeTimes, ...] | None:
    """The nodes' expected times, or None unless every node has them."""
    times = tuple(node.times for node in nodes)
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
        backward = TapeBackward(bwd_tape, bwd_grads, bwd_microbatch, wgrad)
    scheduler = CoScheduler(
        streams, backward, trace=trace, fwd_microbatch=fwd_microbatch, route_input_grads=False
    )
    values: Values = tuple(fwd_inputs)
    try:
        for plan in fwd_plans:
            values = scheduler.run_layer(plan, values)
    except BaseException:
        _quietly_wait(streams.comm.record_event())
        raise
    grads = scheduler.finish()
    return values, scheduler.tape, grads
