"""The MoE router: scores tokens against experts, picks the top k, and computes the auxiliary
losses that keep experts balanced.

Scoring (``score_function``):
- ``"softmax"``: softmax over all experts, top k of those probabilities used as combine weights
  without renormalisation (``pre_softmax``, Megatron's ``--moe-router-pre-softmax``: Switch/GShard
  style, so the router still learns when k = 1), or divided by their sum (``pre_softmax=False``:
  Megatron's default, Mixtral's, Qwen3-MoE's ``norm_topk_prob``; Megatron takes the softmax of
  the chosen logits, the same numbers up to rounding);
- ``"sigmoid"``: per-expert sigmoid scores, top k, weights normalised to sum to 1 per token
  (DeepSeek-V3 style).

Auxiliary losses (unweighted here; the layer applies the coefficients):
- load balancing (Switch): ``E * sum_e f_e * P_e`` with f_e the fraction of the t*k routing
  choices that picked expert e and P_e the mean score of e (sigmoid scores are first normalised
  per token); equals 1 when routing is uniform;
- z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2, keeping logits small.

Precision (``router_dtype``, Megatron's ``--moe-router-dtype``): the logits GEMM runs in the
input's dtype (None, Megatron's default: bf16 in a bf16 model) or in float32/float64
(``"fp32"``/``"fp64"``: input and weight upcast). Whatever the logits' dtype, softmax/sigmoid,
top-k and both auxiliary losses are computed in at least float32, so a bf16 model picks the
same experts as exact scores would (no ties made by rounding) and its losses stay accurate.
The combine weights ``probs`` are returned in the logits' dtype. Expert counts come from a sort
and ``searchsorted`` (no atomics, no host read).

``Router.reference`` is the definition, in plain torch ops. The MoE layer routes through
``Router.forward``: the logits GEMM, the fused router operator (scores, top-k and the losses'
statistics), the routing rows and the permute, as one autograd function of four operators
forward and four backward (``megapipe.kernels``: one kernel each on CUDA). Its backward is written
by hand: the router operator's backward adds the auxiliary losses' gradients itself (their
coefficients times the layer's ``aux_loss_scale``, known at forward time), so no loss tensor
enters autograd, and the input gradient adds the permute's gradient inside the GEMM (``addmm``).
The losses' values are kept as statistics (``aux_loss.AuxStatistics``) and summed when read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megapipe.kernels import (
    permute_op,
    router_backward_op,
    router_op,
    routing_rows_op,
    sum_choices_op,
)
from megapipe.kernels.reference_fused import stable_top_k
from megapipe.moe.aux_loss import AuxStatistics
from megapipe.moe.permutation import expert_counts
from megapipe.moe.seeding import seeded_normal

SCORE_FUNCTIONS = ("softmax", "sigmoid")
ROUTER_DTYPES = (None, "fp32", "fp64")
_ROUTER_TORCH_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


@dataclass
class RouterOutput:
    """What the router decides for ``t`` tokens."""

    probs: torch.Tensor  # [t, k] combine weights in the logits' dtype (differentiable)
    indices: torch.Tensor  # [t, k] int64 expert of each choice
    load_balancing_loss: torch.Tensor  # scalar, unweighted, differentiable
    z_loss: torch.Tensor  # scalar, unweighted, differentiable


@dataclass
class Routed:
    """The route of ``t`` tokens (``Router.forward``): what the rest of the MoE layer needs."""

    probs: torch.Tensor  # [t, k] combine weights in the logits' dtype (differentiable)
    rows: torch.Tensor  # [n, h] the tokens permuted into expert order (differentiable)
    indices: torch.Tensor  # [t, k] int64 expert of each choice
    row_choice: torch.Tensor  # [n] flat choice of each row (-1: padding), ``sort_by_expert``
    choice_rows: torch.Tensor  # [t, k] row of each choice (-1: dropped)
    counts: torch.Tensor  # [E] routing choices per expert label, before any drop
    aux: AuxStatistics  # the auxiliary losses' value, summed when read


def load_balancing_loss(
    scores: torch.Tensor, indices: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """Switch load-balancing loss from per-token expert scores ``[t, E]`` (rows sum to 1)."""
    num_tokens, top_k = indices.shape
    counts = expert_counts(torch.sort(indices.reshape(-1)).values, num_experts)
    fraction_routed = counts.to(scores.dtype) / (num_tokens * top_k)
    mean_score = scores.mean(dim=0)
    return num_experts * (fraction_routed * mean_score).sum()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean of logsumexp(logits)^2 over tokens."""
    return torch.logsumexp(logits, dim=-1).square().mean()


