"""The pair order: which node of which microbatch runs on which stream in a combined step.

A combined step runs the forward of one microbatch (F) beside the backward of another (B). This
module is the one statement of the order their nodes are issued in: the engine
(``megapipe.overlap.combined``) carries it out on the two streams and the simulator
(``megapipe.sim``) times it. Pure Python, no torch. It reads in three parts.

**1. Which layers pair** (``IssueOrder.forward_layer``). Forward layer k goes beside the next
backward layer (the backward walks its tape last layer first), counting only layers with a
comm node: the backward layers without one run alone before the forward layer; a forward layer
without one, or with no backward layer left, runs alone; the backward layers left when the
forward has run out run alone at the end (``finish``).

**2. What runs beside what** (``pair_slots``, ``slots``). Walk the forward layer's node groups
in forward order and the backward layer's in backward order (a group: one node, or the same
node of every branch of a fork); a comm group of one side and a compute group of the other go
side by side, one *slot*; otherwise the backward's group goes alone (the forward's once the
backward is done). For two MoE layers (attention, dispatch, experts, combine, finish) that is
Megatron's pair, with the deferred weight gradients (W) of the count rule:

| slot | comm stream | compute stream                                   |
|------|-------------|--------------------------------------------------|
| 1    |             | B finish                                         |
| 2    | B combine   | F attention, then W tail of the previous B layer |
| 3    | F dispatch  | B experts                                        |
| 4    | B dispatch  | F experts, then W head of this B layer           |
| 5    | F combine   | B attention                                      |
| 6    |             | F finish                                         |

(``format_pair_table`` makes this table from the order itself; a test keeps the two equal.)

**3. Who waits for whom, and where W goes** (``IssueOrder``). A slot only says what runs beside
what; nothing waits for a slot to end. Each node waits for the nodes it reads (a backward node:
the nodes that read it), or for its side's previous layer, through an event when they ran on the
other stream (``Issue.needs``), and for the work issued before it on its own stream. The comm
stream's order depends on the layers' node kinds only, so every rank of an expert-parallel group
issues its collectives in the same order. Deferred weight gradients (``defer_wgrad``, Megatron's
``delay_wgrad_compute``): each backward layer queues its own W items. *Count rule* (nodes
without times): the *head*, the first ceil(n/2) items, runs after the compute node beside the
layer's last backward comm node (slot 4); the *tail* waits for the next slot with a backward comm
node (slot 2 of the next layer, where the forward's attention is usually shorter than the
combine), or for the end of the step; ``REST`` runs whatever is still queued. *Time rule* (every
backward node carries ``NodeTimes``): the order is timed as it is planned (``timing.IssueClock``)
and, before each compute node that would wait for the comm stream, W items fill the gap
(``FILL``, ``count`` items).

**Host order.** ``IssueOrder.issues`` lists the issues as a host whose compute stream is its own
thread (CPU) issues them: per slot the comm nodes first (queued on the comm thread), then the W
items due, then the compute nodes. A host that only queues work (CUDA) issues them the same way
except that a comm node that reads the host (a dropless dispatch reading its split sizes) goes
after its slot's compute nodes, so the host has queued that compute before it blocks
(``queuing_positions``). Each stream sees the same sequence either way.

A pair's slots and waits are worked out once per pair of layer shapes (``layer_pair``, cached)
and placed into each step with the issues' names; the time rule, whose W placement depends on
the times so far, places its fills as it goes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from .layer_pair import PairEntry, layer_pair
from .slots import LayerKinds, LayerWalk, Side, Slot, layer_walk, slots_of
from .timing import COMM, COMPUTE, IssueClock, LayerTimes, NodeTimes

IssueName = tuple[Side, int, int]  # an F or B issue's name in its step: (side, layer, node)

# the ``share`` of a W issue: which part of a backward layer's deferred W items it runs
HEAD, TAIL, REST, FILL = "head", "tail", "rest", "fill"
_new_issue = tuple.__new__  # an ``Issue`` from all its fields, without the keyword handling


class Issue(NamedTuple):
    """One thing issued on a stream, in host order.

    ``layer``: F: the forward layer (0 = the step's first); B and W: the backward tape's layer
    index (W ``REST``: -1). ``node``: F and B: the node's index in its layer (forward order); W:
    -1. ``share``: W only, ``HEAD``, ``TAIL``, ``REST`` or ``FILL`` (``count`` items). Issues
    with the same ``slot`` run side by side. ``needs``: the names (``IssueName``) of the issues
    on the other stream this one waits for.
    ``reads_host``: the forward of a comm node that reads the host (``COMM_READS_HOST``; its
    backward reads nothing back). ``reads_caller``: the
    node reads what the caller made (a forward layer's input, the backward's given gradients).
    ``signals``: a node of its pair on the other stream waits for it (its event is needed).
    """

    stream: str
    side: Side
    layer: int
    node: int
    slot: int
    needs: tuple[IssueName, ...] = ()
    # a field named as tuple.count, which it shadows (Issue is a record, never counted in)
    count: int = 0  # type: ignore[assignment]
    reads_host: bool = False
    reads_caller: bool = False
    signals: bool = False
    share: str = ""

    @property
    def name(self) -> IssueName:
        return (self.side, self.layer, self.node)

    def label(self) -> str:
        if self.side == "W":
            return f"W{self.layer}.{self.share}{self.count if self.share == FILL else ''}"
        return f"{self.side}{self.layer}.{self.node}"


def walk_of(kinds: LayerKinds) -> LayerWalk:
    """``layer_walk`` of ``kinds`` given as tuples (a ``LayerGraph``'s) or lists."""
    try:
        return layer_walk(kinds)
    except TypeError:  # a list somewhere: not hashable
        return layer_walk(
            tuple(k if isinstance(k, str) else tuple(tuple(b) for b in k) for k in kinds)
        )


def pair_slots(forward: LayerKinds | None, backward: LayerKinds | None) -> list[Slot]:
    """The slots of one forward layer beside one backward layer (either may be None: the other's
    nodes then go alone). See the module docstring."""
    return list(
        slots_of(walk_of(forward) if forward else None, walk_of(backward) if backward else None)
    )


class IssueOrder:
    """The issues of one combined step, planned as the engine learns its forward layers.

    ``backward_layers``: the kinds of every layer of the backward tape, forward order (empty: a
    forward alone). ``forward_layer(kinds)`` returns the issues that come with the next forward
    layer (lone backward layers first, then the pair); ``finish()`` those of the backward layers
    left and of the W items still waiting. ``issues`` holds them all, ``stream_of`` the stream of
    each F and B issue by name; ``side_end[side]`` names the issue that ends a side so far (F:
    the last forward layer's last node; B: the last backward layer's first node).

    ``backward_times`` (``LayerTimes`` per backward layer) switches the W placement from the
    count rule to the time rule; ``forward_layer`` then takes each forward layer's times too
    (None: its nodes take no time). ``host_runs_compute``: time as a CPU host runs the issues.
    """

    def __init__(
        self,
        backward_layers: Iterable[LayerKinds] = (),
        defer_wgrad: bool = False,
        backward_times: Sequence[LayerTimes] | None = None,
        host_runs_compute: bool = False,
    ):
        self.backward_layers = [walk_of(kinds) for kinds in backward_layers]
        self.defer_wgrad = defer_wgrad and bool(self.backward_layers)
        self.clock: IssueClock | None = None
        if self.defer_wgrad and backward_times is not None:
            _check_times(backward_times, self.backward_layers, "backward_times")
            self.clock = IssueClock(backward_times, host_runs_compute)
        self.issues: list[Issue] = []
        self.stream_of: dict[IssueName, str] = {}
        self.forward_layers: list[LayerWalk] = []
        self.side_end: dict[Side, IssueName | None] = {"F": None, "B": None}
        self._next_backward = len(self.backward_layers) - 1
        self._slot = 0
        self._w_due: list[tuple[int, str, int]] = []  # (layer, HEAD/TAIL, slot) to issue next
        self._w_waiting: list[int] = []  # layers whose tail waits for a backward comm slot
        self._finished = False

    def forward_layer(self, kinds: LayerKinds, times: LayerTimes | None = None) -> list[Issue]:
        """The issues that come with the next forward layer (and its times: the time rule)."""
        if self._finished:
            raise RuntimeError("IssueOrder.forward_layer after finish()")
        forward = walk_of(kinds)
        if self.clock is not None:
            if times is not None:
                _check_times([times], [forward], "forward layer times")
            self.clock.forward.append(
                tuple(times) if times is not None else (NodeTimes(0.0, 0.0),) * len(forward.kinds)
            )
        start = len(self.issues)
        while self._next_backward >= 0 and not self.backward_layers[self._next_backward].has_comm:
            self._pair(None, self._take_backward())
        partner = self._take_backward() if forward.has_comm and self._next_backward >= 0 else None
        self._pair(forward, partner)
        return self.issues[start:]

    def finish(self) -> list[Issue]:
        """The issues of the backward layers left and of the W items still waiting."""
        if self._finished:
            raise RuntimeError("IssueOrder.finish() called twice")
        self._finished = True
        start = len(self.issues)
        while self._next_backward >= 0:
            self._pair(None, self._take_backward())
        if self.defer_wgrad:
            self._slot += 1
            self._w_due += [(layer, TAIL, self._slot) for layer in self._w_waiting]
            self._w_waiting = []
            self._issue_due_w()
            self.issues.append(Issue(COMPUTE, "W", -1, -1, self._slot, share=REST))
        else:
            self._issue_due_w()
        return self.issues[start:]

    # ---- placing a layer pair -----------------------------------------------------------
    def _take_backward(self) -> int:
        self._next_backward -= 1
        return self._next_backward + 1

    def _pair(self, forward: LayerWalk | None, backward: int | None) -> None:
        """Place one forward layer beside one backward layer (either may be None), slot by
        slot: the comm nodes, the W items due, the compute nodes (module docstring)."""
        f_layer = len(self.forward_layers)
        if forward is not None:
            self.forward_layers.append(forward)
        pair = layer_pair(forward, self.backward_layers[backward] if backward is not None else None)
        placed: list[IssueName] = []  # each entry's issue
        layers = {"F": f_layer, "B": backward}
        count_rule = self.defer_wgrad and self.clock is None
        for n, (comm, compute) in enumerate(pair.slots):
            self._slot += 1
            for entry in comm:
                placed.append(self._place(entry, layers[entry.side], placed))
            if self._w_due:
                self._issue_due_w()
            for entry in compute:
                placed.append(self._place(entry, layers[entry.side], placed))
            if count_rule and n in pair.b_comm:  # the count rule
                self._w_due += [(waiting, TAIL, self._slot) for waiting in self._w_waiting]
                self._w_waiting = []
                if n == pair.b_comm[-1]:
                    assert backward is not None  # b_comm holds a backward layer's comm slots
                    self._w_due.append((backward, HEAD, self._slot))
                    self._w_waiting.append(backward)
        if forward is not None:
            self.side_end["F"] = placed[pair.f_end]
        if backward is not None:
            self.side_end["B"] = placed[pair.b_end]

    def _place(self, entry: PairEntry, layer: int | None, placed: list[IssueName]) -> IssueName:
        """Issue one node after the entries it waits for (and its side's previous layer's end,
        when that ran on the other stream); returns its name."""
        assert layer is not None  # a pair holds a side's entries only when that side has a layer
        waits = entry.waits
        needs = (placed[waits[0]],) if len(waits) == 1 else tuple([placed[w] for w in waits])
        caller = False
        if entry.after_previous:
            end = self.side_end[entry.side]
            if end is not None and self.stream_of[end] != entry.stream:
                needs = (end,) + needs  # issued before every entry of this pair
            caller = entry.side == "F" or layer == len(self.backward_layers) - 1
        clock = self.clock
        if clock is not None and entry.stream == COMPUTE:  # the time rule: W into the gap
            for w_layer, count, duration in clock.fill(needs):
                self.issues.append(
                    Issue(COMPUTE, "W", w_layer, -1, self._slot, count=count, share=FILL)
                )
                clock.add(COMPUTE, (), duration)
        self.issues.append(
            _new_issue(
                Issue,
                (
                    entry.stream,
                    entry.side,
                    layer,
                    entry.node,
                    self._slot,
                    needs,
                    0,
                    entry.reads_host,
                    caller,
                    entry.signals,
                    "",
                ),
            )
        )
        name = (entry.side, layer, entry.node)
        self.stream_of[name] = entry.stream
        if clock is not None:
            clock.add(entry.stream, needs, clock.node_time(entry.side, layer, entry.node), name)
            if entry.side == "B" and entry.stream == COMPUTE:
                clock.queue(layer, entry.node)
        return name

    def _issue_due_w(self) -> None:
        for layer, part, slot in self._w_due:
            self.issues.append(Issue(COMPUTE, "W", layer, -1, slot, share=part))
        self._w_due = []


def _check_times(times: Sequence[LayerTimes], layers: Sequence[LayerWalk], what: str) -> None:
    if len(times) != len(layers) or any(
        len(t) != len(layer.kinds) for t, layer in zip(times, layers)
    ):
        raise ValueError(
            f"{what}: {[len(t) for t in times]} node times per layer, but the layers have "
            f"{[len(layer.kinds) for layer in layers]} nodes"
        )


def issue_order(
    forward_layers: Sequence[LayerKinds],
    backward_layers: Sequence[LayerKinds] = (),
    defer_wgrad: bool = False,
) -> tuple[Issue, ...]:
    """Every issue of a combined step, in host (CPU) order: the forward of ``forward_layers``
    beside the backward of a tape of ``backward_layers`` (kinds per layer, forward order)."""
    order = IssueOrder(backward_layers, defer_wgrad)
    for kinds in forward_layers:
        order.forward_layer(kinds)
    order.finish()
    return tuple(order.issues)


def queuing_positions(issues: Sequence[Issue]) -> list[int]:
    """The positions of ``issues`` in the order of a host that only queues work (CUDA): as
    listed, except that a slot's comm nodes from the first one that reads the host on go after
    the slot's compute nodes. Each stream sees the same sequence as in ``issues``."""
    out: list[int] = []
    held: list[int] = []  # the current slot's comm issues from the first host-reading one on
    slot = None
    for n, issue in enumerate(issues):
        if issue.side != "W" and issue.slot != slot:  # a new slot begins
            out += held
            held = []
            slot = issue.slot
        if issue.stream == COMM and (held or issue.reads_host):
            held.append(n)
        else:
            out.append(n)
    return out + held


def format_pair_table(
    forward: LayerKinds,
    backward: LayerKinds,
    names: Sequence[str] | None = None,
    defer_wgrad: bool = False,
) -> str:
    """One forward layer beside one backward layer as the table of the module docstring, made
    from the order itself (``issue_order`` of two such pairs; the second, the steady state, is
    shown): what the docs print is what the engine runs. ``defer_wgrad``: with the count rule's
    W items in the compute column."""
    issues = issue_order([forward, forward], [backward, backward], defer_wgrad)
    pair = [i for i in issues if (i.side, i.layer) in (("F", 1), ("B", 0))]
    slots = sorted({i.slot for i in pair})

    def text(issue: Issue) -> str:
        if issue.side == "W":
            return (
                "W head of this B layer"
                if issue.share == HEAD
                else "W tail of the previous B layer"
            )
        return f"{issue.side} {names[issue.node] if names else issue.node}"

    rows = ["| slot | comm stream | compute stream |", "|---|---|---|"]
    for number, slot in enumerate(slots, 1):
        members = [i for i in issues if i.slot == slot and (i.side == "W" or i in pair)]
        comm = ", ".join(text(i) for i in members if i.stream == COMM)
        compute = ", then ".join(text(i) for i in members if i.stream == COMPUTE)
        rows.append(f"| {number} | {comm} | {compute} |")
    return "\n".join(rows)
