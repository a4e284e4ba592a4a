"""The issue order of a combined step, node by node: one pure rule for the engine and the simulator.

A combined step runs the forward of one microbatch beside the backward of another. The
co-scheduler (``megapipe.overlap.coscheduler``) issues their nodes in the order planned here, and
the simulator (``megapipe.sim.node_steps``) times the same order. Pure Python, no torch.

**Which layers pair.** Forward layer k goes beside the next backward layer (the backward walks its
tape last layer first), counting only layers with a comm node: before each forward layer, the
next backward layers without a comm node run alone; a forward layer without a comm node, or with
no backward layer left, runs alone; the backward layers left when the forward has run out of
layers run alone at the end (``StepPlanner.finish``).

**Slots** (``pair_slots``): inside a pair, the next node of each side is looked at: one comm and
one compute node of different sides go side by side (one *slot*); otherwise (both compute, both
comm, or one side done) the backward's node goes alone (the forward's once the backward is done).
For two MoE layers (attention, dispatch, experts, combine, finish) this gives Megatron's pairs:

| slot | comm stream | compute stream                     |
|------|-------------|------------------------------------|
| 1    |             | B finish                           |
| 2    | B combine   | F attention (+ the held W tail)    |
| 3    | F dispatch  | B experts                          |
| 4    | B dispatch  | F experts, W head                  |
| 5    | F combine   | B attention                        |
| 6    |             | F finish                           |

**Dataflow, no joins.** A slot only says what runs beside what; nothing waits for a slot to end.
Each node waits for its own input, the previous node of its side (``Issue.needs`` names it when it
ran on the other stream: an event wait), and for the work issued before it on its own stream. The
comm stream's order is a function of the two layers' node kinds only, so every rank of an
expert-parallel group issues its collectives in the same order.

**Deferred weight gradients** (``defer_wgrad``: Megatron's ``delay_wgrad_compute``) fill the
compute stream's gaps: the W items backward layer b queued (its experts' weight-gradient GEMMs)
are split in two. The *head*, the first ceil(n/2) items, runs after the compute node beside b's
last backward comm node (the B dispatch: slot 4); the *tail*, the rest, is held until the next
slot with a backward comm node (the next layer's B combine, slot 2, where the forward's attention
is usually shorter than the combine), or to the end of the step. ``REST`` at the end runs
whatever is still queued. That is the *count rule*, for nodes without times. When every
backward node carries its expected times (``wgrad_fill.NodeTimes``) the *time rule* replaces it:
the planner times the issues it plans and, before each compute node that would wait for the comm
stream, runs queued items in the gap (``FILL`` issues of ``count`` items; ``wgrad_fill``).

**Host order.** ``StepPlanner`` emits issues as a host whose compute stream is its own thread
(CPU) issues them: per slot the comm node first (queued), then the W issues decided in the slot
before (time rule: those that fill the gap before the compute node), then the compute node. ``compute_first`` is the order for a host that only queues work
(CUDA): a slot's compute node before its comm node, so a dispatch that blocks the host (reading
its split sizes) does not delay the compute launch. Both give each stream the same sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Sequence

from .layer_shape import LayerShape, NodeRef, Shape, Side, Slot, Step, layer_shape
from .wgrad_fill import COMM, COMPUTE, LayerTimes, NodeTimes, WgradClock

# the ``node`` of a W issue: which share of a backward layer's deferred weight gradients it runs
# (FILL: ``count`` items, placed by time: ``wgrad_fill``)
HEAD, TAIL, REST, FILL = 0, 1, 2, 3


@dataclass(frozen=True)
class Issue:
    """One thing the co-scheduler issues, in host order.

    ``layer``: F: the forward layer (0 = the step's first ``forward_layer`` call); B and W: the
    backward tape's layer index (W REST: -1). ``node``: F and B: the node's index in its layer's
    plan (forward order; the backward walks a layer from its last node); W: HEAD, TAIL, REST or
    FILL (``count``: how many of the layer's queued items it runs).
    ``slot``: issues with the same slot run side by side (comm nodes and the compute beside
    them). ``needs``: positions, in the step's list of issues, of issues on the other stream whose
    completion this one waits for (an event); same-stream order is implied by the list.
    """

    stream: str
    side: Side
    layer: int
    node: int
    slot: int
    needs: tuple[int, ...] = ()
    count: int = 0

    def label(self) -> str:
        if self.side == "W":
            part = ("head", "tail", "rest", f"fill{self.count}")[self.node]
            return f"W{self.layer}.{part}"
        return f"{self.side}{self.layer}.{self.node}"



def pair_slots(forward: Shape | None, backward: Shape | None) -> list[Slot]:
    """The slots of one forward layer beside one backward layer (either may be None: its
    partner's nodes then go alone, a fork's branches pipelined). See the module docstring."""
    f_shape = layer_shape(forward) if forward else None
    b_shape = layer_shape(backward) if backward else None
    return list(_shape_slots(f_shape, b_shape))


@lru_cache(maxsize=256)
def _shape_slots(forward: LayerShape | None, backward: LayerShape | None) -> tuple[Slot, ...]:
    """``pair_slots`` of two numbered layers (cached: every step pairs the same few shapes)."""
    if forward is None or backward is None:
        if backward is not None:
            return tuple(backward.lone_slots("B"))
        return tuple(forward.lone_slots("F")) if forward is not None else ()
    return tuple(_pair_steps(forward.steps("F"), backward.steps("B")))


def _pair_steps(forward: list[Step], backward: list[Step]) -> list[Slot]:
    slots: list[Slot] = []
    i = j = 0
    while i < len(forward) or j < len(backward):
        f = forward[i] if i < len(forward) else None
        b = backward[j] if j < len(backward) else None
        if f is not None and b is not None and f[0] != b[0]:
            f_refs = tuple(("F", n) for n in f[1])
            b_refs = tuple(("B", n) for n in b[1])
            slots.append((f_refs, b_refs) if f[0] == COMM else (b_refs, f_refs))
            i, j = i + 1, j + 1
        elif b is not None:
            refs = tuple(("B", n) for n in b[1])
            slots.append((refs, ()) if b[0] == COMM else ((), refs))
            j += 1
        else:
            assert f is not None
            refs = tuple(("F", n) for n in f[1])
            slots.append((refs, ()) if f[0] == COMM else ((), refs))
            i += 1
    return slots


class StepPlanner:
    """Plans one combined step incrementally, as the co-scheduler learns its forward layers.

    ``backward_layers``: the shapes (``Shape``) of every layer of the backward tape, in forward
    order (empty: a forward alone). ``forward_layer(shape)`` returns the issues that come with the
    next forward layer (lone backward layers first, then the pair); ``finish()`` the issues of the
    backward layers left and of the weight gradients still held. ``issues`` holds them all.

    ``backward_times`` (a ``LayerTimes`` per backward layer) switches the deferred weight
    gradients from the count rule to the time rule (``wgrad_fill``); ``forward_layer`` then
    takes each forward layer's times too (None: its nodes count as taking no time);
    ``host_runs_compute``: time the issues as a CPU host runs them (``wgrad_fill.time_issues``).
    """

    def __init__(self, backward_layers: Iterable[Shape] = (), defer_wgrad: bool = False,
                 backward_times: Sequence[LayerTimes] | None = None,
                 host_runs_compute: bool = False):
        self.backward_layers = [layer_shape(shape) for shape in backward_layers]
        self.defer_wgrad = defer_wgrad and bool(self.backward_layers)
        self.clock: WgradClock | None = None
        if self.defer_wgrad and backward_times is not None:
            _check_times(backward_times, self.backward_layers, "backward_times")
            self.clock = WgradClock(backward_times, host_runs_compute)
        self.issues: list[Issue] = []
        self._next_backward = len(self.backward_layers) - 1
        self._forward_layers: list[LayerShape] = []
        self.positions: dict[tuple[Side, int, int], int] = {}  # (side, layer, node) -> issue
        self._layer_end: dict[Side, int | None] = {"F": None, "B": None}  # last node's issue
        self._slot = 0
        self._pending_w: list[tuple[int, int, int]] = []  # (layer, HEAD/TAIL, slot) to emit
        self._held_tails: list[int] = []  # layers whose tail waits for a backward comm slot
        self._finished = False

    def forward_layer(self, shape: Shape, times: LayerTimes | None = None) -> list[Issue]:
        """Issues for the next forward layer, of this shape (and node times: the time rule)."""
        if self._finished:
            raise RuntimeError("StepPlanner.forward_layer after finish()")
        forward = layer_shape(shape)
        if self.clock is not None:
            if times is not None:
                _check_times([times], [forward], "forward layer times")
            self.clock.forward.append(
                tuple(times) if times is not None else (NodeTimes(0.0, 0.0),) * len(forward.kinds))
        start = len(self.issues)
        while self._next_backward >= 0 and not self.backward_layers[self._next_backward].has_comm:
            self._pair(None, self._take_backward())
        partner = self._take_backward() if forward.has_comm and self._next_backward >= 0 else None
        self._pair(forward, partner)
        return self.issues[start:]

    def finish(self) -> list[Issue]:
        """Issues for the backward layers left and the deferred weight gradients still held."""
        if self._finished:
            raise RuntimeError("StepPlanner.finish() called twice")
        self._finished = True
        start = len(self.issues)
        while self._next_backward >= 0:
            self._pair(None, self._take_backward())
        if self.defer_wgrad:
            self._slot += 1
            self._pending_w += [(layer, TAIL, self._slot) for layer in self._held_tails]
            self._held_tails = []
            self._emit_pending_w()
            self.issues.append(Issue(COMPUTE, "W", -1, REST, self._slot))
        else:
            self._emit_pending_w()
        return self.issues[start:]

    # ---- internals -----------------------------------------------------------------------
    def _take_backward(self) -> int:
        layer = self._next_backward
        self._next_backward -= 1
        return layer

    def _pair(self, forward: LayerShape | None, backward: int | None) -> None:
        f_layer = len(self._forward_layers)
        if forward is not None:
            self._forward_layers.append(forward)
        b_shape = self.backward_layers[backward] if backward is not None else None
        slots = _shape_slots(forward, b_shape)
        b_comm = [n for n, (comm, _) in enumerate(slots) if any(s == "B" for s, _ in comm)]
        for n, (comm, compute) in enumerate(slots):
            self._slot += 1
            for ref in comm:
                self._emit_node(COMM, ref, f_layer, backward)
            self._emit_pending_w()
            for ref in compute:
                self._emit_node(COMPUTE, ref, f_layer, backward)
            if self.defer_wgrad and self.clock is None and n in b_comm:
                self._decide_w(backward, n == b_comm[-1])
        if forward is not None:
            self._layer_end["F"] = self.positions[("F", f_layer, len(forward.kinds) - 1)]
        if backward is not None:
            self._layer_end["B"] = self.positions[("B", backward, 0)]

    def _decide_w(self, layer: int | None, last_comm: bool) -> None:
        """In a slot with a backward comm node: the held tails run now; after the layer's last
        backward comm node, its head runs and its tail is held."""
        assert layer is not None
        self._pending_w += [(held, TAIL, self._slot) for held in self._held_tails]
        self._held_tails = []
        if last_comm:
            self._pending_w.append((layer, HEAD, self._slot))
            self._held_tails.append(layer)

    def _emit_pending_w(self) -> None:
        for layer, part, slot in self._pending_w:
            self.issues.append(Issue(COMPUTE, "W", layer, part, slot))
        self._pending_w = []

    def _emit_node(self, stream: str, ref: NodeRef, f_layer: int, b_layer: int | None) -> None:
        """Issue one node; it needs the nodes it reads (a backward node: the nodes that read
        it), or the side's previous layer for the first node the side runs in this layer."""
        side, node = ref
        layer = f_layer if side == "F" else b_layer
        assert layer is not None
        if side == "F":
            inputs = self._forward_layers[f_layer].reads[node]
        else:
            inputs = self.backward_layers[layer].readers[node]
        if inputs:
            made = [self.positions[(side, layer, n)] for n in inputs]
        else:
            made = [] if self._layer_end[side] is None else [self._layer_end[side]]
        needs = tuple(sorted(p for p in made if self.issues[p].stream != stream))
        if self.clock is not None:
            self._fill_w(stream, needs)
        self.positions[(side, layer, node)] = len(self.issues)
        self.issues.append(Issue(stream, side, layer, node, self._slot, needs))
        if self.clock is not None:
            self.clock.add(stream, needs, self.clock.node_time(side, layer, node))
            if side == "B" and stream == COMPUTE:
                self.clock.queue(layer, node)

    def _fill_w(self, stream: str, needs: tuple[int, ...]) -> None:
        """The time rule: W items in the gap before a compute node that waits for ``needs``."""
        assert self.clock is not None
        if stream != COMPUTE:
            return
        for layer, count, duration in self.clock.fill(stream, needs):
            self.issues.append(Issue(COMPUTE, "W", layer, FILL, self._slot, count=count))
            self.clock.add(COMPUTE, (), duration)


def _check_times(times: Sequence[LayerTimes], layers: Sequence[LayerShape], what: str) -> None:
    if len(times) != len(layers) or any(
            len(t) != len(layer.kinds) for t, layer in zip(times, layers)):
        raise ValueError(
            f"{what}: {[len(t) for t in times]} node times per layer, but the layers have "
            f"{[len(layer.kinds) for layer in layers]} nodes")


def step_plan(
    forward_layers: Sequence[Shape],
    backward_layers: Sequence[Shape] = (),
    defer_wgrad: bool = False,
) -> tuple[Issue, ...]:
    """Every issue of a combined step, in host (CPU) order: the forward of ``forward_layers``
    beside the backward of a tape of ``backward_layers`` (a ``Shape`` per layer, forward order)."""
    planner = StepPlanner(backward_layers, defer_wgrad)
    for kinds in forward_layers:
        planner.forward_layer(kinds)
    planner.finish()
    return tuple(planner.issues)


def compute_first(issues: Sequence[Issue]) -> list[Issue]:
    """The same issues in the order of a host that only queues work (CUDA): each slot's compute
    nodes before the slot's comm nodes. Each stream sees the same sequence as in ``issues``."""
    out: list[Issue] = []
    held: list[Issue] = []  # comm issues of the current slot
    for issue in issues:
        if held and issue.slot > held[0].slot:
            out += held
            held = []
        if issue.stream == COMM:
            held.append(issue)
        else:
            out.append(issue)
    return out + held
