"""Several layers as one node plan: what full recompute with ``uniform`` and N > 1 recomputes.

``group_plans(plans)`` chains the plans of N consecutive layers into one plan. Where a layer
ends with a compute node and the next begins with one (a MoE layer's finish, then the next
layer's attention; two dense layers), the two become one compute node, so the tensor between
them (the layer output) is no longer a node boundary: recomputed (``recompute.full``),
that node keeps only its inputs and makes the layer output again inside its backward. A group of
dense layers thus becomes a single node that keeps only the group's input, as Megatron's
uniform method does; in a group of MoE layers the all-to-alls still separate nodes (they are
never run again, so their outputs stay), and only the layer outputs inside the group go.

Each layer of a group gets its own state, of its plan's state type (its routing metadata must
not meet another layer's); the group's state (``GroupState``), the one the engine sees, sets its
own ``wgrad_queue`` and ``recomputing`` on each of them. The chained plan runs the very ops of
the layers in the same order, so results are bitwise those of the layers one by one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, overload

from megapipe.overlap.plan import Fork, LayerState, Node, NodeKind, Plan, WavePlan, state_type_of

Items = list[Any]
_ENGINE_FIELDS = frozenset(f.name for f in fields(LayerState))


@dataclass(eq=False, slots=True, init=False)
class GroupState(LayerState):
    """The state of a group of layers: per layer (its index in the group) its own state, made
    on first use; what the engine sets here (``LayerState``'s fields) is set on each part."""

    # no default after LayerState's fields with one: no generated __init__ (init=False) needs it
    parts: dict[int, LayerState]  # type: ignore[misc]

    def __init__(self) -> None:
        object.__setattr__(self, "parts", {})
        LayerState.__init__(self)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in _ENGINE_FIELDS:
            for part in self.parts.values():
                setattr(part, name, value)

    def crossing(self, reader: NodeKind) -> tuple[Any, ...]:
        """Every part's ``crossing`` tensors."""
        return tuple(t for part in self.parts.values() for t in part.crossing(reader))

    def part(self, index: int, state_type: type[LayerState]) -> LayerState:
        """Layer ``index``'s state (a ``state_type``), made with the engine's fields as set."""
        part = self.parts.get(index)
        if part is None:
            part = self.parts[index] = state_type(
                wgrad_queue=self.wgrad_queue, recomputing=self.recomputing
            )
        return part


def _in_part(node: Node, index: int, state_type: type[LayerState]) -> Node:
    def fn(state: GroupState, inputs: tuple) -> tuple:
        return node.fn(state.part(index, state_type), inputs)

    return replace(node, fn=fn)


def _joined(first: Node, second: Node) -> Node:
    def fn(state: LayerState, inputs: tuple) -> tuple:
        return second.fn(state, first.fn(state, inputs))

    return Node(f"{first.name}+{second.name}", NodeKind.COMPUTE, fn)


def _chain(plans: Sequence[Sequence[Any]]) -> Items:
    out: Items = []
    for index, plan in enumerate(plans):
        state_type = state_type_of(plan)
        items = [
            Fork(
                tuple(tuple(_in_part(n, index, state_type) for n in b) for b in item.branches),
                item.width,
            )
            if isinstance(item, Fork)
            else _in_part(item, index, state_type)
            for item in plan
        ]
        last = out[-1] if out else None
        head = items[0]
        if (
            isinstance(last, Node)
            and last.kind == NodeKind.COMPUTE
            and isinstance(head, Node)
            and head.kind == NodeKind.COMPUTE
        ):
            out[-1] = _joined(last, head)
            items = items[1:]
        out += items
    return out


@overload
def group_plans(plans: Sequence[Plan]) -> Plan: ...
@overload
def group_plans(plans: Sequence[Sequence[Any]]) -> Items: ...
def group_plans(plans: Sequence[Sequence[Any]]) -> Items:
    """The layers ``plans`` (in order) as one plan (module docstring); a ``WavePlan`` among
    them makes the group one too (its wave form chains the layers' wave forms)."""
    if not plans:
        raise ValueError("group_plans needs at least one layer plan")
    if len(plans) == 1:
        return plans[0] if isinstance(plans[0], Plan) else list(plans[0])
    if not any(isinstance(p, WavePlan) for p in plans):
        return Plan(_chain(plans), GroupState)

    def in_waves(waves: int) -> Items:
        forms: list[Callable[[int], Any] | None] = [
            p.in_waves if isinstance(p, WavePlan) else None for p in plans
        ]
        return _chain([p if f is None else f(waves) for p, f in zip(plans, forms)])

    return WavePlan(_chain(plans), in_waves, GroupState)
