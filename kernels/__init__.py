"""megapipe.kernels: token permute/unpermute kernels (Triton) with a plain-torch reference.

``permute_tokens`` and ``unpermute_tokens`` run the Triton kernels on CUDA tensors when Triton
is installed, and the plain-torch reference (``megapipe.kernels.reference``) otherwise. See the
reference module for the index conventions (``row_choice``, ``choice_rows``).
"""

from __future__ import annotations

import importlib.util

import torch

from . import reference

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _use_triton(tensor: torch.Tensor) -> bool:
    return HAS_TRITON and tensor.is_cuda


def permute_tokens(
    tokens: torch.Tensor, row_choice: torch.Tensor, choice_rows: torch.Tensor
) -> torch.Tensor:
    """Gather ``tokens [t, h]`` into permuted rows ``[n, h]`` (row r is token row_choice[r] // k)."""
    if _use_triton(tokens):
        from . import triton_permute

        return triton_permute.permute_tokens(tokens, row_choice, choice_rows)
    return reference.permute_tokens(tokens, row_choice, choice_rows)


def unpermute_tokens(
    rows: torch.Tensor, probs: torch.Tensor, row_choice: torch.Tensor, choice_rows: torch.Tensor
) -> torch.Tensor:
    """Sum permuted ``rows [n, h]`` back per token weighted by ``probs [t, k]``: ``[t, h]``."""
    if _use_triton(rows):
        from . import triton_permute

        return triton_permute.unpermute_tokens(rows, probs, row_choice, choice_rows)
    return reference.unpermute_tokens(rows, probs, row_choice, choice_rows)


__all__ = ["permute_tokens", "unpermute_tokens", "HAS_TRITON", "reference"]
