"""Timing of one pipeline step on one rank: a plain F/B/I/W or an OVERLAP of two microbatches.

A rank has one compute stream and one communication stream. Each MoE layer's forward is
attention (and router) compute, the dispatch all-to-all, expert compute and the combine
all-to-all, one after the other; its backward runs the same four pieces in reverse (combine,
experts, dispatch, attention). Outside an OVERLAP every piece waits for the one before it, so
the all-to-all is exposed. Inside an OVERLAP the forward of one microbatch (layers 0..L-1) is
paired with the backward of another (layers L-1..0) layer by layer, as in DESIGN.md and
Megatron's combined 1F1B:

    compute stream:  attention-F | experts-B  | experts-F   | attention-B
    comm stream:     combine-B   | dispatch-F | dispatch-B  | combine-F

so each all-to-all runs beside compute of the other microbatch. With free communication the
OVERLAP takes exactly F + B (DualPipe's F&B).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedule.ir import Action, Kind
from .costs import Costs
from .node_steps import NodeOp, node_ops

COMPUTE = "compute"
COMM = "comm"


@dataclass(frozen=True)
class Segment:
    """One timed piece of an action on one stream of a rank.

    ``part`` is ``attention``, ``experts``, ``dispatch``, ``combine`` or, for an action without
    MoE layers (or a W), ``compute``. ``action`` is the plain F/B/I/W the piece belongs to.
    """

    stream: str
    part: str
    action: Action
    layer: int | None
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


def _layer_forward(
    action: Action, layer: int, compute: float, costs: Costs, first: int
) -> list[NodeOp]:
    """The four pieces of one layer's forward, chained; ``first`` is the index of the first."""
    attention = compute * costs.attention_share
    return [
        NodeOp(COMPUTE, "attention", action, layer, attention, (first - 1,) if first else ()),
        NodeOp(COMM, "dispatch", action, layer, costs.dispatch, (first,)),
        NodeOp(COMPUTE, "experts", action, layer, compute - attention, (first + 1,)),
        NodeOp(COMM, "combine", action, layer, costs.combine, (first + 2,)),
    ]


def _layer_backward(
    action: Action, layer: int, compute: float, costs: Costs, first: int
) -> list[NodeOp]:
    attention = compute * costs.attention_share
    return [
        NodeOp(COMM, "combine", action, layer, costs.combine, (first - 1,) if first else ()),
        NodeOp(COMPUTE, "experts", action, layer, compute - attention, (first,)),
        NodeOp(COMM, "dispatch", action, layer, costs.dispatch, (first + 1,)),
        NodeOp(COMPUTE, "attention", action, layer, attention, (first + 2,)),
    ]


def _plain_ops(action: Action, costs: Costs) -> list[NodeOp]:
    compute = costs.compute(action.kind, action.stage)
    layers = costs.moe_layers
    if action.kind is Kind.W or layers == 0:
        return [NodeOp(COMPUTE, "compute", action, None, compute, ())]
    per_layer = compute / layers
    ops: list[NodeOp] = []
    for i in range(layers):
        if action.kind is Kind.F:
            ops += _layer_forward(action, i, per_layer, costs, len(ops))
        else:
            ops += _layer_backward(action, layers - 1 - i, per_layer, costs, len(ops))
    return ops


def _overlap_ops(forward: Action, backward: Action, costs: Costs) -> list[NodeOp]:
    """Forward layer k paired with backward layer L-1-k, pieces in the order of the docstring."""
    f_compute = costs.compute(Kind.F, forward.stage)
    b_compute = costs.compute(backward.kind, backward.stage)
    layers = costs.moe_layers
    if layers == 0:
        return [
            NodeOp(COMPUTE, "compute", forward, None, f_compute, ()),
            NodeOp(COMPUTE, "compute", backward, None, b_compute, ()),
        ]
    f_layer, b_layer = f_compute / layers, b_compute / layers
    f_attn, b_attn = f_layer * costs.attention_share, b_layer * costs.attention_share
    ops: list[NodeOp] = []
    f_prev: tuple[int, ...] = ()  # previous forward piece (the combine of the layer before)
    b_prev: tuple[int, ...] = ()
    for k in range(layers):
        fl, bl = k, layers - 1 - k
        n = len(ops)
        ops += [
            NodeOp(COMPUTE, "attention", forward, fl, f_attn, f_prev),  # n
            NodeOp(COMM, "combine", backward, bl, costs.combine, b_prev),  # n+1
            NodeOp(COMPUTE, "experts", backward, bl, b_layer - b_attn, (n + 1,)),  # n+2
            NodeOp(COMM, "dispatch", forward, fl, costs.dispatch, (n,)),  # n+3
            NodeOp(COMPUTE, "experts", forward, fl, f_layer - f_attn, (n + 3,)),  # n+4
            NodeOp(COMM, "dispatch", backward, bl, costs.dispatch, (n + 2,)),  # n+5
            NodeOp(COMPUTE, "attention", backward, bl, b_attn, (n + 5,)),  # n+6
            NodeOp(COMM, "combine", forward, fl, costs.combine, (n + 4,)),  # n+7
        ]
        f_prev, b_prev = (n + 7,), (n + 6,)
    return ops


def op_times(ops: list[NodeOp], start, maximum=max) -> list[tuple]:
    """(begin, end) of each piece started at ``start``: a piece begins when its stream is free
    and the piece it depends on has ended. ``start`` may be an array of starts (one per step of
    the same shape), with ``maximum=np.maximum``: the same operations, element by element."""
    free = {COMPUTE: start, COMM: start}
    times: list[tuple] = []
    for op in ops:
        begin = free[op.stream]
        for dep in op.deps:
            begin = maximum(begin, times[dep][1])
        end = begin + op.duration
        free[op.stream] = end
        times.append((begin, end))
    return times


def step_ops(action: Action, costs: Costs) -> list[NodeOp]:
    """The pieces of a compute action, in the order they are issued (node by node in the
    engine's order when ``costs.nodes`` is set: ``node_steps``)."""
    if costs.nodes is not None:
        return node_ops(action, costs.nodes)  # type: ignore[return-value]
    if action.kind is Kind.OVERLAP:
        return _overlap_ops(action.forward, action.backward, costs)
    return _plain_ops(action, costs)


def time_step(action: Action, start: float, costs: Costs) -> tuple[Segment, ...]:
    """The timed pieces of a compute action started at ``start`` on an otherwise idle rank."""
    ops = step_ops(action, costs)
    return tuple(Segment(op.stream, op.part, op.action, op.layer, begin, end)
                 for op, (begin, end) in zip(ops, op_times(ops, start)))
