"""Auxiliary router losses: attached to the activations and logged per layer.

The router's losses are not returned to the training loop; instead ``attach_aux_loss`` ties the
loss to an activation so backward injects its gradient (``scale``, e.g. 1/num_microbatches set
by the executor through ``MoELayer.aux_loss_scale``) exactly when that activation's gradient
arrives. This works unchanged when the overlap engine drives each node's backward itself.
"""

from __future__ import annotations

import torch


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, activation, aux_loss, scale):  # type: ignore[override]
        ctx.scale = scale
        ctx.aux_shape = aux_loss.shape
        ctx.aux_dtype = aux_loss.dtype
        return activation.view_as(activation)

    @staticmethod
    def backward(ctx, grad_activation):  # type: ignore[override]
        grad_aux = torch.full(
            ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad_activation.device
        )
        return grad_activation, grad_aux, None


def attach_aux_loss(activation: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
    """Return ``activation`` unchanged; its backward also backpropagates ``scale * aux_loss``."""
    return _AttachAuxLoss.apply(activation, aux_loss, scale)


class AuxLossLog:
    """Detached auxiliary-loss values of one layer's forwards, for logging (no globals)."""

    def __init__(self) -> None:
        self._values: list[torch.Tensor] = []

    def record(self, value: torch.Tensor) -> None:
        self._values.append(value.detach())

    def __len__(self) -> int:
        return len(self._values)

    def pop_mean(self) -> torch.Tensor | None:
        """Mean of the values recorded since the last call (None if none), and forget them."""
        if not self._values:
            return None
        mean = torch.stack(self._values).mean()
        self._values.clear()
        return mean

    def pop_all(self) -> list[torch.Tensor]:
        """Every value recorded since the last pop, in order, and forget them."""
        values, self._values = self._values, []
        return values
