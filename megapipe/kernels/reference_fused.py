"""Plain-torch definitions of the fused operators (``megapipe.kernels``): RMSNorm, the SwiGLU
activation, the router's scores and top-k, and the routing rows.

These are the CPU implementations of ``megapipe::<name>`` and the references the Triton kernels
(``triton_norm``, ``triton_router``) are tested against. Forwards perform exactly the ops the
model used before they were fused, so CPU forwards keep their bits; backwards are written by
hand (docs/precision.md says what that changed in rounding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

STAT_BLOCK = 32  # tokens per row of the router's partial sums (the Triton kernel's tile)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


# --- RMSNorm ---------------------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``y = (x * rstd * weight)`` in float32 (float64 for float64 input), rounded once to
    ``x.dtype``: bitwise ``nn.RMSNorm`` (``F.rms_norm``) on CPU; and ``rstd [rows]``, for the
    backward."""
    acc = _acc(x.dtype)
    x32 = x.to(acc)
    rstd = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True).add_(eps))
    y = (x32 * rstd * weight.to(acc)).to(x.dtype)
    return y, rstd.reshape(-1)


def rms_norm_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    residual_grad: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) of ``rms_norm``; ``residual_grad`` (another gradient of ``x``, e.g. of a
    residual branch) is added to dx before it is rounded once to ``x.dtype``. In float32:
    ``x_hat = x * rstd``, ``g = grad * weight``, ``dx = rstd * (g - x_hat * mean(g * x_hat))``,
    ``dweight = sum over rows of grad * x_hat``."""
    acc = _acc(x.dtype)
    h = x.shape[-1]
    x_hat = x.reshape(-1, h).to(acc) * rstd.unsqueeze(1)
    dy = grad.reshape(-1, h).to(acc)
    g = dy * weight.to(acc)
    dx = rstd.unsqueeze(1) * (g - x_hat * (g * x_hat).mean(dim=-1, keepdim=True))
    if residual_grad is not None:
        dx = dx + residual_grad.reshape(-1, h).to(acc)
    dweight = (dy * x_hat).sum(dim=0)
    return dx.to(x.dtype).view(x.shape), dweight.to(weight.dtype)


# --- SwiGLU activation -----------------------------------------------------------------------


def swiglu(gate: torch.Tensor, up: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """``silu(gate) * up``, per block of ``counts`` rows (one expert each): on CPU a tensor's
    last elements are computed in a scalar tail, so one expert's bits would depend on where its
    rows lie (a layer in waves runs one expert group at a time)."""
    return torch.cat([F.silu(g) * u for g, u in zip(gate.split(counts), up.split(counts))])


def swiglu_backward(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, counts: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) of ``swiglu``, per block of ``counts`` rows as autograd computes them."""
    d_gate, d_up = [], []
    for dy, g, u in zip(grad.split(counts), gate.split(counts), up.split(counts)):
        d_gate.append(torch.ops.aten.silu_backward(dy * u, g))
        d_up.append(dy * F.silu(g))
    return torch.cat(d_gate), torch.cat(d_up)


# --- router ----------------------------------------------------------------------------------


def stable_top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the ``k`` largest scores of each row, largest first. The tie rule,
    shared with the Triton router: among equal scores the lowest expert index comes first
    (``torch.topk`` leaves ties unspecified, and with bf16 logits they are common)."""
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k].contiguous(), indices[..., :k].contiguous()


def router_scores(
    logits: torch.Tensor, top_k: int, sigmoid: bool, renormalize: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probs [t, k] float, indices [t, k], balance scores [t, E], scores [t, E]) in at least
    float32, as the router computes them (``megapipe.moe.router``); ``renormalize``: softmax's
    top-k probabilities divided by their sum (sigmoid's always are)."""
    x = logits.to(_acc(logits.dtype))
    if not sigmoid:
        scores = torch.softmax(x, dim=-1)
        probs, indices = stable_top_k(scores, top_k)
        if renormalize:
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs, indices, scores, scores
    scores = torch.sigmoid(x)
    top, indices = stable_top_k(scores, top_k)
    probs = top / top.sum(dim=-1, keepdim=True)
    return probs, indices, scores / scores.sum(dim=-1, keepdim=True), scores


