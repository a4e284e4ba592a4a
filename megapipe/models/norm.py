"""RMSNorm as one fused operator forward and one backward (``megapipe.kernels.rms_norm``).

The parameter (``weight``) and the forward's numbers are ``nn.RMSNorm``'s, so state dicts and
checkpoints are unchanged; the backward computes dx and dweight in one operator (on CUDA one
Triton kernel) in float32, and ``with_residual=True`` lets it add a residual branch's gradient too.
"""

from __future__ import annotations

import torch
from torch import nn

from megapipe.kernels import rms_norm, rms_norm_residual


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension with a learned scale, as ``nn.RMSNorm(hidden, eps)``."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(
        self, x: torch.Tensor, with_residual: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The norm of ``x``; with ``with_residual``, ``(norm, x)``: use the second for the
        residual branch, so the norm's backward operator adds that branch's gradient to its
        own (one operator instead of two). Always through the module call, so forward hooks
        (the distributed optimizer's parameter-gather waits) see it."""
        if with_residual:
            return rms_norm_residual(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
