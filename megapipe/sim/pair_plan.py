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
whatever is still queued.

**Host order.** ``StepPlanner`` emits issues as a host whose compute stream is its own thread
(CPU) issues them: per slot the comm node first (queued), then the W issues decided in the slot
before, then the compute node. ``compute_first`` is the order for a host that only queues work
(CUDA): a slot's compute node before its comm node, so a dispatch that blocks the host (reading
its split sizes) does not delay the compute launch. Both give each stream the same sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

COMPUTE = "compute"
COMM = "comm"
# the ``node`` of a W issue: which share of a backward layer's deferred weight gradients it runs
HEAD, TAIL, REST = 0, 1, 2

Side = str  # "F" forward node, "B" backward node, "W" deferred weight gradients
Shape = Sequence[Any]
"""A layer for the planner: per plan item, a node kind, or for a fork the kinds of each branch
(``megapipe.overlap.plan.LayerGraph.shape``). Nodes are numbered in that order, branch by branch."""
NodeRef = tuple[Side, int]  # (side, node index in its layer, forward order)
Step = tuple[str, tuple[int, ...]]  # (kind, nodes of one layer issued back to back)
Slot = tuple[tuple[NodeRef, ...], tuple[NodeRef, ...]]  # (comm nodes, compute nodes) side by side


@dataclass(frozen=True)
class Issue:
    """One thing the co-scheduler issues, in host order.

    ``layer``: F: the forward layer (0 = the step's first ``forward_layer`` call); B and W: the
    backward tape's layer index (W REST: -1). ``node``: F and B: the node's index in its layer's
    plan (forward order; the backward walks a layer from its last node); W: HEAD, TAIL or REST.
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

    def label(self) -> str:
        if self.side == "W":
            return f"W{self.layer}.{('head', 'tail', 'rest')[self.node]}"
        return f"{self.side}{self.layer}.{self.node}"


@dataclass(frozen=True)
class LayerShape:
    """A layer's nodes as the planner sees them: kinds, what each reads, and walk orders."""

    kinds: tuple[str, ...]
    reads: tuple[tuple[int, ...], ...]  # the nodes of the layer each node reads (forward)
    readers: tuple[tuple[int, ...], ...]  # the nodes that read each node
    forks: tuple[tuple[int, tuple[tuple[int, ...], ...]], ...]  # (item position, branch nodes)
    items: tuple[tuple[int, ...] | None, ...]  # per plan item: its node (a 1-tuple) or None (fork)

    @property
    def has_comm(self) -> bool:
        return COMM in self.kinds

    def steps(self, direction: str) -> list[Step]:
        """The walk of a layer that has a partner: node by node, a fork's branches grouped by
        position (the branches' i-th nodes back to back, branch 0 first); backward in reverse."""
        steps: list[Step] = []
        for position, item in enumerate(self.items):
            if item is not None:
                steps.append((self.kinds[item[0]], item))
                continue
            branches = dict(self.forks)[position]
            for i in range(len(branches[0])):
                group = tuple(branch[i] for branch in branches)
                steps.append((self.kinds[group[0]], group))
        return steps if direction == "F" else steps[::-1]

    def lone_slots(self, side: Side) -> list[Slot]:
        """The walk of a layer without a partner: nodes alone, a fork's branches pipelined
        (``chunk_slots``: one branch's comm node beside another's compute node)."""
        forks = dict(self.forks)
        per_item: list[list[Slot]] = []
        for position, item in enumerate(self.items):
            if item is None:
                chains = [list(b) if side == "F" else list(b)[::-1] for b in forks[position]]
                per_item.append(chunk_slots(chains, self.kinds, side))
                continue
            ref = ((side, item[0]),)
            per_item.append([(ref, ()) if self.kinds[item[0]] == COMM else ((), ref)])
        if side == "B":
            per_item.reverse()
        return [slot for slots in per_item for slot in slots]


def chunk_slots(chains: list[list[int]], kinds: Sequence[str], side: Side) -> list[Slot]:
    """Slots for parallel chains with no other microbatch beside them: in each slot the ready
    comm node and the ready compute node that come earliest in their chains (then the lowest
    branch), a node being ready once its chain predecessor ran in an earlier slot. For k chains
    of (dispatch, experts, combine) this is dispatch 0 | -, dispatch 1 | experts 0, ...,
    combine 0 | experts k-1, ..., combine k-1: the comm stream never waits for a whole chunk."""
    position = [0] * len(chains)
    slots: list[Slot] = []
    while any(p < len(chain) for p, chain in zip(position, chains)):
        chosen: dict[str, tuple[int, int]] = {}
        for c, chain in enumerate(chains):
            if position[c] < len(chain):
                kind = kinds[chain[position[c]]]
                if kind not in chosen or (position[c], c) < chosen[kind]:
                    chosen[kind] = (position[c], c)
        slot: list[tuple[NodeRef, ...]] = [(), ()]
        for kind, (_, c) in chosen.items():
            slot[0 if kind == COMM else 1] = ((side, chains[c][position[c]]),)
            position[c] += 1
        slots.append((slot[0], slot[1]))
    return slots