def router(
    logits: torch.Tensor, top_k: int, sigmoid: bool, renormalize: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``probs [t, k]`` in the logits' dtype, ``indices [t, k]`` int64 and ``partials [b, E+1]``
    (at least float32): per block of ``STAT_BLOCK`` tokens, the sum of each expert's balance
    score and, last, the sum of logsumexp(logits)^2: the auxiliary losses' statistics, summed
    over the blocks when the loss value is read (``megapipe.moe.router.AuxStatistics``)."""
    probs, indices, balance, _ = router_scores(logits, top_k, sigmoid, renormalize)
    x = logits.to(_acc(logits.dtype))
    stats = torch.cat([balance, torch.logsumexp(x, dim=-1).square().unsqueeze(1)], dim=1)
    blocks = -(-stats.shape[0] // STAT_BLOCK)
    padded = F.pad(stats, (0, 0, 0, blocks * STAT_BLOCK - stats.shape[0]))
    partials = padded.view(blocks, STAT_BLOCK, stats.shape[1]).sum(dim=1)
    return probs.to(logits.dtype), indices, partials


def router_backward(
    grad_probs: torch.Tensor | None,
    logits: torch.Tensor,
    counts: torch.Tensor,
    labels: torch.Tensor | None,
    top_k: int,
    sigmoid: bool,
    balance_grad: float,
    z_grad: float,
    renormalize: bool = False,
) -> torch.Tensor:
    """d logits of ``probs`` (given ``grad_probs``) plus ``balance_grad`` x the load-balancing
    loss and ``z_grad`` x the z-loss, in the logits' dtype. ``counts [E]`` are the routing
    choices per expert label and ``labels [E]`` (None: identity) each expert's label.

    Load balancing ``E * sum_e f_e * mean_t bs[t, e]`` with ``f_e = counts_e / (t k)`` has
    d/d bs[t, e] = ``E f_e / t``; z-loss ``mean_t lse_t^2`` has d/d logits = ``2 lse_t
    softmax / t``; the rest is the chain rule through softmax (and the top-k renormalisation),
    or through sigmoid and the two normalisations."""
    x = logits.to(_acc(logits.dtype))
    t, num_experts = x.shape
    probs, indices, balance, scores = router_scores(logits, top_k, sigmoid, renormalize)
    per_expert = (counts if labels is None else counts[labels]).to(x.dtype)
    a = (balance_grad * num_experts / (t * top_k * t)) * per_expert  # d loss / d balance[t, e]
    g = torch.zeros_like(x) if grad_probs is None else grad_probs.to(x.dtype)
    if not sigmoid:
        upstream = a.expand(t, num_experts)
        if grad_probs is not None:
            if renormalize:  # probs = top / sum(top): d top = (g - sum(g * probs)) / sum(top)
                chosen = torch.gather(scores, 1, indices).sum(dim=-1, keepdim=True)
                g = (g - (g * probs).sum(dim=-1, keepdim=True)) / chosen
            upstream = upstream.scatter_add(1, indices, g)
        d = scores * (upstream - (upstream * scores).sum(dim=-1, keepdim=True))
    else:
        total = scores.sum(dim=-1, keepdim=True)
        d_scores = (a - (a * balance).sum(dim=-1, keepdim=True)) / total
        if grad_probs is not None:
            chosen = torch.gather(scores, 1, indices).sum(dim=-1, keepdim=True)
            d_top = (g - (g * probs).sum(dim=-1, keepdim=True)) / chosen
            d_scores = d_scores.scatter_add(1, indices, d_top)
        d = d_scores * scores * (1 - scores)
    if z_grad:
        lse = torch.logsumexp(x, dim=-1, keepdim=True)
        d = d + (2 * z_grad / t) * lse * torch.exp(x - lse)
    return d.to(logits.dtype)


# --- routing rows ----------------------------------------------------------------------------


def expert_counts(sorted_experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Choices per expert ``[E]`` (int64) from the expert ids sorted in increasing order."""
    bounds = torch.arange(num_experts + 1, device=sorted_experts.device, dtype=sorted_experts.dtype)
    edges = torch.searchsorted(sorted_experts, bounds)
    return edges[1:] - edges[:-1]


def routing_rows(
    indices: torch.Tensor, num_experts: int, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``row_choice [n]``, ``choice_rows [t, k]`` and ``counts [E]`` (choices per expert before
    any drop) of ``megapipe.moe.permutation.sort_by_expert``; ``capacity`` -1: dropless."""
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    counts = expert_counts(sorted_experts, num_experts)
    num_choices = flat.numel()
    if capacity < 0:
        choice_rows = torch.empty(num_choices, dtype=torch.int64, device=flat.device)
        choice_rows.scatter_(0, order, torch.arange(num_choices, device=flat.device))
        return order, choice_rows.view_as(indices), counts
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(num_choices, device=flat.device) - starts[sorted_experts]
    kept = position < capacity
    padded_rows = num_experts * capacity
    # dropped choices go to distinct scratch rows past the end, so every index is unique
    row = torch.where(
        kept,
        sorted_experts * capacity + position,
        padded_rows + torch.arange(num_choices, device=flat.device),
    )
    row_choice = torch.full((padded_rows + num_choices,), -1, dtype=torch.int64, device=flat.device)
    row_choice.scatter_(0, row, order)
    choice_rows = torch.empty(num_choices, dtype=torch.int64, device=flat.device)
    choice_rows.scatter_(0, order, torch.where(kept, row, -1))
    return row_choice[:padded_rows].clone(), choice_rows.view_as(indices), counts
