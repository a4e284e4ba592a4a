"""Activation recompute: keep a function's inputs instead of what its backward would save, and
run the function again inside the backward of the node that holds it.

``recompute(fn, *inputs)`` returns ``fn(*inputs)`` but its autograd graph saves only ``inputs``
(tensors the model holds anyway, e.g. views of the node's own earlier results). Its backward
re-runs ``fn`` on those inputs, then backpropagates through the fresh graph. Because that
backward is part of the node's backward, the recompute runs exactly where the node's backward
runs: in a combined step, beside the other microbatch's all-to-all.

Bitwise: the forward runs with the same grad mode and ``requires_grad`` flags as without
recompute (so the same kernels are chosen, on every device), its graph dropped at once, and the
backward differentiates the identical recompute with the gradients the graph would have received.
``fn`` must be a pure function of its tensor arguments (no parameters, no random numbers): the
attention core and the experts' activation are (``RECOMPUTE_MODULES``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

RECOMPUTE_MODULES = ("core_attn", "moe_act")
"""The ``--recompute-modules`` megapipe supports (Megatron's names): the attention core
(softmax(q k^T) v) and the activation of the experts' SwiGLU (silu(gate) * up)."""


def detached_leaves(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Detached inputs that require grad exactly when the originals do."""
    return tuple(x.detach().requires_grad_(x.requires_grad) for x in inputs)


class _Recompute(torch.autograd.Function):
    """Saves the inputs only; the backward runs ``fn`` again and differentiates it."""

    @staticmethod
    def forward(ctx, fn: Callable, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.fn = fn
        ctx.save_for_backward(*inputs)
        with torch.enable_grad():  # the grad mode of a run without recompute: same kernels
            output = fn(*detached_leaves(inputs))
        return output.detach()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        inputs = detached_leaves(ctx.saved_tensors)
        with torch.enable_grad():
            output = ctx.fn(*inputs)
        wanted = [x for x in inputs if x.requires_grad]
        grads = iter(torch.autograd.grad(output, wanted, grad_output, allow_unused=True))
        return (None, *(next(grads) if x.requires_grad else None for x in inputs))


def recompute(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    """``fn(*inputs)``, saving only ``inputs`` for backward (module docstring). Without grad
    (no input needs one, or grad mode off) it is just ``fn(*inputs)``."""
    if not torch.is_grad_enabled() or not any(x.requires_grad for x in inputs):
        return fn(*inputs)
    return _Recompute.apply(fn, *inputs)


def check_recompute_modules(modules: tuple[str, ...]) -> None:
    """Raise ``ValueError`` naming a module megapipe cannot recompute."""
    for name in modules:
        if name not in RECOMPUTE_MODULES:
            raise ValueError(
                f"recompute module {name!r} is not supported; supported: "
                f"{', '.join(RECOMPUTE_MODULES)}"
            )
