"""The co-scheduler: one microbatch's forward beside another's backward, node by node.

Forward layer k of microbatch i runs beside backward layer Nb-1-k of microbatch j (the
backward walks its tape last layer first), counting only layers with a comm node: a layer
without one (dense, embedding, head) runs alone where it stands (a forward one at its turn, a
backward one as soon as it is next), so the MoE layers of the two chunks pair up even when a
chunk starts with an embedding or a dense layer. Inside a pair of layers the nodes are issued in
*slots*: a comm node of one microbatch on the communication stream beside a compute node of the
other on the compute stream. The rule, applied to the next node of each side:

- one side's next node is comm and the other's is compute: run them together;
- otherwise (both compute, both comm, or one side finished): run the backward's node alone
  (or the forward's, once the backward side is done).

For two MoE layers (attention -> dispatch -> experts -> combine -> finish) this yields exactly
Megatron's combined-1F1B order:

| slot | communication stream | compute stream                              |
|------|----------------------|---------------------------------------------|
| 1    |                      | B finish                                    |
| 2    | B combine            | F attention                                 |
| 3    | F dispatch           | B experts                                   |
| 4    | B dispatch           | F experts, then deferred weight gradients   |
| 5    | F combine            | B attention                                 |
| 6    |                      | F finish                                    |

A dense layer (one compute node) pairs with nothing, so dense layers run without overlap, and
so do leftover layers when the two chunks differ in their number of MoE layers. Whenever a backward comm node is in
flight, the queued deferred weight gradients (``delay_wgrad_compute``) run on the compute stream
beside it; whatever is left runs in ``finish``.

Each slot ends with a join (the compute stream waits for the comm node's event, the comm stream
for the compute stream's), because the next slot's nodes consume what this slot produced. Inside
a slot the comm node waits only for the compute issued before the slot. Issue order: comm node
first where the compute stream is the host thread itself (CPU), compute node first where the
host only queues kernels (CUDA), so a host-blocking comm node never delays the compute launch. The
two sides of a slot belong to different microbatches, so they share no data; the operations are
exactly those of the sequential path (forward via the tape, backward via the tape), so results
are bitwise equal.

On CUDA, autograd runs each backward op on the stream its forward op ran on, so a comm node's
backward overlaps only when its forward also ran on the comm stream (every forward recorded by
this co-scheduler). A comm node should not block the host (no ``.item()``/``.tolist()`` on GPU
tensors): on CUDA the host issues both streams' work, and a host wait stalls both.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from megapipe.overlap.plan import Node, NodeKind
from megapipe.overlap.streams import Event, Stream, Streams
from megapipe.overlap.tape import Grads, LayerRecord, Tape, Values
from megapipe.overlap.node_trace import NodeTrace
from megapipe.overlap.wgrad import WeightGradQueue


class WarnOnce:
    """Warns once per type: the record of which types were warned about lives in this object."""

    def __init__(self) -> None:
        self.types: set[type] = set()

    def __call__(self, kind: type, message: str, stacklevel: int = 3) -> None:
        if kind not in self.types:
            self.types.add(kind)
            warnings.warn(message, stacklevel=stacklevel + 1)


class _Walk:
    """One microbatch's progress through one layer, forward (F) or backward (B)."""

    def __init__(
        self, tape: Tape, layer: LayerRecord, direction: str, microbatch: int | None
    ) -> None:
        self.tape = tape
        self.layer = layer
        self.direction = direction
        self.microbatch = microbatch

    @property
    def node(self) -> Node | None:
        """The node whose step runs next (None: this side of the layer is done)."""
        layer = self.layer
        if self.direction == "F":
            return None if layer.recorded else layer.nodes[layer.next_forward].node
        return None if layer.next_backward < 0 else layer.nodes[layer.next_backward].node

    def pending_inputs(self) -> Any:
        """What the next step reads that an earlier step produced."""
        layer = self.layer
        if self.direction == "F":
            return layer.nodes[layer.next_forward].inputs
        return layer.nodes[layer.next_backward].pending_grads

    def step(self) -> Any:
        """Run the next node's forward (returns its outputs) or backward (its input grads)."""
        if self.direction == "F":
            return self.tape.forward_step(self.layer).outputs
        return self.tape.backward_step(self.layer)


