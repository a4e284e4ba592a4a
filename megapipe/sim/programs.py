"""The program of an action: its nodes in the engine's issue order, each with a duration.

Every F, B, I, W and OVERLAP action the simulator times is a program of ``NodeOp``s: the pair
order (``schedule.pair_order.IssueOrder``, the engine's own rule) lays out the action's layers, a
cost model gives each node its duration, and ``schedule.node_timing.time_issues`` (the one
node-level timing model) times the program. Two cost models:

- **layer model** (``Costs`` without ``nodes``): each stage's F, B (or I) compute split evenly
  over ``moe_layers`` MoE layers of four nodes each (attention and router, dispatch, experts,
  combine; ``attention_share`` of the compute before the dispatch), every all-to-all taking
  ``dispatch`` / ``combine``. Outside an OVERLAP every node waits for the one before it, so the
  all-to-all is exposed; inside one, forward layer k goes beside backward layer L-1-k in the pair
  order (attention-F | combine-B, experts-B | dispatch-F, experts-F | dispatch-B, attention-B |
  combine-F), so with free communication an OVERLAP takes exactly F + B. A W, or an action of no
  MoE layer, is one compute node.
- **node model** (``Costs(nodes=NodeCosts(...))``): the action's layers as the engine runs them
  (embedding on a first stage, ``moe_layers`` MoE layers of five nodes, head on a last), each
  node lasting its profile time (``profile.NodeProfile``), deferred weight gradients where the
  order puts them (by count, or by time with ``wgrad_by_time``), a lone layer's chunks
  pipelined, an OVERLAP's halves handing their outputs on as the executor's early sends do
  (``half_ends``). ``host_runs_compute`` models a host that is itself the compute stream (CPU:
  a comm node starts only when the host reaches it).

``choose_a2a_chunks`` picks the default of ``--moe-a2a-chunks`` from the node model.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from math import ceil
from typing import TYPE_CHECKING, Callable, Sequence

from ..schedule.early_sends import EACH, SINGLE, WHOLE
from ..schedule.ir import Action, Kind
from ..pairing.timing import COMM, COMPUTE, NodeTimes, time_issues
from ..pairing.order import (
    FILL, HEAD, REST, TAIL, Issue, IssueOrder, queuing_positions,
)
from .profile import CHUNKED_ROLES, MOE_ROLES, NodeProfile

if TYPE_CHECKING:
    from ..schedule.ir import Schedule
    from .costs import Costs

_KIND = {"attn": COMPUTE, "dispatch": COMM, "mlp": COMPUTE, "combine": COMM, "finish": COMPUTE}
LAYER_MODEL = ("attention", "dispatch", "experts", "combine")  # a MoE layer of the layer model
_LAYER_KINDS = (COMPUTE, COMM, COMPUTE, COMM)
# when an OVERLAP's halves hand their outputs on: the executor's rules (``schedule.early_sends``:
# each when its last node ends; both once both halves are done, before the held weight
# gradients, also the conservative reading of the rule that sends only single-send pairs
# early), or, to compare, at the end of the pair
AT_END = "at the end"
EARLY_RULES = (EACH, SINGLE, WHOLE, AT_END)


@dataclass(frozen=True)
class Segment:
    """One timed node of an action on one stream of a rank: ``part`` names it (the layer model's
    ``attention``, ``experts``, ``dispatch``, ``combine``, or ``compute`` for a whole action; the
    node model's profile roles), ``action`` is the plain F/B/I/W it belongs to."""

    stream: str
    part: str
    action: Action
    layer: int | None
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class NodeOp:
    """One node of an action's program: its stream, what it is, its duration and the positions
    of the earlier nodes it ``needs`` (an issue for ``time_issues``)."""

    stream: str
    part: str
    action: Action
    layer: int | None
    duration: float
    needs: tuple[int, ...]


@dataclass(frozen=True)
class NodeCosts:
    """What an action is made of, node by node (the node model of the module docstring).

    ``num_stages``: the stages of one pipeline (``Schedule.stages_per_pipeline``; DualPipe's
    second pipeline's stages count from ``num_stages`` on): its first holds the embedding, its
    last the head; ``moe_layers`` MoE layers per stage. ``combined``: the schedule runs node by
    node on the streams (the engine does so in combined schedules): an I keeps attention's
    weight gradient (only the experts' GEMMs defer); in a plain schedule the generic split moves
    every weight gradient to W. ``wgrad_by_time``: the engine's nodes carry their times (as the
    replay benchmark's do), so the order places deferred weight gradients by the time rule;
    without (a training run's nodes carry none) by the count rule. ``early_sends``: when an
    OVERLAP's halves hand their outputs on (``EARLY_RULES``; None: the rule the executor proves
    for the schedule, ``schedule.early_sends.choose_early_sends``). ``host_cost``: what the engine
    spends per F or B node beyond the node's own time (a property of the machine, measured by
    ``benchmarks/replay_calibration.py``), added to every F and B node (not to W)."""

    profile: NodeProfile
    num_stages: int
    moe_layers: int
    a2a_chunks: int = 1
    defer_wgrad: bool = False
    host_runs_compute: bool = False
    combined: bool = True
    early_sends: str | None = None  # None: the executor's rule for the schedule
    wgrad_by_time: bool = False
    host_cost: float = 0.0

    def __post_init__(self) -> None:
        for name in ("num_stages", "a2a_chunks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"NodeCosts {name} must be an integer >= 1, got {value!r}")
        if self.early_sends is not None and self.early_sends not in EARLY_RULES:
            raise ValueError(f"NodeCosts early_sends={self.early_sends!r} is not one of "
                             f"{', '.join(EARLY_RULES)}")
        if not self.host_cost >= 0:
            raise ValueError(f"NodeCosts host_cost must be >= 0, got {self.host_cost!r}")
        if isinstance(self.moe_layers, bool) or not isinstance(self.moe_layers, int) \
                or self.moe_layers < 0:
            raise ValueError(
                f"NodeCosts moe_layers must be an integer >= 0, got {self.moe_layers!r}")

    def stage_class(self, stage: int) -> int:
        """0 a middle stage, 1 the first, 2 the last, 3 both (their actions differ)."""
        position = stage % self.num_stages
        return int(position == 0) + 2 * int(position == self.num_stages - 1)

    def layers(self, stage: int) -> list[tuple[str, ...]]:
        """The node roles of each layer of ``stage``, in forward order."""
        k = self.a2a_chunks
        moe = MOE_ROLES if k == 1 else ("attn",) + CHUNKED_ROLES * k + ("finish",)
        kind = self.stage_class(stage)
        layers = [("embedding",)] if kind & 1 else []
        layers += [moe] * self.moe_layers
        return layers + ([("head",)] if kind & 2 else [])

    def kinds(self, roles: Sequence[str]) -> list:
        """The pair order's kinds of a layer (a fork of the chunks when k > 1)."""
        if len(roles) == 1 or self.a2a_chunks == 1:
            return [_KIND.get(role, COMPUTE) for role in roles]
        chunk = tuple(_KIND[role] for role in CHUNKED_ROLES)
        return [COMPUTE, tuple(chunk for _ in range(self.a2a_chunks)), COMPUTE]

    def node_times(self, roles: Sequence[str]) -> tuple[NodeTimes, ...]:
        """The times of a layer's nodes as the time rule sees them."""
        return tuple(self.profile.node_times(role, self.a2a_chunks) for role in roles)

    def backward_time(self, role: str, kind: Kind) -> float:
        """A node's backward: B, plus its W where the action computes it."""
        time = self.profile.time(role, "B", self.a2a_chunks)
        weight = self.profile.time(role, "W", self.a2a_chunks)
        if role == "attn":
            keeps = kind is Kind.B or self.combined
        else:
            keeps = kind is Kind.B and not self.defer_wgrad
        return time + (weight if keeps else 0.0)

    def weight_time(self) -> float:
        """A W action of one stage: the weight gradients its I left."""
        roles = ("mlp",) if self.combined else ("attn", "mlp")
        return self.moe_layers * sum(self.profile.time(r, "W") for r in roles)


def _halves(action: Action) -> tuple[Action | None, Action | None]:
    if action.kind is Kind.OVERLAP:
        return action.forward, action.backward
    return (action, None) if action.kind is Kind.F else (None, action)


def action_ops(action: Action, costs: "Costs") -> list[NodeOp]:
    """The program of a compute action under ``costs`` (module docstring)."""
    if costs.nodes is not None:
        return node_ops(action, costs.nodes)
    layers = costs.moe_layers
    if action.kind is Kind.W or layers == 0:
        return [NodeOp(COMPUTE, "compute", half, None, costs.compute(half.kind, half.stage), ())
                for half in action.computations()]
    forward, backward = _halves(action)
    order = IssueOrder([_LAYER_KINDS] * (layers if backward is not None else 0))
    for _ in range(layers if forward is not None else 0):
        order.forward_layer(_LAYER_KINDS)
    order.finish()

    def node(issue: Issue) -> tuple[str, Action, float]:
        half = forward if issue.side == "F" else backward
        assert half is not None
        part = LAYER_MODEL[issue.node]
        if issue.stream == COMM:
            return part, half, costs.dispatch if part == "dispatch" else costs.combine
        per_layer = costs.compute(half.kind, half.stage) / layers
        attention = per_layer * costs.attention_share
        return part, half, attention if part == "attention" else per_layer - attention

    return _program(order.issues, node, order=queuing_positions(order.issues))


def node_ops(action: Action, nodes: NodeCosts) -> list[NodeOp]:
    """The program of one compute action under the node model, in the engine's (CPU) host
    order."""
    if action.kind is Kind.W:
        return [NodeOp(COMPUTE, "wgrad", action, None, nodes.weight_time(), ())]
    forward, backward = _halves(action)
    b_layers = nodes.layers(backward.stage) if backward is not None else []
    defer = nodes.defer_wgrad and backward is not None and backward.kind is Kind.B
    b_times = [nodes.node_times(roles) for roles in b_layers]
    order = IssueOrder([nodes.kinds(r) for r in b_layers], defer_wgrad=defer,
                       backward_times=b_times if nodes.wgrad_by_time else None,
                       host_runs_compute=nodes.host_runs_compute)
    f_layers = nodes.layers(forward.stage) if forward is not None else []
    for roles in f_layers:
        order.forward_layer(nodes.kinds(roles), nodes.node_times(roles))
    order.finish()
    shares = _WeightShares(b_times)

    def node(issue: Issue) -> tuple[str, Action, float]:
        if issue.side == "W":
            assert backward is not None
            return "wgrad", backward, shares.take(issue)
        if issue.side == "F":
            assert forward is not None
            role = f_layers[issue.layer][issue.node]
            return role, forward, nodes.profile.time(role, "F", nodes.a2a_chunks) + nodes.host_cost
        assert backward is not None
        role = b_layers[issue.layer][issue.node]
        return role, backward, nodes.backward_time(role, backward.kind) + nodes.host_cost

    return _program(order.issues, node, nodes.host_runs_compute)


def _program(issues: Sequence[Issue], node: Callable[[Issue], tuple[str, Action, float]],
             host_runs_compute: bool = False, order: Sequence[int] | None = None) -> list[NodeOp]:
    """``issues`` as ``NodeOp``s, listed in ``order`` (positions in ``issues``; default as
    planned), each issue's needs renumbered to it; on a CPU host a comm node also needs the
    compute node before it."""
    order = range(len(issues)) if order is None else order
    listed_at = {planned: listed for listed, planned in enumerate(order)}
    ops: list[NodeOp] = []
    last_compute: int | None = None
    for planned in order:
        issue = issues[planned]
        part, half, duration = node(issue)
        needs = tuple(sorted(listed_at[n] for n in issue.needs))
        if host_runs_compute and issue.stream == COMM and last_compute is not None:
            needs = tuple(sorted(set(needs) | {last_compute}))
        ops.append(NodeOp(issue.stream, part, half, max(issue.layer, 0), duration, needs))
        if issue.stream == COMPUTE:
            last_compute = len(ops) - 1
    return ops


class _WeightShares:
    """The deferred weight-gradient items of each backward layer (its nodes' ``wgrad`` in the
    order its backward queues them), handed out as the order's W issues take them: HEAD the
    first ceil(n/2) of the n left, TAIL the rest, FILL its ``count``, REST everything left."""

    def __init__(self, b_times: Sequence[Sequence[NodeTimes]]) -> None:
        self.left = [deque(item for times in reversed(layer) for item in times.wgrad)
                     for layer in b_times]

    def take(self, issue: Issue) -> float:
        if issue.node == REST:
            total = sum(sum(items) for items in self.left)
            self.left = [deque() for _ in self.left]
            return total
        items = self.left[issue.layer]
        count = {HEAD: ceil(len(items) / 2), TAIL: len(items), FILL: issue.count}[issue.node]
        return sum(items.popleft() for _ in range(min(count, len(items))))


def op_times(ops: Sequence[NodeOp], start, maximum=max) -> list[tuple]:
    """(begin, end) of each node of a program started at ``start`` (``time_issues``; an array
    of starts with ``maximum=np.maximum``)."""
    return time_issues(ops, _duration, start=start, maximum=maximum)


def _duration(op: NodeOp) -> float:
    return op.duration


def time_action(action: Action, start: float, costs: "Costs") -> tuple[Segment, ...]:
    """The timed nodes of a compute action started at ``start`` on an otherwise idle rank."""
    ops = action_ops(action, costs)
    return tuple(Segment(op.stream, op.part, op.action, op.layer, begin, end)
                 for op, (begin, end) in zip(ops, op_times(ops, start)))


def half_ends(ops: Sequence[NodeOp], times: Sequence[tuple], rule: str) -> tuple[float, float]:
    """When an OVERLAP program's forward and backward outputs are handed on under ``rule``."""
    end = max([t for _, t in times])
    if rule == AT_END:
        return end, end
    last: dict = {}
    for op, (_, finish) in zip(ops, times):
        if op.part != "wgrad":
            last[op.action.kind is Kind.F] = finish
    forward, backward = last.get(True, end), last.get(False, end)
    if rule == EACH:
        return forward, backward
    both = max(forward, backward)
    return both, both


def choose_a2a_chunks(schedule: "Schedule", nodes: NodeCosts, max_chunks: int = 4,
                      tolerance: float = 0.01) -> int:
    """The default of ``--moe-a2a-chunks``: the smallest k in 1..``max_chunks`` whose simulated
    step is within ``tolerance`` of the fastest (chunks that gain nothing are not worth their
    extra latency and smaller GEMMs, which the profile does not price)."""
    from .costs import Costs
    from .simulate import simulate

    spans = {}
    for k in range(1, max_chunks + 1):
        costs = Costs(nodes=replace(nodes, a2a_chunks=k))
        spans[k] = simulate(schedule, costs).makespan
    best = min(spans.values())
    return min(k for k, span in spans.items() if span <= best * (1 + tolerance))
