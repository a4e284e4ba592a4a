"""The combined step: one microbatch's forward beside another's backward, in the pair order.

``CombinedStep(streams, backward)`` is a node runner: the stage's forward hands it its layers
one by one (``run_layer``); it records each on its tape (``overlap.tape``) and issues the
layer's nodes beside the next backward layer of the other microbatch's tape in the pair order
(``megapipe.pairing.order``: the table is in its docstring), each on its stream (``_issue``):
``Tape.forward_node``, ``Tape.backward_node``, or deferred weight gradients (W) on the compute
stream. ``finish()`` runs the backward layers without a partner and the W items still waiting.

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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import ceil
from typing import Any, cast

import torch

from megapipe.overlap.node_trace import NodeTrace
from megapipe.overlap.plan import Node, Plan, Track, WarnOnce, WavePlan, node_plan_of
from megapipe.overlap.streams import Event, Stream, Streams
from megapipe.overlap.tape import Grads, LayerRecord, NodeRecord, Tape, Values, source_values
from megapipe.overlap.wgrad import WeightGradQueue
from megapipe.pairing.order import (
    COMM,
    FILL,
    HEAD,
    REST,
    Issue,
    IssueName,
    IssueOrder,
    queuing_positions,
)
from megapipe.pairing.timing import LayerTimes


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
    ``pipeline.transit.PairSends`` hands the gradient on from there); the step drops it at
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
        self.order = IssueOrder(
            [layer.kinds for layer in b_layers],
            defer,
            # time_rule: every layer has its times
            cast("list[LayerTimes]", times) if time_rule else None,
            streams.compute.runs_on_host,
        )
        # deferring: one W queue per backward layer, so the order can run a layer's in parts
        self._layer_wgrad = (
            [WeightGradQueue(backward.wgrad.track) for _ in b_layers]
            if defer and backward is not None and backward.wgrad is not None
            else None
        )
        self._forward: list[LayerRecord] = []
        self._events: dict[IssueName, Event] = {}  # the events recorded, by issue
        self._trace_slots: dict[int, int] = {}
        self._finished = False

    # ---- public --------------------------------------------------------------------------
    def plan_of(self, layer: Any) -> list[Any]:
        """The node plan ``run_layer`` records for ``layer`` (``plan.node_plan_of``)."""
        if isinstance(layer, Plan) and (self.a2a_waves == 1 or not isinstance(layer, WavePlan)):
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
        streams.compute.wait_event(_event_now(streams.comm))
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
        positions = (
            range(len(issues)) if streams.compute.runs_on_host else queuing_positions(issues)
        )
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
                    assert self.backward is not None  # a backward issue: a step with a backward
                    tape = self.backward.tape
                    layer = tape.layers[issue.layer]
                record = layer.nodes[issue.node]
                if comm:
                    if issue.reads_caller:  # what the caller made on the compute stream
                        stream.wait_event(_event_now(streams.compute))
                    if record.node.group is not None:
                        streams.claim(record.node.group, stream)
                if stream.keeps_memory and (issue.needs or issue.reads_caller):  # CUDA
                    self._keep_crossing(stream, layer, record, forward)
                record.stream = stream
                run = tape.forward_node if forward else self._backward_node
                args = (layer, issue.node)
                if self.trace is not None:
                    run = self._traced(run, stream, issue, record.node)
                event = stream.run(run, args, comm or issue.signals)
                if event is not None:
                    events[issue.name] = event
                if not forward and issue.layer == 0 and issue.node == 0:
                    self._backward_done()
        except BaseException:
            _quietly_wait(streams.comm.run(None))  # never abandon a tape in use
            raise

    def _event(self, name: IssueName) -> Event:
        """The event of the issue ``name`` (recorded now, on its stream, if it had none: later
        than needed, never too early)."""
        event = self._events.get(name)
        if event is None:
            comm = self.order.stream_of[name] == COMM
            event = _event_now(self.streams.comm if comm else self.streams.compute)
            self._events[name] = event
        return event

    def _keep_crossing(
        self, stream: Stream, layer: LayerRecord, record: NodeRecord, forward: bool
    ) -> None:
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
                assert self.backward is not None  # a backward node: a step with a backward
                tape = self.backward.tape
                stream.record_use(tape.incoming_grads(layer, self._given_grads(tape, layer)))
                return
            for reader in layer.nodes:
                if reader.stream is not stream:
                    for source, part in reader.sources:
                        if source == index:
                            assert grads is not None  # that reader's backward gave them
                            stream.record_use(grads[part])
            return
        for source, part in record.sources:
            if source < 0 or layer.nodes[source].stream is not stream:
                stream.record_use(source_values(layer, source, part, record))
        stream.record_use(layer.state.crossing(record.node.kind))

    def _given_grads(self, tape: Tape, layer: LayerRecord) -> Sequence[torch.Tensor | None] | None:
        """The gradients the caller gave the backward half, for the tape's last layer only
        (the others get theirs from the layer after them)."""
        assert self.backward is not None
        return self.backward.grads if layer.index == len(tape.layers) - 1 else None

    def _backward_node(self, layer: LayerRecord, index: int) -> Grads:
        """``Tape.backward_node``; the layer's last node (its first backward) begins the layer."""
        assert self.backward is not None
        tape = self.backward.tape
        if index == len(layer.nodes) - 1:
            grads = self._given_grads(tape, layer)
            wgrad = (
                self.backward.wgrad if self._layer_wgrad is None else self._layer_wgrad[layer.index]
            )
            tape.begin_layer_backward(None if grads is None else tuple(grads), wgrad)
        return tape.backward_node(layer, index)

    def _issue_wgrad(self, issue: Issue) -> None:
        assert self.backward is not None
        layers = self._layer_wgrad or []
        if issue.share == REST:
            queues = [q for q in layers + [self.backward.wgrad] if q is not None and len(q)]
        else:
            queues = [layers[issue.layer]] if len(layers[issue.layer]) else []
        if not queues:
            return
        count = issue.count if issue.share == FILL else None

        def run() -> None:
            for queue in queues:
                queue.run(ceil(len(queue) / 2) if issue.share == HEAD else count)

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

    def _on_compute(self, name: IssueName | None, values: Callable[[], Any]) -> Any:
        """``values()``, made by the issue ``name``, made safe for the caller's work on the
        compute stream: when that issue ran on the comm stream, the compute stream waits for it
        first (on CPU: for the comm thread; its error is raised here)."""
        if name is None or self.order.stream_of[name] != COMM:
            return values()
        compute = self.streams.compute
        try:
            compute.wait_event(self._event(name))
        except BaseException:
            _quietly_wait(self.streams.comm.run(None))
            raise
        made = values()
        compute.record_use(made)
        return made

    def _traced(
        self, run: Callable[..., Any], stream: Stream, issue: Issue, node: Node | None
    ) -> Callable[..., Any]:
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


def _event_now(stream: Stream) -> Event:
    """An event recorded on ``stream`` now: what ``run(None)`` gives."""
    event = stream.run(None)
    assert event is not None  # run(None) always records one
    return event


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
    step = CombinedStep(
        streams, backward, trace=trace, fwd_microbatch=fwd_microbatch, route_input_grads=False
    )
    values: Values = tuple(fwd_inputs)
    try:
        for plan in fwd_plans:
            values = step.run_layer(plan, values)
    except BaseException:
        _quietly_wait(streams.comm.run(None))
        raise
    grads = step.finish()
    return values, step.tape, grads