def _whole_layer_fn(layer: Callable[..., Any]) -> Callable[[Any, tuple], tuple]:
    def run(state: Any, tensors: tuple) -> tuple:
        out = layer(*tensors)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    return run


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
    partner, the deferred weight gradients, waits for both streams and returns the gradients of
    the backward tape's inputs. The forward is recorded on ``self.tape`` for its own backward.
    ``route_input_grads``: whether the forward tape's input gradients also flow on into its
    inputs (a model forward may transform its input before the first layer).
    """

    def __init__(
        self,
        streams: Streams,
        backward: TapeBackward | None = None,
        *,
        trace: NodeTrace | None = None,
        fwd_microbatch: int | None = None,
        route_input_grads: bool = True,
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
        self._bwd_started = False
        self._finished = False
        self._last_bwd_layer = -1
        self._slot_id = 0  # counts issue slots (recorded in the trace)

    # ---- public --------------------------------------------------------------------------
    def plan_of(self, layer: Any) -> list[Node]:
        """The node plan of ``layer``: a list of Nodes as is, ``layer.node_plan()``, or, for a
        layer that does not follow the node protocol, the whole layer as one compute node
        (it then runs F and B one after the other; warned once per layer type)."""
        if isinstance(layer, (list, tuple)) and layer and all(isinstance(n, Node) for n in layer):
            return list(layer)
        node_plan = getattr(layer, "node_plan", None)
        if callable(node_plan):
            plan = node_plan()
            if isinstance(plan, (list, tuple)) and plan and all(isinstance(n, Node) for n in plan):
                return list(plan)
        if not callable(layer):
            raise TypeError(
                f"run_layer needs a list of Node, a layer with node_plan(), or a callable layer; "
                f"got {type(layer).__name__}"
            )
        kind = type(layer)
        self.warn_once(
            kind,
            f"{kind.__name__} does not follow the node protocol (no node_plan() returning a "
            "list of Node); its forward and backward run one after the other, without overlap",
        )
        return [Node(kind.__name__, NodeKind.COMPUTE, _whole_layer_fn(layer))]

    def run_layer(self, layer: Any, inputs: Sequence[Any]) -> Values:
        """Record one forward layer, co-scheduled with the next pending backward layer."""
        if self._finished:
            raise RuntimeError("CoScheduler.run_layer after finish()")
        plan = self.plan_of(layer)
        self._run_plain_backward_layers()
        f_layer = self.tape.begin_layer(plan, tuple(inputs))
        forward = _Walk(self.tape, f_layer, "F", self.fwd_microbatch)
        self._interleave(forward, self._next_backward() if _has_comm(plan) else None)
        assert f_layer.outputs is not None
        return f_layer.outputs

    def finish(self) -> Grads | None:
        """Run the leftover backward layers and the deferred weight gradients; wait for both
        streams. Returns the gradients of the backward tape's inputs (None without one)."""
        if self._finished:
            raise RuntimeError("CoScheduler.finish() called twice")
        self._finished = True
        try:
            while (backward := self._next_backward()) is not None:
                self._interleave(None, backward)
            if self.run_wgrad and self.wgrad is not None and len(self.wgrad):
                self._next_slot()
                self.streams.compute.submit(self._flush_wgrad, self._last_bwd_layer)
        finally:
            self.streams.synchronize()
        if self.backward is None:
            return None
        return self.backward.tape.input_grads

    # ---- scheduling ----------------------------------------------------------------------
    def _next_slot(self) -> None:
        """A new issue slot: numbered by the trace when there is one (unique across runners
        sharing it), else locally."""
        self._slot_id = self.trace.new_slot() if self.trace is not None else self._slot_id + 1

    def _next_backward(self) -> _Walk | None:
        if self.backward is None or self.backward.tape.remaining_backward_layers() == 0:
            return None
        tape = self.backward.tape
        grads = None
        if not self._bwd_started and self.backward.grads is not None:
            grads = tuple(self.backward.grads)
        self._bwd_started = True
        layer = tape.begin_layer_backward(grads, wgrad=self.wgrad)
        self._last_bwd_layer = layer.index
        return _Walk(tape, layer, "B", self.bwd_microbatch)

    def _run_plain_backward_layers(self) -> None:
        """Run the next backward layers that have no comm node alone, so that the next
        backward layer (if any) is one that can hide the forward's all-to-alls."""
        while self.backward is not None:
            layer = self.backward.tape.peek_backward_layer()
            if layer is None or _has_comm([r.node for r in layer.nodes]):
                return
            backward = self._next_backward()
            assert backward is not None
            self._interleave(None, backward)

    def _interleave(self, forward: _Walk | None, backward: _Walk | None) -> None:
        while True:
            f = forward.node if forward is not None else None
            b = backward.node if backward is not None else None
            if f is None and b is None:
                return
            if f is not None and b is not None and f.kind != b.kind:
                if f.kind == NodeKind.COMM:
                    self._slot(forward, backward)
                else:
                    self._slot(backward, forward)
            elif b is not None:
                self._alone(backward)
            else:
                self._alone(forward)

    def _alone(self, walk: _Walk) -> None:
        node = walk.node
        assert node is not None
        if node.kind == NodeKind.COMM:
            self._slot(walk, None)
        else:
            self._next_slot()
            self.streams.compute.submit(self._traced(walk, self.streams.compute))

    def _slot(self, comm: _Walk, compute: _Walk | None) -> None:
        """``comm``'s next node on the comm stream beside ``compute``'s next node, then join."""
        streams = self.streams
        node = comm.node
        assert node is not None
        self._next_slot()
        streams.claim(node.group, streams.comm)
        inputs_ready = streams.compute.record_event()  # the comm node's inputs are made by now
        # Issue order. On CPU the compute stream is the host thread, so the comm node is queued
        # first (else it would start only after the compute node). On CUDA the host only queues
        # kernels: the compute node goes first, so that a comm node that waits on the host (a
        # dispatch reading its split sizes) does not hold back the compute node's launch.
        compute_first = compute is not None and not streams.compute.runs_on_host
        if compute_first:
            streams.compute.submit(self._traced(compute, streams.compute))
        streams.comm.wait_event(inputs_ready)
        streams.comm.hold(comm.pending_inputs())
        event = streams.comm.submit(self._traced(comm, streams.comm))
        try:
            if compute is not None and not compute_first:
                streams.compute.submit(self._traced(compute, streams.compute))
            if (
                comm.direction == "B"
                and self.run_wgrad
                and self.wgrad is not None
                and len(self.wgrad)
            ):
                streams.compute.submit(self._flush_wgrad, comm.layer.index)
        except BaseException:
            _quietly_wait(event)  # never leave the comm thread working on a tape we abandon
            raise
        streams.compute.wait_event(event)
        streams.compute.hold(event.value_on(streams.compute))

    def _traced(self, walk: _Walk, stream: Stream) -> Callable[[], Any]:
        node = walk.node
        assert node is not None
        trace, layer_index, slot = self.trace, walk.layer.index, self._slot_id
        if trace is None:
            return walk.step

        def run() -> Any:
            kind = node.kind.value
            with trace.span(
                walk.microbatch, layer_index, node.name, walk.direction, stream.name, kind, slot
            ):
                return walk.step()

        return run

    def _flush_wgrad(self, layer_index: int) -> None:
        assert self.wgrad is not None
        if self.trace is None:
            self.wgrad.run()
            return
        stream = self.streams.compute.name
        with self.trace.span(
            self.bwd_microbatch, layer_index, "wgrad", "W", stream, "compute", self._slot_id
        ):
            self.wgrad.run()


def _has_comm(plan: Sequence[Node]) -> bool:
    return any(node.kind == NodeKind.COMM for node in plan)


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
