"""Triton kernels for the router (scores, top-k and the auxiliary losses' statistics, forward and
backward) and for the routing rows: one launch each, the definitions of ``reference_fused``.

The router kernels run one program per ``STAT_BLOCK`` tokens (forward; the backward per tile),
holding every expert of a tile of those tokens at once (experts padded to a power of two, at
most ``TILE`` elements a tile, so nothing spills up to 256 experts and top-8): softmax or
sigmoid in float32 (float64 for float64 logits is the reference's), top-k by k rounds of max
with its index (the tie rule of ``reference_fused.stable_top_k``: among equal scores the lowest
expert first), the chosen weights divided by their sum (sigmoid always; softmax when
``RENORMALIZE``, Megatron's ``--no-moe-router-pre-softmax``), and each program's sums of the
balance scores and of logsumexp^2 as one row of ``partials``. The backward recomputes scores
and top-k from the logits instead of saving them.

The routing rows runs a grid of experts x parts of the choices (``rows_parts``: aiming at
``ROWS_PROGRAMS`` programs). Program (e, p) counts, in one pass over every choice, those of
lower experts and those of e before its part (its first row), then walks its part with a
running count (a stable counting sort), so each choice and each row is written by exactly one
program: deterministic, no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference_fused
from .library import KERNEL_OPTIONS
from .reference_fused import STAT_BLOCK

ROWS_BLOCK = 1024  # choices a rows program reads at once
ROWS_GRAIN = 256  # a part of the choices holds a multiple of this many choices
ROWS_PROGRAMS = 264  # at least, when the choices allow: 2 per SM of an H100 (132 SMs)
TILE = 1024  # elements of a router tile: 8 a thread per [rows, experts] array at 4 warps


@triton.jit
def _scores(
    logits, first, t, num_experts, BT: tl.constexpr, EB: tl.constexpr, SIGMOID: tl.constexpr
):
    """Rows ``first..first+BT``: (x, row mask, column mask, scores, logsumexp) in float32."""
    rows = first + tl.arange(0, BT)
    cols = tl.arange(0, EB)
    row_mask = rows < t
    col_mask = cols < num_experts
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(
        logits + rows[:, None].to(tl.int64) * num_experts + cols[None, :],
        mask=mask,
        other=float("-inf"),
    ).to(tl.float32)
    x = tl.where(row_mask[:, None], x, tl.where(col_mask[None, :], 0.0, float("-inf")))
    top = tl.max(x, axis=1)
    e = tl.exp(x - top[:, None])
    total = tl.sum(e, axis=1)
    lse = top + tl.log(total)
    if SIGMOID:
        scores = tl.where(col_mask[None, :], tl.sigmoid(x), 0.0)
    else:
        scores = e / total[:, None]
    return x, rows, row_mask, col_mask, scores, lse


@triton.jit
def _router_kernel(
    logits,
    probs,
    indices,
    partials,
    t,
    num_experts,
    K: tl.constexpr,
    SIGMOID: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BT: tl.constexpr,
    SUB: tl.constexpr,
    EB: tl.constexpr,
    KB: tl.constexpr,
):
    """Program p: tokens p*BT .. p*BT+BT-1 in tiles of SUB rows; row p of ``partials``."""
    pid = tl.program_id(0)
    cols = tl.arange(0, EB)
    ks = tl.arange(0, KB)
    column_sums = tl.zeros([EB], dtype=tl.float32)
    lse_squares = tl.zeros([SUB], dtype=tl.float32)
    for tile in range(0, BT // SUB):
        x, rows, row_mask, col_mask, scores, lse = _scores(
            logits, pid * BT + tile * SUB, t, num_experts, SUB, EB, SIGMOID
        )
        work = tl.where(col_mask[None, :], scores, -1.0)  # scores are >= 0
        values = tl.zeros([SUB, KB], dtype=tl.float32)
        chosen = tl.zeros([SUB, KB], dtype=tl.int32)
        for j in tl.static_range(K):
            best, index = tl.max(
                work, axis=1, return_indices=True, return_indices_tie_break_left=True
            )
            values = tl.where(ks[None, :] == j, best[:, None], values)
            chosen = tl.where(ks[None, :] == j, index[:, None], chosen)
            work = tl.where(cols[None, :] == index[:, None], -2.0, work)
        if SIGMOID or RENORMALIZE:
            values = values / tl.sum(tl.where(ks[None, :] < K, values, 0.0), axis=1)[:, None]
        if SIGMOID:
            balance = scores / tl.sum(scores, axis=1)[:, None]
        else:
            balance = scores
        out_mask = row_mask[:, None] & (ks[None, :] < K)
        out = rows[:, None].to(tl.int64) * K + ks[None, :]
        tl.store(probs + out, values.to(probs.dtype.element_ty), mask=out_mask)
        tl.store(indices + out, chosen.to(tl.int64), mask=out_mask)
        balance = tl.where(row_mask[:, None] & col_mask[None, :], balance, 0.0)
        column_sums += tl.sum(balance, axis=0)
        lse_squares += tl.where(row_mask, lse * lse, 0.0)
    base = partials + pid.to(tl.int64) * (num_experts + 1)
    tl.store(base + cols, column_sums, mask=cols < num_experts)
    tl.store(base + num_experts, tl.sum(lse_squares, axis=0))


@triton.jit
def _chosen(
    work,
    cols,
    grad_probs,
    rows,
    row_mask,
    K: tl.constexpr,
    HAS_GRAD: tl.constexpr,
    BT: tl.constexpr,
    EB: tl.constexpr,
):
    """The top ``K`` of ``work`` (scores, -1 at padding), the lowest index first on ties as in
    the forward: ``work`` with -2 at the chosen experts, the incoming ``grad_probs`` spread to
    the chosen experts' columns, and per row the chosen scores' sum and their sum weighted by
    ``grad_probs``. Inlined into the backward kernel (a helper, not a second launch)."""
    spread = tl.zeros([BT, EB], dtype=tl.float32)  # grad_probs at the chosen experts
    chosen_sum = tl.zeros([BT], dtype=tl.float32)
    weighted = tl.zeros([BT], dtype=tl.float32)  # sum_j g_j * top_j
    for j in tl.static_range(K):
        best, index = tl.max(work, axis=1, return_indices=True, return_indices_tie_break_left=True)
        hit = cols[None, :] == index[:, None]
        if HAS_GRAD:
            g = tl.load(grad_probs + rows.to(tl.int64) * K + j, mask=row_mask, other=0.0).to(
                tl.float32
            )
        else:
            g = tl.zeros([BT], dtype=tl.float32)
        spread += tl.where(hit, g[:, None], 0.0)
        chosen_sum += best
        weighted += g * best
        work = tl.where(hit, -2.0, work)  # -2: chosen
    return work, spread, chosen_sum, weighted


@triton.jit
def _router_backward_kernel(
    grad_probs,
    logits,
    counts,
    labels,
    d_logits,
    t,
    num_experts,
    balance_scale,
    z_scale,
    K: tl.constexpr,
    SIGMOID: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_GRAD: tl.constexpr,
    HAS_LABELS: tl.constexpr,
    HAS_Z: tl.constexpr,
    BT: tl.constexpr,
    EB: tl.constexpr,
):
    pid = tl.program_id(0)
    x, rows, row_mask, col_mask, scores, lse = _scores(
        logits, pid * BT, t, num_experts, BT, EB, SIGMOID
    )
    cols = tl.arange(0, EB)
    if HAS_LABELS:
        label = tl.load(labels + cols, mask=col_mask, other=0)
    else:
        label = cols
    per_expert = tl.load(counts + label, mask=col_mask, other=0).to(tl.float32)
    a = balance_scale * per_expert  # d loss / d balance score, per expert
    work = tl.where(col_mask[None, :], scores, -1.0)
    work, spread, chosen_sum, weighted = _chosen(
        work, cols, grad_probs, rows, row_mask, K, HAS_GRAD, BT, EB
    )
    if SIGMOID or RENORMALIZE:
        # probs_j = top_j / S: d top_j = (g_j - sum_i g_i probs_i) / S
        d_top = (spread - (weighted / chosen_sum)[:, None]) / chosen_sum[:, None]
        spread = tl.where(work == -2.0, d_top, 0.0)
    if SIGMOID:
        total = tl.sum(scores, axis=1)
        balance = scores / total[:, None]
        d_scores = (a[None, :] - tl.sum(a[None, :] * balance, axis=1)[:, None]) / total[:, None]
        d = (d_scores + spread) * scores * (1.0 - scores)
    else:
        upstream = a[None, :] + spread
        d = scores * (upstream - tl.sum(upstream * scores, axis=1)[:, None])
    if HAS_Z:
        d += (z_scale * lse)[:, None] * tl.exp(x - lse[:, None])
    mask = row_mask[:, None] & col_mask[None, :]
    tl.store(
        d_logits + rows[:, None].to(tl.int64) * num_experts + cols[None, :],
        d.to(d_logits.dtype.element_ty),
        mask=mask,
    )


def _tile(num_experts: int) -> tuple[int, int]:
    """(experts padded to a power of two, token rows per tile: at most ``TILE`` elements a
    tile, so a program's few [rows, experts] arrays stay in registers)."""
    experts = triton.next_power_of_2(num_experts)
    return experts, min(STAT_BLOCK, max(1, TILE // experts))


def router(
    logits: torch.Tensor, top_k: int, sigmoid: bool, renormalize: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``reference_fused.router``: one launch."""
    if logits.dtype == torch.float64:
        return reference_fused.router(logits, top_k, sigmoid, renormalize)
    t, num_experts = logits.shape
    blocks = triton.cdiv(t, STAT_BLOCK)
    probs = torch.empty(t, top_k, dtype=logits.dtype, device=logits.device)
    indices = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    partials = torch.empty(blocks, num_experts + 1, dtype=torch.float32, device=logits.device)
    if blocks:
        experts, rows = _tile(num_experts)
        _router_kernel[(blocks,)](
            logits.contiguous(),
            probs,
            indices,
            partials,
            t,
            num_experts,
            K=top_k,
            SIGMOID=sigmoid,
            RENORMALIZE=renormalize and not sigmoid,
            BT=STAT_BLOCK,
            SUB=rows,
            EB=experts,
            KB=triton.next_power_of_2(top_k),
            num_warps=8,
            **KERNEL_OPTIONS,
        )
    return probs, indices, partials


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
    """``reference_fused.router_backward``: one launch."""
    if logits.dtype == torch.float64:
        return reference_fused.router_backward(
            grad_probs, logits, counts, labels, top_k, sigmoid, balance_grad, z_grad, renormalize
        )
    t, num_experts = logits.shape
    d_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    experts, rows = _tile(num_experts)
    if t:
        _router_backward_kernel[(triton.cdiv(t, rows),)](
            grad_probs.contiguous() if grad_probs is not None else logits,
            logits.contiguous(),
            counts,
            labels if labels is not None else counts,
            d_logits,
            t,
            num_experts,
            balance_grad * num_experts / (t * top_k * t),
            2.0 * z_grad / t,
            K=top_k,
            SIGMOID=sigmoid,
            RENORMALIZE=renormalize and not sigmoid and grad_probs is not None,
            HAS_GRAD=grad_probs is not None,
            HAS_LABELS=labels is not None,
            HAS_Z=z_grad != 0.0,
            BT=rows,
            EB=experts,
            num_warps=4,
            **KERNEL_OPTIONS,
        )
    return d_logits


@triton.jit
def _rows_kernel(flat, row_choice, choice_rows, counts, n, capacity, part, BLOCK: tl.constexpr):
    """Program (e, p): the choices of expert e in part p (choices p*part .. p*part+part-1).
    One pass over every choice counts those of lower experts and those of e before the part
    (its first row); then it walks its part with a running count (a stable counting sort).
    Part 0 also writes e's count and, with a capacity, e's padding rows."""
    expert = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1).to(tl.int64) * part
    below = tl.full([], 0, tl.int64)
    before = tl.full([], 0, tl.int64)
    own = tl.full([], 0, tl.int64)
    for start in range(0, n, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        valid = offsets < n
        e = tl.load(flat + offsets, mask=valid, other=-1)
        hit = e == expert
        below += tl.sum((valid & (e < expert)).to(tl.int64), axis=0)
        before += tl.sum((hit & (offsets < first)).to(tl.int64), axis=0)
        own += tl.sum(hit.to(tl.int64), axis=0)
    if first == 0:
        tl.store(counts + expert, own)
    seen = before
    for start in range(0, part, BLOCK):
        offsets = first + start + tl.arange(0, BLOCK)
        inside = (offsets < n) & (offsets < first + part)
        hit = inside & (tl.load(flat + offsets, mask=inside, other=-1) == expert)
        position = seen + tl.cumsum(hit.to(tl.int64), axis=0) - 1
        if capacity < 0:
            row = below + position
            tl.store(row_choice + row, offsets.to(tl.int64), mask=hit)
            tl.store(choice_rows + offsets, row, mask=hit)
        else:
            kept = position < capacity
            row = expert * capacity + position
            tl.store(row_choice + row, offsets.to(tl.int64), mask=hit & kept)
            tl.store(choice_rows + offsets, tl.where(kept, row, -1), mask=hit)
        seen += tl.sum(hit.to(tl.int64), axis=0)
    if (capacity >= 0) & (first == 0):
        for start in range(0, capacity, BLOCK):
            slot = start + tl.arange(0, BLOCK)
            padding = (slot < capacity) & (slot >= own)
            tl.store(
                row_choice + expert * capacity + slot, tl.full([BLOCK], -1, tl.int64), mask=padding
            )


def rows_parts(n: int, num_experts: int) -> tuple[int, int]:
    """(parts, choices a part) of the routing rows's grid of experts x parts of the choices:
    parts of ``ROWS_GRAIN`` choices or a multiple, enough of them for ``ROWS_PROGRAMS``
    programs in all when the choices allow."""
    parts = max(1, min(triton.cdiv(ROWS_PROGRAMS, num_experts), triton.cdiv(n, ROWS_GRAIN)))
    part = triton.cdiv(triton.cdiv(max(n, 1), parts), ROWS_GRAIN) * ROWS_GRAIN
    return triton.cdiv(max(n, 1), part), part


def routing_rows(
    indices: torch.Tensor, num_experts: int, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``reference_fused.routing_rows``: one launch."""
    n = indices.numel()
    rows = n if capacity < 0 else num_experts * capacity
    row_choice = torch.empty(rows, dtype=torch.int64, device=indices.device)
    choice_rows = torch.empty(indices.shape, dtype=torch.int64, device=indices.device)
    counts = torch.empty(num_experts, dtype=torch.int64, device=indices.device)
    parts, part = rows_parts(n, num_experts)
    _rows_kernel[(num_experts, parts)](
        indices.contiguous(),
        row_choice,
        choice_rows,
        counts,
        n,
        capacity,
        part,
        BLOCK=ROWS_BLOCK,
        **KERNEL_OPTIONS,
    )
    return row_choice, choice_rows, counts