def layer_shape(shape: Shape) -> LayerShape:
    """Number the nodes of a shape and find what each reads (see ``Shape``)."""
    kinds: list[str] = []
    reads: list[tuple[int, ...]] = []
    forks: list[tuple[int, tuple[tuple[int, ...], ...]]] = []
    items: list[tuple[int, ...] | None] = []
    last: tuple[int, ...] = ()
    for position, item in enumerate(shape):
        if isinstance(item, str):
            if item not in (COMPUTE, COMM):
                raise ValueError(f"node kind {item!r} is not {COMPUTE!r} or {COMM!r}")
            kinds.append(item)
            reads.append(last)
            last = (len(kinds) - 1,)
            items.append(last)
            continue
        before, ends, branches = last, [], []
        for branch in item:
            nodes, previous = [], before
            for kind in branch:
                kinds.append(kind)
                reads.append(previous)
                previous = (len(kinds) - 1,)
                nodes.append(len(kinds) - 1)
            ends += previous
            branches.append(tuple(nodes))
        forks.append((position, tuple(branches)))
        items.append(None)
        last = before + tuple(ends)
    readers = tuple(tuple(m for m, r in enumerate(reads) if n in r) for n in range(len(kinds)))
    return LayerShape(tuple(kinds), tuple(reads), readers, tuple(forks), tuple(items))


def pair_slots(forward: Shape | None, backward: Shape | None) -> list[Slot]:
    """The slots of one forward layer beside one backward layer (either may be None: its
    partner's nodes then go alone, a fork's branches pipelined). See the module docstring."""
    f_shape = layer_shape(forward) if forward else None
    b_shape = layer_shape(backward) if backward else None
    if f_shape is None or b_shape is None:
        if b_shape is not None:
            return b_shape.lone_slots("B")
        return f_shape.lone_slots("F") if f_shape is not None else []
    return _pair_steps(f_shape.steps("F"), b_shape.steps("B"))


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
    """

    def __init__(self, backward_layers: Iterable[Shape] = (), defer_wgrad: bool = False):
        self.backward_layers = [layer_shape(shape) for shape in backward_layers]
        self.defer_wgrad = defer_wgrad and bool(self.backward_layers)
        self.issues: list[Issue] = []
        self._next_backward = len(self.backward_layers) - 1
        self._forward_layers: list[LayerShape] = []
        self.positions: dict[tuple[Side, int, int], int] = {}  # (side, layer, node) -> issue
        self._layer_end: dict[Side, int | None] = {"F": None, "B": None}  # last node's issue
        self._slot = 0
        self._pending_w: list[tuple[int, int, int]] = []  # (layer, HEAD/TAIL, slot) to emit
        self._held_tails: list[int] = []  # layers whose tail waits for a backward comm slot
        self._finished = False

    def forward_layer(self, shape: Shape) -> list[Issue]:
        """Issues for the next forward layer, of this shape."""
        if self._finished:
            raise RuntimeError("StepPlanner.forward_layer after finish()")
        forward = layer_shape(shape)
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
        if forward is not None and b_shape is not None:
            slots = _pair_steps(forward.steps("F"), b_shape.steps("B"))
        elif b_shape is not None:
            slots = b_shape.lone_slots("B")
        else:
            assert forward is not None
            slots = forward.lone_slots("F")
        b_comm = [n for n, (comm, _) in enumerate(slots) if any(s == "B" for s, _ in comm)]
        for n, (comm, compute) in enumerate(slots):
            self._slot += 1
            for ref in comm:
                self._emit_node(COMM, ref, f_layer, backward)
            self._emit_pending_w()
            for ref in compute:
                self._emit_node(COMPUTE, ref, f_layer, backward)
            if self.defer_wgrad and n in b_comm:
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
        self.positions[(side, layer, node)] = len(self.issues)
        self.issues.append(Issue(stream, side, layer, node, self._slot, needs))


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
