"""Plain-torch token permute and unpermute: the reference the Triton kernels are tested against.

Routing is described by two index tensors (built by ``megapipe.moe.permutation``):

- ``row_choice [n]``: for each permuted row, the flat routing choice ``token * k + j`` it came from,
  or -1 for a padding row (capacity padding): permute writes zeros there, unpermute ignores it;
- ``choice_rows [t, k]``: for each token and each of its k choices, the permuted row holding it,
  or -1 when that choice was dropped (capacity factor).

``permute`` gathers token rows into permuted order; ``sum_choices`` sums each token's rows,
weighted by its router probabilities (unpermute) or not (the backward of permute). Both are
gathers over the k choices of a token, summed in the order j = 0..k-1 in float32, so there are
no atomics and the result is deterministic (the Triton kernels use the same order).
``unpermute_backward`` gives the gradients of the rows and of the probabilities. These are the
CPU implementations of the operators ``megapipe::permute``, ``megapipe::sum_choices`` and
``megapipe::unpermute_backward`` (``megapipe.kernels``).
"""

from __future__ import annotations

import torch


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def sum_choices(
    rows: torch.Tensor, probs: torch.Tensor | None, choice_rows: torch.Tensor
) -> torch.Tensor:
    """out[t] = sum_j probs[t, j] * rows[choice_rows[t, j]] over valid choices (probs None: 1),
    summed in float32 (float64 for float64 inputs), rounded once to ``rows.dtype``."""
    num_tokens, top_k = choice_rows.shape
    acc = _accumulate_dtype(rows.dtype)
    out = torch.zeros(num_tokens, rows.shape[1], dtype=acc, device=rows.device)
    rows32 = rows.to(acc)
    for j in range(top_k):
        choice = choice_rows[:, j]
        valid = choice >= 0
        picked = rows32.index_select(0, choice.clamp(min=0))
        if probs is not None:
            picked = picked * probs[:, j : j + 1].to(acc)
        out = out + torch.where(valid.unsqueeze(1), picked, torch.zeros((), device=rows.device))
    return out.to(rows.dtype)


def _token_of_row(row_choice: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token index of each row, clamped to 0 for padding rows; whether the row is real)."""
    valid = row_choice >= 0
    return torch.div(row_choice.clamp(min=0), top_k, rounding_mode="floor"), valid


def permute(tokens: torch.Tensor, row_choice: torch.Tensor, top_k: int) -> torch.Tensor:
    """Rows ``[n, h]``: row r is token ``row_choice[r] // top_k`` (zeros for a padding row)."""
    token_of_row, valid = _token_of_row(row_choice, top_k)
    rows = tokens.index_select(0, token_of_row)
    return torch.where(valid.unsqueeze(1), rows, torch.zeros((), dtype=rows.dtype))


def unpermute_backward(
    grad_out: torch.Tensor,
    rows: torch.Tensor,
    probs: torch.Tensor,
    row_choice: torch.Tensor,
    choice_rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``sum_choices(rows, probs, choice_rows)``: (rows' in their dtype, probs' in
    theirs; zero for padding rows and dropped choices)."""
    token_of_row, valid = _token_of_row(row_choice, choice_rows.shape[1])
    acc = _accumulate_dtype(torch.promote_types(rows.dtype, probs.dtype))
    grad_of_row = grad_out.to(acc).index_select(0, token_of_row)
    prob_of_row = probs.reshape(-1).to(acc).index_select(0, row_choice.clamp(min=0))
    prob_of_row = torch.where(valid, prob_of_row, torch.zeros((), dtype=acc))
    grad_rows = (grad_of_row * prob_of_row.unsqueeze(1)).to(rows.dtype)
    per_row = (grad_of_row * rows.to(acc)).sum(dim=1)
    # each choice has at most one row; padding rows go to distinct scratch choices past it
    scratch = probs.numel() + torch.arange(row_choice.numel(), device=row_choice.device)
    flat = torch.zeros(probs.numel() + row_choice.numel(), dtype=acc, device=probs.device)
    flat = flat.index_copy(0, torch.where(valid, row_choice, scratch), per_row)
    return grad_rows, flat[: probs.numel()].view_as(probs).to(probs.dtype)