class Router(nn.Module):
    """Linear scoring of tokens ``[t, h]`` against ``num_experts`` experts, then top-k."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        score_function: str = "softmax",
        seed: int = 0,
        layer_index: int = 0,
        init_std: float = 0.02,
        router_dtype: str | None = None,
        pre_softmax: bool = True,
    ) -> None:
        super().__init__()
        if router_dtype not in ROUTER_DTYPES:
            raise ValueError(f"router_dtype={router_dtype!r} is not one of {ROUTER_DTYPES}")
        if score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"score_function={score_function!r} is not one of {SCORE_FUNCTIONS}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_function = score_function
        self.router_dtype = router_dtype
        self.pre_softmax = pre_softmax
        self.weight = nn.Parameter(
            seeded_normal((num_experts, hidden_size), init_std, seed, "router", layer_index)
        )

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[t, E]`` scores before the score function, in the router's compute dtype."""
        if self.router_dtype is None:
            return torch.nn.functional.linear(tokens, self.weight.to(tokens.dtype))
        dtype = _ROUTER_TORCH_DTYPES[self.router_dtype]
        with torch.autocast(tokens.device.type, enabled=False):  # autocast would undo it
            return torch.nn.functional.linear(tokens.to(dtype), self.weight.to(dtype))

    def reference(self, tokens: torch.Tensor) -> RouterOutput:
        """The router's definition in plain torch ops (differentiable): what ``forward``
        computes with fused operators (tests compare the two)."""
        raw = self.logits(tokens)
        logits = raw.to(torch.promote_types(raw.dtype, torch.float32))
        if self.score_function == "softmax":
            scores = torch.softmax(logits, dim=-1)
            probs, indices = stable_top_k(scores, self.top_k)
            if not self.pre_softmax:
                probs = probs / probs.sum(dim=-1, keepdim=True)
            balance_scores = scores
        else:
            scores = torch.sigmoid(logits)
            top_scores, indices = stable_top_k(scores, self.top_k)
            probs = top_scores / top_scores.sum(dim=-1, keepdim=True)
            balance_scores = scores / scores.sum(dim=-1, keepdim=True)
        return RouterOutput(
            probs=probs.to(raw.dtype),
            indices=indices,
            load_balancing_loss=load_balancing_loss(balance_scores, indices, self.num_experts),
            z_loss=z_loss(logits),
        )

    def forward(
        self,
        tokens: torch.Tensor,
        capacity: int | None = None,
        labels: torch.Tensor | None = None,
        coefficients: tuple[float, float] = (0.0, 0.0),
        loss_scale: float = 1.0,
    ) -> Routed:
        """Route ``tokens [t, h]``: the probs and choices of ``reference``, given rows by
        ``sort_by_expert`` and permuted by ``permute_tokens`` (module docstring), with
        ``capacity`` rows per expert (None: dropless). ``labels [E]``: each
        expert's label for the routing rows (an expert-group order, ``megapipe.moe.waves``; None:
        the expert ids). ``coefficients``: of the load-balancing and z losses; backward adds their
        gradients times ``loss_scale``."""
        balance_grad, z_grad = (c * loss_scale for c in coefficients)
        dtype = None if self.router_dtype is None else _ROUTER_TORCH_DTYPES[self.router_dtype]
        spec = _RouteSpec(
            self.top_k,
            self.score_function == "sigmoid",
            self.num_experts,
            -1 if capacity is None else capacity,
            dtype,
            balance_grad,
            z_grad,
            not self.pre_softmax and self.score_function == "softmax",
        )
        probs, rows, indices, row_choice, choice_rows, counts, partials = _Route.apply(
            tokens, self.weight, labels, spec
        )
        aux = AuxStatistics(partials, counts, labels, tokens.shape[0], self.top_k, *coefficients)
        return Routed(probs, rows, indices, row_choice, choice_rows, counts, aux)


@dataclass(frozen=True)
class _RouteSpec:
    top_k: int
    sigmoid: bool
    num_experts: int
    capacity: int  # -1: dropless
    dtype: torch.dtype | None  # the logits' dtype (None: the tokens', or autocast's)
    balance_grad: float
    z_grad: float
    renormalize: bool  # softmax's top-k probabilities divided by their sum


class _Route(torch.autograd.Function):
    """logits GEMM, router, routing rows, permute: 4 operators forward, 4 backward."""

    @staticmethod
    def forward(ctx, tokens, weight, labels, spec):
        device = tokens.device.type
        dtype = spec.dtype
        if dtype is None:
            autocast = torch.is_autocast_enabled(device)
            dtype = torch.get_autocast_dtype(device) if autocast else tokens.dtype
        tokens_c, weight_c = tokens.to(dtype), weight.to(dtype)
        with torch.autocast(device, enabled=False):  # the dtype is chosen above
            logits = torch.mm(tokens_c, weight_c.t())
        probs, indices, partials = router_op(logits, spec.top_k, spec.sigmoid, spec.renormalize)
        plan_of = indices if labels is None else labels[indices]
        row_choice, choice_rows, counts = routing_rows_op(plan_of, spec.num_experts, spec.capacity)
        rows = permute_op(tokens, row_choice, spec.top_k)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(indices, row_choice, choice_rows, counts, partials)
        ctx.save_for_backward(tokens_c, weight_c, logits, choice_rows, counts, labels)
        ctx.spec, ctx.tokens_dtype, ctx.weight_dtype = spec, tokens.dtype, weight.dtype
        return probs, rows, indices, row_choice, choice_rows, counts, partials

    @staticmethod
    def backward(ctx, grad_probs, grad_rows, *_):
        tokens_c, weight_c, logits, choice_rows, counts, labels = ctx.saved_tensors
        spec = ctx.spec
        d_logits = router_backward_op(
            grad_probs,
            logits,
            counts,
            labels,
            spec.top_k,
            spec.sigmoid,
            spec.balance_grad,
            spec.z_grad,
            spec.renormalize,
        )
        d_permute = None if grad_rows is None else sum_choices_op(grad_rows, None, choice_rows)
        if d_permute is not None and d_permute.dtype == d_logits.dtype:
            d_tokens = torch.addmm(d_permute, d_logits, weight_c)
        else:
            d_tokens = torch.mm(d_logits, weight_c).to(ctx.tokens_dtype)
            if d_permute is not None:
                d_tokens = d_tokens + d_permute
        d_weight = torch.mm(d_logits.t(), tokens_c).to(ctx.weight_dtype)
        return d_tokens, d_weight, None, None
