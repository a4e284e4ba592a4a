"""Steps timed node by node in the engine's own issue order, from a node-time profile.

With ``Costs(nodes=NodeCosts(...))`` the simulator times every F, B, I, W and OVERLAP step as
the engine runs it: the step's layers (embedding on the first stage, ``moe_layers`` MoE layers,
head on the last) are planned by ``schedule.pair_order.IssueOrder``, the co-scheduler's own rule, so an
OVERLAP step follows the dataflow pair order (each node after its own inputs, each stream in the
planned order, no joins), deferred weight gradients run where the plan puts them, and a lone step
with ``a2a_chunks`` k > 1 pipelines its k chunks, and an OVERLAP's halves hand their outputs
on as the executor's early sends do (``early_sends``). Each node lasts its profile time
(``profile.NodeProfile``). ``host_runs_compute`` models a host that is itself the compute stream
(CPU: a comm node is issued only when the host reaches it); without it, a GPU host that only
queues work.

``choose_a2a_chunks`` picks the default of ``--moe-a2a-chunks`` from these costs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from math import ceil
from typing import TYPE_CHECKING, Sequence

from ..schedule.ir import Action, Kind
from ..schedule.pair_order import COMM, COMPUTE, FILL, HEAD, REST, TAIL, Issue, IssueOrder
from .profile import CHUNKED_ROLES, MOE_ROLES, NodeProfile
from ..schedule.node_timing import NodeTimes

if TYPE_CHECKING:
    from ..schedule.ir import Schedule

_KIND = {"attn": COMPUTE, "dispatch": COMM, "mlp": COMPUTE, "combine": COMM, "finish": COMPUTE}
# when an OVERLAP's halves hand their outputs on (the executor's ``early_send_rule``): each
# when its last node ends; both once both halves are done (before the held weight gradients;
# also the conservative reading of the rule that sends only single-send pairs early); at the end
EACH, WHOLE, AT_END = "each half", "whole batch", "at the end"
EARLY_RULES = (EACH, "single-send pairs", WHOLE, AT_END)


@dataclass(frozen=True)
class NodeCosts:
    """What a step is made of, node by node (see the module docstring).

    ``num_stages``: the stages of one pipeline (``Schedule.stages_per_pipeline``; DualPipe's
    second pipeline's stages count from ``num_stages`` on): its first holds the embedding, its
    last the head; ``moe_layers`` MoE layers per stage.

    ``combined``: the schedule runs node by node on the streams (the engine does so in combined
    schedules): an I keeps attention's weight gradient (only the experts' GEMMs defer); in a
    plain schedule the generic split moves every weight gradient to W.

    ``wgrad_by_time``: the engine's nodes carry their times (``schedule.node_timing.NodeTimes``, as the
    replay benchmark's do), so the planner places deferred weight gradients by the time rule;
    without (a training run's nodes carry none) by the count rule.

    ``host_cost``: what the engine spends per F or B node beyond the node's own time (its tape
    and autograd calls, thread hand-offs: real work outside the node), in the profile's unit,
    added to every F and B node (not to W). It is a property of the machine, not of the
    profile: the replay benchmark measures it with a calibration replay of a uniform profile
    (``benchmarks/replay_calibration.py``); 0 models a host that costs nothing."""

    profile: NodeProfile
    num_stages: int
    moe_layers: int
    a2a_chunks: int = 1
    defer_wgrad: bool = False
    host_runs_compute: bool = False
    combined: bool = True
    early_sends: str = EACH
    wgrad_by_time: bool = False
    host_cost: float = 0.0

    def __post_init__(self) -> None:
        for name in ("num_stages", "a2a_chunks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"NodeCosts {name} must be an integer >= 1, got {value!r}")
        if self.early_sends not in EARLY_RULES:
            raise ValueError(f"NodeCosts early_sends={self.early_sends!r} is not one of "
                             f"{', '.join(EARLY_RULES)}")
        if not self.host_cost >= 0:
            raise ValueError(f"NodeCosts host_cost must be >= 0, got {self.host_cost!r}")
        if isinstance(self.moe_layers, bool) or not isinstance(self.moe_layers, int) \
                or self.moe_layers < 0:
            raise ValueError(f"NodeCosts moe_layers must be an integer >= 0, got {self.moe_layers!r}")

    def stage_class(self, stage: int) -> int:
        """0 a middle stage, 1 the first, 2 the last, 3 both (their steps differ)."""
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

    def shape(self, roles: Sequence[str]) -> list:
        """The planner's shape of a layer (a fork of the chunks when k > 1)."""
        if len(roles) == 1 or self.a2a_chunks == 1:
            return [_KIND.get(role, COMPUTE) for role in roles]
        chunk = tuple(_KIND[role] for role in CHUNKED_ROLES)
        return [COMPUTE, tuple(chunk for _ in range(self.a2a_chunks)), COMPUTE]

    def node_times(self, roles: Sequence[str]) -> tuple[NodeTimes, ...]:
        """The times of a layer's nodes as the planner's time rule sees them."""
        return tuple(self.profile.node_times(role, self.a2a_chunks) for role in roles)

    def backward_time(self, role: str, kind: Kind) -> float:
        """A node's backward: B, plus its W where the step computes it."""
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


