"""Plain-torch token permute and unpermute: the reference the Triton kernels are tested against.

Routing is described by two index tensors (built by ``megapipe.moe.dispatcher``):

- ``row_choice [n]``: for each permuted row, the flat routing choice ``token * k + j`` it came from,
  or -1 for a padding row (capacity padding): permute writes zeros there, unpermute ignores it;
- ``choice_rows [t, k]``: for each token and each of its k choices, the permuted row holding it,
  or -1 when that choice was dropped (capacity factor).

``permute_tokens`` gathers token rows into permuted order; ``unpermute_tokens`` sums each token's
rows weighted by its router probabilities. Both are written as gathers over the k choices of a
token, summed in the order j = 0..k-1 in float32, so there are no atomics and the result is
deterministic (the Triton kernels use the same order). Backward is explicit for the same reason.
"""

from __future__ import annotations

import torch


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _gather_sum_choices(
    rows: torch.Tensor, choice_rows: torch.Tensor, weights: torch.Tensor | None
) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * rows[choice_rows[t, j]] over valid choices, in float32
    (float64 for float64 inputs)."""
    num_tokens, top_k = choice_rows.shape
    acc = _accumulate_dtype(rows.dtype)
    out = torch.zeros(num_tokens, rows.shape[1], dtype=acc, device=rows.device)
    rows32 = rows.to(acc)
    for j in range(top_k):
        choice = choice_rows[:, j]
        valid = choice >= 0
        picked = rows32.index_select(0, choice.clamp(min=0))
        if weights is not None:
            picked = picked * weights[:, j : j + 1].to(acc)
        out = out + torch.where(valid.unsqueeze(1), picked, torch.zeros((), device=rows.device))
    return out


def _token_of_row(row_choice: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token index of each row, clamped to 0 for padding rows; whether the row is real)."""
    valid = row_choice >= 0
    return torch.div(row_choice.clamp(min=0), top_k, rounding_mode="floor"), valid


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, row_choice, choice_rows):  # type: ignore[override]
        ctx.save_for_backward(choice_rows)
        ctx.tokens_dtype = tokens.dtype
        token_of_row, valid = _token_of_row(row_choice, choice_rows.shape[1])
        rows = tokens.index_select(0, token_of_row)
        return torch.where(valid.unsqueeze(1), rows, torch.zeros((), dtype=rows.dtype))

    @staticmethod
    def backward(ctx, grad_rows):  # type: ignore[override]
        (choice_rows,) = ctx.saved_tensors
        grad_tokens = _gather_sum_choices(grad_rows, choice_rows, None)
        return grad_tokens.to(ctx.tokens_dtype), None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, probs, row_choice, choice_rows):  # type: ignore[override]
        ctx.save_for_backward(rows, probs, row_choice, choice_rows)
        return _gather_sum_choices(rows, choice_rows, probs).to(rows.dtype)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        rows, probs, row_choice, choice_rows = ctx.saved_tensors
        token_of_row, valid = _token_of_row(row_choice, choice_rows.shape[1])
        acc = _accumulate_dtype(torch.promote_types(rows.dtype, probs.dtype))
        grad_of_row = grad_out.to(acc).index_select(0, token_of_row)
        prob_of_row = probs.reshape(-1).to(acc).index_select(0, row_choice.clamp(min=0))
        prob_of_row = torch.where(valid, prob_of_row, torch.zeros((), dtype=acc))
        grad_rows = (grad_of_row * prob_of_row.unsqueeze(1)).to(rows.dtype)
        grad_probs = None
        if ctx.needs_input_grad[1]:
            per_row = (grad_of_row * rows.to(acc)).sum(dim=1)
            # each choice has at most one row; padding rows go to distinct scratch choices past it
            scratch = probs.numel() + torch.arange(row_choice.numel(), device=row_choice.device)
            flat = torch.zeros(probs.numel() + row_choice.numel(), dtype=acc, device=probs.device)
            flat = flat.index_copy(0, torch.where(valid, row_choice, scratch), per_row)
            grad_probs = flat[: probs.numel()].view_as(probs).to(probs.dtype)
        return grad_rows, grad_probs, None, None


def permute_tokens(
    tokens: torch.Tensor, row_choice: torch.Tensor, choice_rows: torch.Tensor
) -> torch.Tensor:
    """Gather ``tokens [t, h]`` into permuted rows ``[n, h]``: row r is token row_choice[r] // k."""
    return _Permute.apply(tokens, row_choice, choice_rows)


def unpermute_tokens(
    rows: torch.Tensor, probs: torch.Tensor, row_choice: torch.Tensor, choice_rows: torch.Tensor
) -> torch.Tensor:
    """Sum permuted ``rows [n, h]`` back per token, weighted by ``probs [t, k]``: ``[t, h]``."""
    return _Unpermute.apply(rows, probs, row_choice, choice_rows)
