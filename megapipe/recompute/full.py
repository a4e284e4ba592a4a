"""Full recompute, node by node: a compute node keeps only its inputs and runs its forward
again inside its own backward.

``recompute_plan(plan, params)`` returns the layer plan with every compute node wrapped so that
autograd saves the node's inputs only (the tensors it reads from the layer input or from an
earlier node, which the tape holds at the node boundary anyway) instead of everything its ops
would save. The node's backward runs the node function again on those inputs and
differentiates the fresh graph. Comm nodes (the all-to-alls) are left as they are: they save
nothing, and they are never run again, so their outputs stay as the inputs of the compute
nodes after them. In a combined step a node's backward runs in its own slot, so the recompute
sits beside the other microbatch's all-to-all like the rest of that backward.

Bitwise: the first forward happens with grad enabled and the same ``requires_grad`` flags as without
recompute (the same kernels), its graph dropped at once; the backward re-runs the same ops on
the same inputs and differentiates with the gradients the graph would have received, leaving
out the outputs plain autograd leaves out. ``params`` (the layer's parameters) are inputs of the
wrapping autograd function, so their gradients flow back through autograd's own accumulation
(or stay deferred, when an op puts them in the state's ``wgrad_queue``), and the zero-bubble
I/W split sees them.

Side effects: the recompute happens with ``state.recomputing`` set, so a node function skips what
must happen once per forward (the MoE layer's aux-loss log) and reads what it fixed then (the
aux-loss scale) from its state. The reference model draws no random numbers (no dropout), so
there is no RNG state to restore; a node that draws any cannot be recomputed bitwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, overload

import torch

from megapipe.overlap.plan import Fork, LayerState, Node, NodeFn, NodeKind, Plan
from megapipe.recompute.function import detached_leaves

Tensors = tuple[torch.Tensor, ...]


def _tensors(values: Sequence[Any], where: str) -> Tensors:
    for value in values:
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"a recomputed node's {where} must be tensors, got {type(value).__name__}"
            )
    return tuple(values)


class _NodeRecompute(torch.autograd.Function):
    """Saves the node's inputs only; the backward runs the node again and differentiates it."""

    @staticmethod
    def forward(
        ctx, fn: NodeFn, state: LayerState, num_inputs: int, *tensors: torch.Tensor
    ) -> Tensors:
        inputs, params = tensors[:num_inputs], tensors[num_inputs:]
        ctx.fn, ctx.state, ctx.params = fn, state, params
        ctx.save_for_backward(*inputs)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None
        with torch.enable_grad():  # the grad mode of a run without recompute: same kernels
            outputs = _tensors(fn(state, detached_leaves(inputs)), "outputs")
        ctx.mark_non_differentiable(*(o for o in outputs if not o.requires_grad))
        return tuple(o.detach() for o in outputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        inputs = detached_leaves(ctx.saved_tensors)
        state: LayerState = ctx.state
        state.recomputing = True
        try:
            with torch.enable_grad():
                outputs = ctx.fn(state, inputs)
        finally:
            state.recomputing = False
        roots, root_grads = [], []
        for out, grad in zip(outputs, grads):  # what plain autograd would start from
            if grad is not None and out.requires_grad:
                roots.append(out)
                root_grads.append(grad)
        wanted = [x for x in inputs + tuple(ctx.params) if x.requires_grad]
        found = iter(
            torch.autograd.grad(roots, wanted, root_grads, allow_unused=True)
            if roots
            else [None] * len(wanted)
        )
        input_grads = tuple(
            next(found) if x.requires_grad else None for x in inputs + tuple(ctx.params)
        )
        return (None, None, None, *input_grads)


def recompute_node(node: Node, params: Sequence[torch.Tensor]) -> Node:
    """``node`` saving only its inputs (module docstring); a comm node is returned as is.
    ``params``: every parameter the node may use (its layer's)."""
    if node.kind != NodeKind.COMPUTE:
        return node
    params = tuple(params)

    def fn(state: LayerState, inputs: tuple) -> Tensors:
        inputs = _tensors(inputs, "inputs")
        if not torch.is_grad_enabled() or not any(x.requires_grad for x in inputs + params):
            return tuple(node.fn(state, inputs))  # nothing to save: run it plainly
        return _NodeRecompute.apply(node.fn, state, len(inputs), *inputs, *params)

    return replace(node, fn=fn, graphable=None)  # a recomputing node is never captured


@overload
def recompute_plan(plan: Plan, params: Sequence[torch.Tensor]) -> Plan: ...
@overload
def recompute_plan(plan: Sequence[Any], params: Sequence[torch.Tensor]) -> list[Any]: ...
def recompute_plan(plan: Sequence[Any], params: Sequence[torch.Tensor]) -> list[Any]:
    """Every compute node of ``plan`` (also inside a ``Fork``) recomputed; a ``Plan`` stays
    one of its kind and state type (a ``WavePlan``'s wave forms recomputed too)."""

    def wrap(items: Sequence[Any]) -> list[Any]:
        out: list[Any] = []
        for item in items:
            if isinstance(item, Fork):
                branches = tuple(tuple(recompute_node(n, params) for n in b) for b in item.branches)
                out.append(Fork(branches, item.width))
            else:
                out.append(recompute_node(item, params))
        return out

    return plan.wrapped(wrap) if isinstance(plan, Plan) else wrap(plan)


RECOMPUTE_METHODS = ("uniform", "block")
"""Megatron's ``--recompute-method`` values megapipe supports (with full granularity)."""


def check_full_recompute(method: str | None, num_layers: int) -> None:
    """Raise ``ValueError`` naming a bad full-recompute setting (method or layer count)."""
    if method is not None and method not in RECOMPUTE_METHODS:
        raise ValueError(
            f"recompute method {method!r} is not one of {', '.join(RECOMPUTE_METHODS)}"
        )
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"recompute num_layers={num_layers!r} must be an int >= 1")
