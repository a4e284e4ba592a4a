"""megapipe.kernels: fused operators (one Triton kernel each on CUDA, plain torch on CPU) and the
autograd functions the model uses them through.

The operators (``torch.ops.megapipe.<name>``, ``library.py``): ``permute``, ``sum_choices``,
``unpermute_backward`` (token permute/unpermute, ``reference.py``), ``rms_norm`` and
``rms_norm_backward``, ``swiglu`` and ``swiglu_backward``, ``router`` and ``router_backward``,
``routing_rows`` (``reference_fused.py``). On CUDA with Triton each is exactly one kernel launch;
on CPU each runs its plain-torch reference, so a CPU run issues the same operators as a GPU run
(what ``benchmarks/launch_count.py`` counts). The router's autograd function lives with the
router (``megapipe.moe.router``); the others are here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import reference, reference_fused
from .library import HAS_TRITON, define

permute_op = define(
    "permute(Tensor tokens, Tensor row_choice, int top_k) -> Tensor",
    reference.permute,
    ("triton_permute", "permute"),
)
sum_choices_op = define(
    "sum_choices(Tensor rows, Tensor? probs, Tensor choice_rows) -> Tensor",
    reference.sum_choices,
    ("triton_permute", "sum_choices"),
)
unpermute_backward_op = define(
    "unpermute_backward(Tensor grad_out, Tensor rows, Tensor probs, Tensor row_choice, "
    "Tensor choice_rows) -> (Tensor, Tensor)",
    reference.unpermute_backward,
    ("triton_permute", "unpermute_backward"),
)
rms_norm_op = define(
    "rms_norm(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)",
    reference_fused.rms_norm,
    ("triton_norm", "rms_norm"),
)
rms_norm_backward_op = define(
    "rms_norm_backward(Tensor grad, Tensor x, Tensor weight, Tensor rstd, "
    "Tensor? residual_grad) -> (Tensor, Tensor)",
    reference_fused.rms_norm_backward,
    ("triton_norm", "rms_norm_backward"),
)
swiglu_op = define(
    "swiglu(Tensor gate, Tensor up, int[] counts) -> Tensor",
    reference_fused.swiglu,
    ("triton_norm", "swiglu"),
)
swiglu_backward_op = define(
    "swiglu_backward(Tensor grad, Tensor gate, Tensor up, int[] counts) -> (Tensor, Tensor)",
    reference_fused.swiglu_backward,
    ("triton_norm", "swiglu_backward"),
)
router_op = define(
    "router(Tensor logits, int top_k, bool sigmoid, bool renormalize=False) "
    "-> (Tensor, Tensor, Tensor)",
    reference_fused.router,
    ("triton_router", "router"),
)
router_backward_op = define(
    "router_backward(Tensor? grad_probs, Tensor logits, Tensor counts, Tensor? labels, "
    "int top_k, bool sigmoid, float balance_grad, float z_grad, bool renormalize=False) "
    "-> Tensor",
    reference_fused.router_backward,
    ("triton_router", "router_backward"),
)
routing_rows_op = define(
    "routing_rows(Tensor indices, int num_experts, int capacity) -> (Tensor, Tensor, Tensor)",
    reference_fused.routing_rows,
    ("triton_router", "routing_rows"),
)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, row_choice, choice_rows):
        ctx.save_for_backward(choice_rows)
        return permute_op(tokens, row_choice, choice_rows.shape[1])

    @staticmethod
    def backward(ctx, grad_rows):
        (choice_rows,) = ctx.saved_tensors
        return sum_choices_op(grad_rows, None, choice_rows), None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, probs, row_choice, choice_rows):
        ctx.save_for_backward(rows, probs, row_choice, choice_rows)
        return sum_choices_op(rows, probs, choice_rows)

    @staticmethod
    def backward(ctx, grad_out):
        grad_rows, grad_probs = unpermute_backward_op(grad_out, *ctx.saved_tensors)
        return grad_rows, grad_probs, None, None


def permute_tokens(
    tokens: torch.Tensor, row_choice: torch.Tensor, choice_rows: torch.Tensor
) -> torch.Tensor:
    """Gather ``tokens [t, h]`` into permuted rows ``[n, h]`` (row r is token row_choice[r] // k);
    one operator forward, one backward."""
    return _Permute.apply(tokens, row_choice, choice_rows)


def unpermute_tokens(
    rows: torch.Tensor, probs: torch.Tensor, row_choice: torch.Tensor, choice_rows: torch.Tensor
) -> torch.Tensor:
    """Sum permuted ``rows [n, h]`` back per token weighted by ``probs [t, k]``: ``[t, h]``; one
    operator forward, one backward."""
    return _Unpermute.apply(rows, probs, row_choice, choice_rows)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, pass_input):
        y, rstd = rms_norm_op(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return (y, x.view_as(x)) if pass_input else y

    @staticmethod
    def backward(ctx, grad, *residual_grad):
        x, weight, rstd = ctx.saved_tensors
        residual = residual_grad[0] if residual_grad else None
        if grad is None:  # only the passed-through input is used
            return residual, None, None, None
        dx, dweight = rms_norm_backward_op(grad, x, weight, rstd, residual)
        return dx, dweight, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, as ``nn.RMSNorm`` (``reference_fused.rms_norm``): one
    operator forward, one backward (dx and dweight)."""
    return _RMSNorm.apply(x, weight, eps, False)


def rms_norm_residual(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x), x)``: the second is ``x`` for a residual branch, whose gradient the
    norm's one backward operator adds to its own instead of autograd adding the two."""
    return _RMSNorm.apply(x, weight, eps, True)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, counts):
        ctx.save_for_backward(gate, up)
        ctx.counts = counts
        return swiglu_op(gate, up, counts)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        d_gate, d_up = swiglu_backward_op(grad, gate, up, ctx.counts)
        return d_gate, d_up, None


def swiglu(gate: torch.Tensor, up: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """``silu(gate) * up`` for expert-major rows, ``counts`` rows per expert: one operator
    forward, one backward."""
    return _SwiGLU.apply(gate, up, list(counts))


__all__ = [
    "HAS_TRITON",
    "permute_tokens",
    "reference",
    "reference_fused",
    "rms_norm",
    "rms_norm_residual",
    "swiglu",
    "unpermute_tokens",
]
