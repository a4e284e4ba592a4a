"""The issue order of a combined step, node by node: one pure rule for the engine and the simulator.

A combined step runs the forward of one microbatch beside the backward of another. The
co-scheduler (``megapipe.overlap.coscheduler``) issues their nodes in the order this module
plans, and a simulator that wants to predict a combined step models the same order by importing
it. Pure Python (no torch), so ``megapipe.sim`` can use it.

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
whatever is still queued.

**Host order.** ``StepPlanner`` emits the issues in the order a host issues them when the compute
stream is the host thread itself (CPU): per slot the comm node first (queued), then the W issues
decided in the slot before, then the compute node; so a queued comm node is never held back by
weight gradients. ``compute_first`` gives the order for a host that only queues work (CUDA): the
compute node of a slot before its comm node, so that a comm node that blocks the host (a dispatch
reading its split sizes) does not delay the compute launch. Both orders give every stream the
same sequence and the same waits.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil
from typing import Callable, Iterable, Sequence

COMPUTE = "compute"
COMM = "comm"
# the ``node`` of a W issue: which share of a backward layer's deferred weight gradients it runs
HEAD, TAIL, REST = 0, 1, 2

Side = str  # "F" forward node, "B" backward node, "W" deferred weight gradients
NodeRef = tuple[Side, int]  # (side, node index in its layer's plan, forward order)
Slot = tuple[NodeRef | None, NodeRef | None]  # (comm node, compute node) issued side by side


@dataclass(frozen=True)
class Issue:
    """One thing the co-scheduler issues, in host order.

    ``layer``: F: the forward layer (0 = the step's first ``forward_layer`` call); B and W: the
    backward tape's layer index (W REST: -1). ``node``: F and B: the node's index in its layer's
    plan (forward order; the backward walks a layer from its last node); W: HEAD, TAIL or REST.
    ``slot``: issues with the same slot run side by side (one comm node and the compute beside
    it). ``needs``: positions, in the step's list of issues, of issues on the other stream whose
    completion this one waits for (an event); same-stream order is implied by the list.
    """

    stream: str
    side: Side
    layer: int
    node: int
    slot: int
    needs: tuple[int, ...] = ()

    def label(self) -> str:
        if self.side == "W":
            return f"W{self.layer}.{('head', 'tail', 'rest')[self.node]}"
        return f"{self.side}{self.layer}.{self.node}"


def has_comm(kinds: Sequence[str]) -> bool:
    return any(kind == COMM for kind in kinds)


def pair_slots(forward: Sequence[str] | None, backward: Sequence[str] | None) -> list[Slot]:
    """The slots of one forward layer beside one backward layer (either may be None).

    ``forward`` and ``backward`` are the node kinds of each layer's plan in forward order; the
    backward walks its layer from the last node. See the module docstring for the rule.
    """
    forward, backward = tuple(forward or ()), tuple(backward or ())
    for kind in forward + backward:
        if kind not in (COMPUTE, COMM):
            raise ValueError(f"node kind {kind!r} is not {COMPUTE!r} or {COMM!r}")
    slots: list[Slot] = []
    i, j = 0, len(backward) - 1
    while i < len(forward) or j >= 0:
        f = forward[i] if i < len(forward) else None
        b = backward[j] if j >= 0 else None
        if f is not None and b is not None and f != b:
            if f == COMM:
                slots.append((("F", i), ("B", j)))
            else:
                slots.append((("B", j), ("F", i)))
            i, j = i + 1, j - 1
        elif b is not None:
            slots.append((("B", j), None) if b == COMM else (None, ("B", j)))
            j -= 1
        else:
            slots.append((("F", i), None) if f == COMM else (None, ("F", i)))
            i += 1
    return slots


class StepPlanner:
    """Plans one combined step incrementally, as the co-scheduler learns its forward layers.

    ``backward_layers``: the node kinds of every layer of the backward tape, in forward order
    (empty: a forward alone). ``forward_layer(kinds)`` returns the issues that come with the next
    forward layer (lone backward layers first, then the pair); ``finish()`` the issues of the
    backward layers left and of the weight gradients still held. ``issues`` holds them all.
    """

    def __init__(self, backward_layers: Iterable[Sequence[str]] = (), defer_wgrad: bool = False):
        self.backward_layers = [tuple(kinds) for kinds in backward_layers]
        self.defer_wgrad = defer_wgrad and bool(self.backward_layers)
        self.issues: list[Issue] = []
        self._next_backward = len(self.backward_layers) - 1
        self._forward_layers = 0
        self._last: dict[Side, int | None] = {"F": None, "B": None}
        self._slot = 0
        self._pending_w: list[tuple[int, int, int]] = []  # (layer, HEAD/TAIL, slot) to emit
        self._held_tails: list[int] = []  # layers whose tail waits for a backward comm slot
        self._finished = False

    def forward_layer(self, kinds: Sequence[str]) -> list[Issue]:
        """Issues for the next forward layer, whose nodes have these kinds."""
        if self._finished:
            raise RuntimeError("StepPlanner.forward_layer after finish()")
        start = len(self.issues)
        while self._next_backward >= 0 and not has_comm(self.backward_layers[self._next_backward]):
            self._pair(None, self._take_backward())
        partner = self._take_backward() if has_comm(kinds) and self._next_backward >= 0 else None
        self._pair(tuple(kinds), partner)
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
            self._emit(Issue(COMPUTE, "W", -1, REST, self._slot))
        else:
            self._emit_pending_w()
        return self.issues[start:]

    # ---- internals -----------------------------------------------------------------------
    def _take_backward(self) -> int:
        layer = self._next_backward
        self._next_backward -= 1
        return layer

    def _pair(self, forward: tuple[str, ...] | None, backward: int | None) -> None:
        f_layer = self._forward_layers
        if forward is not None:
            self._forward_layers += 1
        b_kinds = self.backward_layers[backward] if backward is not None else ()
        last_b_comm = min((i for i, k in enumerate(b_kinds) if k == COMM), default=None)
        for comm, compute in pair_slots(forward, b_kinds):
            self._slot += 1
            if comm is not None:
                self._emit_node(COMM, comm, f_layer, backward)
            self._emit_pending_w()
            if compute is not None:
                self._emit_node(COMPUTE, compute, f_layer, backward)
            if self.defer_wgrad and comm is not None and comm[0] == "B":
                self._decide_w(backward, comm[1] == last_b_comm)

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
            self._emit(Issue(COMPUTE, "W", layer, part, slot))
        self._pending_w = []

    def _emit_node(
        self, stream: str, ref: NodeRef, f_layer: int, b_layer: int | None
    ) -> None:
        side, node = ref
        layer = f_layer if side == "F" else b_layer
        assert layer is not None
        previous = self._last[side]
        needs = ()
        if previous is not None and self.issues[previous].stream != stream:
            needs = (previous,)
        self._last[side] = len(self.issues)
        self._emit(Issue(stream, side, layer, node, self._slot, needs))

    def _emit(self, issue: Issue) -> None:
        self.issues.append(issue)


def step_plan(
    forward_layers: Sequence[Sequence[str]],
    backward_layers: Sequence[Sequence[str]] = (),
    defer_wgrad: bool = False,
) -> tuple[Issue, ...]:
    """Every issue of a combined step, in host (CPU) order: the forward of ``forward_layers``
    beside the backward of a tape of ``backward_layers`` (node kinds per layer, forward order)."""
    planner = StepPlanner(backward_layers, defer_wgrad)
    for kinds in forward_layers:
        planner.forward_layer(kinds)
    planner.finish()
    return tuple(planner.issues)


def compute_first(issues: Sequence[Issue]) -> list[Issue]:
    """The same issues in the order of a host that only queues work (CUDA): each slot's compute
    node before the slot's comm node. Each stream sees the same sequence as in ``issues``."""
    out: list[Issue] = []
    held: Issue | None = None
    for issue in issues:
        if issue.stream == COMM:
            if held is not None:
                out.append(held)
            held = issue
            continue
        if held is not None and issue.side != "W" and issue.slot != held.slot:
            out.append(held)  # a comm node alone in its slot: nothing to put before it
            held = None
        out.append(issue)
        if held is not None and issue.side != "W":
            out.append(held)
            held = None
    if held is not None:
        out.append(held)
    return out


def time_issues(
    issues: Sequence[Issue], duration: Callable[[Issue], float], host_runs_compute: bool = False
) -> list[tuple[float, float]]:
    """(start, end) of every issue when each takes ``duration(issue)``.

    ``issues`` as planned (``needs`` index into it). Each stream runs its issues in list order,
    each issue after its ``needs``: a device whose host only queues work (CUDA). With
    ``host_runs_compute`` (CPU: the compute stream is the host thread, which also queues the comm
    issues in the planned host order) a comm issue also starts no earlier than the host reaches
    it, i.e. the end of the compute issues before it in the list.
    """
    free = {COMPUTE: 0.0, COMM: 0.0}
    host = 0.0
    spans: list[tuple[float, float]] = []
    for issue in issues:
        start = max([free[issue.stream]] + [spans[n][1] for n in issue.needs])
        if host_runs_compute and issue.stream == COMM:
            start = max(start, host)
        end = start + duration(issue)
        free[issue.stream] = end
        if host_runs_compute and issue.stream == COMPUTE:
            host = end
        spans.append((start, end))
    return spans