@dataclass(frozen=True)
class NodeOp:
    """One timed node of a step's program (the layer model of ``steps`` uses it too)."""

    stream: str
    part: str
    action: Action
    layer: int | None
    duration: float
    deps: tuple[int, ...]


def node_ops(action: Action, nodes: NodeCosts) -> list[NodeOp]:
    """The program of one compute action: its nodes in issue order, with their inputs."""
    if action.kind is Kind.W:
        return [NodeOp(COMPUTE, "wgrad", action, None, nodes.weight_time(), ())]
    forward = action.forward if action.kind is Kind.OVERLAP else (
        action if action.kind is Kind.F else None)
    backward = action.backward if action.kind is Kind.OVERLAP else (
        None if action.kind is Kind.F else action)
    b_layers = nodes.layers(backward.stage) if backward is not None else []
    defer = nodes.defer_wgrad and backward is not None and backward.kind is Kind.B
    b_times = [nodes.node_times(roles) for roles in b_layers]
    planner = IssueOrder([nodes.shape(r) for r in b_layers], defer_wgrad=defer,
                          backward_times=b_times if nodes.wgrad_by_time else None,
                          host_runs_compute=nodes.host_runs_compute)
    f_layers = nodes.layers(forward.stage) if forward is not None else []
    for roles in f_layers:
        planner.forward_layer(nodes.shape(roles), nodes.node_times(roles))
    planner.finish()
    wgrad = _WeightShares(b_times)
    return _ops(planner.issues, forward, backward, f_layers, b_layers, nodes, wgrad)


def _ops(issues: Sequence[Issue], forward: Action | None, backward: Action | None,
         f_layers: list, b_layers: list, nodes: NodeCosts, wgrad: "_WeightShares"
         ) -> list[NodeOp]:
    ops: list[NodeOp] = []
    last_compute: int | None = None
    for issue in issues:
        deps = issue.needs
        if nodes.host_runs_compute and issue.stream == COMM and last_compute is not None:
            deps = tuple(sorted(set(deps) | {last_compute}))
        if issue.side == "W":
            assert backward is not None
            op = NodeOp(COMPUTE, "wgrad", backward, max(issue.layer, 0), wgrad.take(issue), deps)
        elif issue.side == "F":
            assert forward is not None
            role = f_layers[issue.layer][issue.node]
            time = nodes.profile.time(role, "F", nodes.a2a_chunks) + nodes.host_cost
            op = NodeOp(issue.stream, role, forward, issue.layer, time, deps)
        else:
            assert backward is not None
            role = b_layers[issue.layer][issue.node]
            time = nodes.backward_time(role, backward.kind) + nodes.host_cost
            op = NodeOp(issue.stream, role, backward, issue.layer, time, deps)
        if issue.stream == COMPUTE:
            last_compute = len(ops)
        ops.append(op)
    return ops


class _WeightShares:
    """The deferred weight-gradient items of each backward layer (its nodes' ``wgrad`` in the
    order its backward queues them), handed out as the plan's W issues take them: HEAD the first
    ceil(n/2) of the n left, TAIL the rest, FILL its ``count``, REST everything left."""

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
