"""Triton kernels for token permute (gather) and unpermute (weighted sum), one launch each.

Same index conventions (padding rows included) and summation order as
``megapipe.kernels.reference``: every kernel is a gather over a token's k routing choices summed in
order j = 0..k-1 in float32, so no atomics are used and results are deterministic run to run.
One program per row (permute, unpermute backward) or per token (the choice sums) walks the hidden
dimension in blocks of up to ``MAX_BLOCK`` columns: each program then moves whole rows with wide
vector loads. (The first GPU run had one program per 128-column block: 256-byte programs, 24 %
of the copy bandwidth for the permute.) Tiling changes no sum: each output element is still
summed over its choices in order j = 0..k-1.

Triton decides at import time whether kernels are compiled or interpreted (``TRITON_INTERPRET=1``
must be set before this module is first imported); the interpreter runs them on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .library import KERNEL_OPTIONS

MAX_BLOCK = 2048  # columns per block: 4 KB of bf16 per block, 8 to 16 bytes per thread


@triton.jit
def _permute_kernel(tokens, row_choice, out, hidden, top_k, BLOCK: tl.constexpr):
    """out[r] = tokens[row_choice[r] // k]; a padding row (choice -1) gets zeros."""
    row = tl.program_id(0).to(tl.int64)
    choice = tl.load(row_choice + row).to(tl.int64)
    source = tokens + tl.maximum(choice, 0) // top_k * hidden
    target = out + row * hidden
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < hidden
        valid = mask & ((choice + tl.zeros([BLOCK], dtype=tl.int64)) >= 0)
        values = tl.load(source + cols, mask=valid, other=0.0)
        tl.store(target + cols, values, mask=mask)


@triton.jit
def _sum_choices_kernel(
    rows, probs, choice_rows, out, hidden, top_k, HAS_PROBS: tl.constexpr, BLOCK: tl.constexpr
):
    """out[t] = sum_j probs[t, j] * rows[choice_rows[t, j]] (probs optional), float32 sum."""
    token = tl.program_id(0).to(tl.int64)
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < hidden
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in range(top_k):
            choice = tl.load(choice_rows + token * top_k + j).to(tl.int64)
            # a dropped choice (choice -1) contributes nothing
            valid = mask & ((choice + tl.zeros([BLOCK], dtype=tl.int64)) >= 0)
            values = tl.load(
                rows + tl.maximum(choice, 0) * hidden + cols, mask=valid, other=0.0
            ).to(tl.float32)
            if HAS_PROBS:
                weight = tl.load(probs + token * top_k + j).to(tl.float32)
                values = values * weight
            acc = acc + values
        tl.store(out + token * hidden + cols, acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _unpermute_backward_kernel(
    grad_out,
    rows,
    probs,
    row_choice,
    choice_rows,
    grad_rows,
    grad_probs,
    num_rows,
    hidden,
    top_k,
    BLOCK: tl.constexpr,
    K_BLOCK: tl.constexpr,
):
    """Programs 0..n-1, one per row r: grad_rows[r] = p * grad_out[t] and grad_probs[choice] =
    <grad_out[t], rows[r]> (a padding row, choice -1, gets zeros and writes no probability).
    Programs n..n+t-1, one per token: zeros into the token's dropped choices (choice_rows -1),
    which no row writes. Every entry is written by exactly one program: no atomics, no memset."""
    pid = tl.program_id(0).to(tl.int64)
    if pid < num_rows:
        row = pid
        choice = tl.load(row_choice + row)
        valid = choice >= 0
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
        tl.store(
            grad_probs + choice, tl.sum(dot, axis=0).to(grad_probs.dtype.element_ty), mask=valid
        )
    else:
        token = pid - num_rows
        j = tl.arange(0, K_BLOCK)
        in_k = j < top_k
        slots = tl.load(choice_rows + token * top_k + j, mask=in_k, other=0)
        zeros = tl.zeros([K_BLOCK], dtype=tl.float32).to(grad_probs.dtype.element_ty)
        tl.store(grad_probs + token * top_k + j, zeros, mask=in_k & (slots < 0))


def _block(hidden: int) -> dict[str, int]:
    """The column block and warps of a row-walking kernel for rows of ``hidden`` entries."""
    block = min(MAX_BLOCK, triton.next_power_of_2(hidden))
    return {"BLOCK": block, "num_warps": 8 if block >= 2048 else 4 if block >= 512 else 2}


def sum_choices(
    rows: torch.Tensor, probs: torch.Tensor | None, choice_rows: torch.Tensor
) -> torch.Tensor:
    """``reference.sum_choices``: one launch."""
    num_tokens, top_k = choice_rows.shape
    hidden = rows.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=rows.dtype, device=rows.device)
    if num_tokens and hidden:
        weights = probs.contiguous() if probs is not None else choice_rows  # unused when absent
        _sum_choices_kernel[(num_tokens,)](
            rows.contiguous(),
            weights,
            choice_rows.contiguous(),
            out,
            hidden,
            top_k,
            HAS_PROBS=probs is not None,
            **_block(hidden),
            **KERNEL_OPTIONS,
        )
    return out


def permute(tokens: torch.Tensor, row_choice: torch.Tensor, top_k: int) -> torch.Tensor:
    """``reference.permute``: one launch."""
    hidden = tokens.shape[1]
    out = torch.empty(row_choice.numel(), hidden, dtype=tokens.dtype, device=tokens.device)
    if row_choice.numel() and hidden:
        _permute_kernel[(row_choice.numel(),)](
            tokens.contiguous(),
            row_choice.contiguous(),
            out,
            hidden,
            top_k,
            **_block(hidden),
            **KERNEL_OPTIONS,
        )
    return out


def unpermute_backward(
    grad_out: torch.Tensor,
    rows: torch.Tensor,
    probs: torch.Tensor,
    row_choice: torch.Tensor,
    choice_rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.unpermute_backward``: one launch."""
    num_rows, hidden = rows.shape
    num_tokens, top_k = choice_rows.shape
    grad_rows = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
    grad_probs = torch.empty(probs.shape, dtype=probs.dtype, device=probs.device)
    if num_rows + num_tokens:
        _unpermute_backward_kernel[(num_rows + num_tokens,)](
            grad_out.contiguous(),
            rows.contiguous(),
            probs.contiguous(),
            row_choice.contiguous(),
            choice_rows.contiguous(),
            grad_rows,
            grad_probs,
            num_rows,
            hidden,
            top_k,
            K_BLOCK=triton.next_power_of_2(top_k),
            **_block(max(hidden, 1)),
            **KERNEL_OPTIONS,
        )
    return grad_rows, grad_probs
