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
  order puts them (by count, or by time with ``wgrad_by_time``), a lone layer's waves
  pipelined, an OVERLAP's halves handing their outputs on as the executor's early sends do
  (``half_ends``). ``host_runs_compute`` models a host that is itself the compute stream (CPU:
  a comm node starts only when the host reaches it).

(``sim.pick.choose_a2a_waves`` picks the default of ``--moe-a2a-waves`` from the node model.)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import ceil
from typing import TYPE_CHECKING

from ..pairing.order import FILL, HEAD, REST, TAIL, Issue, IssueOrder, queuing_positions
from ..pairing.timing import COMM, COMPUTE, NodeTimes, time_issues
from ..schedule.ir import Action, Kind, plain_key
from ..schedule.p2p.early_sends import EACH
from .costs import AT_END, NodeCosts

if TYPE_CHECKING:
    from .costs import Costs

LAYER_MODEL = ("attention", "dispatch", "experts", "combine")  # a MoE layer of the layer model
_LAYER_KINDS = (COMPUTE, COMM, COMPUTE, COMM)


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


def _halves(action: Action) -> tuple[Action | None, Action | None]:
    if action.kind is Kind.OVERLAP:
        return action.forward, action.backward
    return (action, None) if action.kind is Kind.F else (None, action)


def action_ops(action: Action, costs: Costs) -> list[NodeOp]:
    """The program of a compute action under ``costs`` (module docstring)."""
    if costs.nodes is not None:
        return node_ops(action, costs.nodes)
    layers = costs.moe_layers
    if action.kind is Kind.W or layers == 0:
        return [
            NodeOp(COMPUTE, "compute", half, None, costs.compute(half.kind, plain_key(half)[0]), ())
            for half in action.computations()
        ]
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
        per_layer = costs.compute(half.kind, plain_key(half)[0]) / layers
        attention = per_layer * costs.attention_share
        return part, half, attention if part == "attention" else per_layer - attention

    return _program(order.issues, node, order=queuing_positions(order.issues))


def node_ops(action: Action, nodes: NodeCosts) -> list[NodeOp]:
    """The program of one compute action under the node model, in the engine's (CPU) host
    order."""
    if action.kind is Kind.W:
        return [NodeOp(COMPUTE, "wgrad", action, None, nodes.weight_time(), ())]
    forward, backward = _halves(action)
    b_layers = nodes.layers(plain_key(backward)[0]) if backward is not None else []
    defer = nodes.defer_wgrad and backward is not None and backward.kind is Kind.B
    b_times = [nodes.node_times(roles) for roles in b_layers]
    order = IssueOrder(
        [nodes.kinds(r) for r in b_layers],
        defer_wgrad=defer,
        backward_times=b_times if nodes.wgrad_by_time else None,
        host_runs_compute=nodes.host_runs_compute,
    )
    f_layers = nodes.layers(plain_key(forward)[0]) if forward is not None else []
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
            return role, forward, nodes.profile.time(role, "F", nodes.a2a_waves) + nodes.host_cost
        assert backward is not None
        role = b_layers[issue.layer][issue.node]
        return role, backward, nodes.backward_time(role, backward.kind) + nodes.host_cost

    return _program(order.issues, node, nodes.host_runs_compute)


def _program(
    issues: Sequence[Issue],
    node: Callable[[Issue], tuple[str, Action, float]],
    host_runs_compute: bool = False,
    order: Sequence[int] | None = None,
) -> list[NodeOp]:
    """``issues`` as ``NodeOp``s, listed in ``order`` (positions in ``issues``; default as
    ordered), each issue's needs renumbered to it; on a CPU host a comm node also needs the
    compute node before it."""
    order = range(len(issues)) if order is None else order
    listed_as = {
        issues[ordered].name: listed
        for listed, ordered in enumerate(order)
        if issues[ordered].side != "W"
    }
    ops: list[NodeOp] = []
    last_compute: int | None = None
    for ordered in order:
        issue = issues[ordered]
        part, half, duration = node(issue)
        needs = tuple(sorted(listed_as[n] for n in issue.needs))
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
        self.left = [
            deque(item for times in reversed(layer) for item in times.wgrad) for layer in b_times
        ]

    def take(self, issue: Issue) -> float:
        if issue.share == REST:
            total = sum(sum(items) for items in self.left)
            self.left = [deque() for _ in self.left]
            return total
        items = self.left[issue.layer]
        count = {HEAD: ceil(len(items) / 2), TAIL: len(items), FILL: issue.count}[issue.share]
        return sum(items.popleft() for _ in range(min(count, len(items))))


def op_times(ops: Sequence[NodeOp], start, maximum=max) -> list[tuple]:
    """(begin, end) of each node of a program started at ``start`` (``time_issues``; an array
    of starts with ``maximum=np.maximum``)."""
    return time_issues(ops, _duration, start=start, maximum=maximum)


def _duration(op: NodeOp) -> float:
    return op.duration


def time_action(action: Action, start: float, costs: Costs) -> tuple[Segment, ...]:
    """The timed nodes of a compute action started at ``start`` on an otherwise idle rank."""
    ops = action_ops(action, costs)
    return tuple(
        Segment(op.stream, op.part, op.action, op.layer, begin, end)
        for op, (begin, end) in zip(ops, op_times(ops, start))
    )


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
