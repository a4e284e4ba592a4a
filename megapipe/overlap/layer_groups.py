"""Several layers as one node plan: what full recompute with ``uniform`` and N > 1 recomputes.

``group_plans(plans)`` chains the plans of N consecutive layers into one plan. Where a layer
ends with a compute node and the next begins with one (a MoE layer's finish, then the next
layer's attention; two dense layers), the two become one compute node, so the tensor between
them (the layer output) is no longer a node boundary: recomputed (``overlap.full_recompute``),
that node keeps only its inputs and makes the layer output again inside its backward. A group of
dense layers thus becomes a single node that keeps only the group's input, as Megatron's
uniform method does; in a group of MoE layers the all-to-alls still separate nodes (they are
never run again, so their outputs stay), and only the layer outputs inside the group go.

Each layer of a group gets its own ``LayerState`` (its routing metadata must not meet another
layer's); the group's state, the one the engine sees, lends them its ``wgrad_queue`` and
``recomputing``. The chained plan runs the very ops of the layers in the same order, so results
are bitwise those of the layers one by one.
"""

from __future__ import annotations

from dataclasses import replace

from typing import Any, Callable, Sequence

from megapipe.overlap.plan import Fork, LayerState, Node, NodeKind, Plan, WavePlan

Items = list[Any]


class _PartState(LayerState):
    """One layer's state inside a group: its own metadata; the engine's fields are the group's."""

    def __init__(self, group: LayerState) -> None:  # not the dataclass __init__: no own fields
        self._group = group

    @property  # type: ignore[override]
    def wgrad_queue(self):  # noqa: D401 - the group's queue, set by the engine at backward
        return self._group.wgrad_queue

    @property  # type: ignore[override]
    def recomputing(self) -> bool:
        return self._group.recomputing


def _part(state: LayerState, index: int) -> LayerState:
    parts = state.__dict__.setdefault("layer_parts", {})
    if index not in parts:
        parts[index] = _PartState(state)
    return parts[index]


def _in_part(node: Node, index: int) -> Node:
    def fn(state: LayerState, inputs: tuple) -> tuple:
        return node.fn(_part(state, index), inputs)

    return replace(node, fn=fn)


def _joined(first: Node, second: Node) -> Node:
    def fn(state: LayerState, inputs: tuple) -> tuple:
        return second.fn(state, first.fn(state, inputs))

    return Node(f"{first.name}+{second.name}", NodeKind.COMPUTE, fn)


def _chain(plans: Sequence[Sequence[Any]]) -> Items:
    out: Items = []
    for index, plan in enumerate(plans):
        items = [
            Fork(tuple(tuple(_in_part(n, index) for n in b) for b in item.branches), item.width)
            if isinstance(item, Fork) else _in_part(item, index)
            for item in plan
        ]
        last = out[-1] if out else None
        head = items[0]
        if (isinstance(last, Node) and last.kind == NodeKind.COMPUTE
                and isinstance(head, Node) and head.kind == NodeKind.COMPUTE):
            out[-1] = _joined(last, head)
            items = items[1:]
        out += items
    return out


def group_plans(plans: Sequence[Sequence[Any]]) -> Items:
    """The layers ``plans`` (in order) as one plan (module docstring); a ``WavePlan`` among
    them makes the group one too (its wave form chains the layers' wave forms)."""
    if not plans:
        raise ValueError("group_plans needs at least one layer plan")
    if len(plans) == 1:
        return plans[0] if isinstance(plans[0], Plan) else list(plans[0])
    if not any(isinstance(p, WavePlan) for p in plans):
        return Plan(_chain(plans))

    def in_waves(waves: int) -> Items:
        forms: list[Callable[[int], Any] | None] = [
            p.in_waves if isinstance(p, WavePlan) else None for p in plans
        ]
        return _chain([p if f is None else f(waves) for p, f in zip(plans, forms)])

    return WavePlan(_chain(plans), in_waves)
