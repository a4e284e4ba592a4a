"""Triton kernels for token permute (gather) and unpermute (weighted sum), with autograd.

Same index conventions (padding rows included) and summation order as
``megapipe.kernels.reference``: every kernel is a gather over a token's k routing choices summed in
order j = 0..k-1 in float32, so no atomics are used and results are deterministic run to run.
Programs are laid out one per (row, block of hidden columns); the unpermute backward walks the
hidden dimension in blocks because it also reduces over it (the probability gradient).

Triton decides at import time whether kernels are compiled or interpreted (``TRITON_INTERPRET=1``
must be set before this module is first imported); the interpreter runs them on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_H = 128


@triton.jit
def _permute_kernel(tokens, row_choice, out, hidden, top_k, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    choice = tl.load(row_choice + row) + tl.zeros([BLOCK], dtype=tl.int64)
    valid = mask & (choice >= 0)  # a padding row (choice -1) gets zeros
    token = tl.where(valid, choice, 0) // top_k
    values = tl.load(tokens + token * hidden + cols, mask=valid, other=0.0)
    tl.store(out + row.to(tl.int64) * hidden + cols, values, mask=mask)


@triton.jit
def _sum_choices_kernel(
    rows, probs, choice_rows, out, hidden, top_k, HAS_PROBS: tl.constexpr, BLOCK: tl.constexpr
):
    """out[t] = sum_j probs[t, j] * rows[choice_rows[t, j]] (probs optional), float32 sum."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(top_k):
        choice = tl.load(choice_rows + token * top_k + j) + tl.zeros([BLOCK], dtype=tl.int64)
        valid = mask & (choice >= 0)  # a dropped choice (choice -1) contributes nothing
        safe = tl.where(valid, choice, 0)
        values = tl.load(rows + safe * hidden + cols, mask=valid, other=0.0).to(tl.float32)
        if HAS_PROBS:
            weight = tl.load(probs + token * top_k + j).to(tl.float32)
            values = values * weight
        acc = acc + values
    tl.store(out + token * hidden + cols, acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _unpermute_backward_kernel(
    grad_out, rows, probs, row_choice, grad_rows, grad_probs, hidden, top_k, scratch,
    BLOCK: tl.constexpr,
):
    """grad_rows[r] = p * grad_out[t]; grad_probs[choice] = <grad_out[t], rows[r]>; a padding
    row (choice -1) gets a zero gradient and writes its dot product to the scratch entry
    ``grad_probs[scratch]`` (discarded), so no real entry is written twice."""
    row = tl.program_id(0).to(tl.int64)
    choice = tl.load(row_choice + row)
    valid = choice >= 0
    target = tl.where(valid, choice, scratch)
    choice = tl.maximum(choice, 0)
    token = choice // top_k
    weight = tl.where(valid, tl.load(probs + choice).to(tl.float32), 0.0)
    dot = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < hidden
        grad = tl.load(grad_out + token * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        values = tl.load(rows + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(
            grad_rows + row * hidden + cols,
            (grad * weight).to(grad_rows.dtype.element_ty),
            mask=mask,
        )
        dot = dot + grad * values
    tl.store(grad_probs + target, tl.sum(dot, axis=0))


def _grid(num_rows: int, hidden: int) -> tuple[int, int]:
    return (num_rows, triton.cdiv(hidden, BLOCK_H))


def _sum_choices(
    rows: torch.Tensor, probs: torch.Tensor | None, choice_rows: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    num_tokens, top_k = choice_rows.shape
    hidden = rows.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=dtype, device=rows.device)
    if num_tokens and hidden:
        weights = probs.contiguous() if probs is not None else choice_rows  # unused when absent
        _sum_choices_kernel[_grid(num_tokens, hidden)](
            rows.contiguous(),
            weights,
            choice_rows.contiguous(),
            out,
            hidden,
            top_k,
            HAS_PROBS=probs is not None,
            BLOCK=BLOCK_H,
        )
    return out


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, row_choice, choice_rows):  # type: ignore[override]
        ctx.save_for_backward(choice_rows)
        hidden = tokens.shape[1]
        out = torch.empty(row_choice.numel(), hidden, dtype=tokens.dtype, device=tokens.device)
        if row_choice.numel() and hidden:
            _permute_kernel[_grid(row_choice.numel(), hidden)](
                tokens.contiguous(),
                row_choice.contiguous(),
                out,
                hidden,
                choice_rows.shape[1],
                BLOCK=BLOCK_H,
            )
        return out

    @staticmethod
    def backward(ctx, grad_rows):  # type: ignore[override]
        (choice_rows,) = ctx.saved_tensors
        return _sum_choices(grad_rows, None, choice_rows, grad_rows.dtype), None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, probs, row_choice, choice_rows):  # type: ignore[override]
        ctx.save_for_backward(rows, probs, row_choice)
        return _sum_choices(rows, probs, choice_rows, rows.dtype)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        rows, probs, row_choice = ctx.saved_tensors
        num_rows, hidden = rows.shape
        grad_rows = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
        grad_probs = torch.zeros(probs.numel() + 1, dtype=torch.float32, device=probs.device)
        if num_rows and hidden:
            _unpermute_backward_kernel[(num_rows,)](
                grad_out.contiguous(),
                rows.contiguous(),
                probs.contiguous(),
                row_choice.contiguous(),
                grad_rows,
                grad_probs,
                hidden,
                probs.shape[1],
                probs.numel(),
                BLOCK=BLOCK_H,
            )
        grad_probs = grad_probs[: probs.numel()]
        return grad_rows, grad_probs.view_as(probs).to(probs.dtype), None, None


def permute_tokens(
    tokens: torch.Tensor, row_choice: torch.Tensor, choice_rows: torch.Tensor
) -> torch.Tensor:
    """Triton version of ``reference.permute_tokens``."""
    return _Permute.apply(tokens, row_choice, choice_rows)


def unpermute_tokens(
    rows: torch.Tensor, probs: torch.Tensor, row_choice: torch.Tensor, choice_rows: torch.Tensor
) -> torch.Tensor:
    """Triton version of ``reference.unpermute_tokens``."""
    return _Unpermute.apply(rows, probs, row_choice, choice_rows)
