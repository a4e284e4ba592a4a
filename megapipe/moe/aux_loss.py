"""Auxiliary router losses: attached to the activations and logged per layer.

The MoE layer's router adds the losses' gradients in its own backward (``Router.forward``) and
logs their value as ``AuxStatistics``: the statistics its fused operator leaves (per block of
tokens, the sums of each expert's balance score and of logsumexp^2; the routing choices per
expert), summed only when the value is read, so the forward issues no reduction for a value
that is only logged. ``attach_aux_loss`` remains for a loss computed as a tensor.

The router's losses are not returned to the training loop; instead ``attach_aux_loss`` ties the
loss to an activation so backward injects its gradient (``scale``, e.g. 1/num_microbatches set
by the executor through ``MoELayer.aux_loss_scale``) exactly when that activation's gradient
arrives. This works unchanged when the overlap engine drives each node's backward itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, activation, aux_loss, scale):
        ctx.scale = scale
        ctx.aux_shape = aux_loss.shape
        ctx.aux_dtype = aux_loss.dtype
        return activation.view_as(activation)

    @staticmethod
    def backward(ctx, grad_activation):
        grad_aux = torch.full(
            ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad_activation.device
        )
        return grad_activation, grad_aux, None


def attach_aux_loss(activation: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
    """Return ``activation`` unchanged; its backward also backpropagates ``scale * aux_loss``."""
    return _AttachAuxLoss.apply(activation, aux_loss, scale)


@dataclass
class AuxStatistics:
    """One forward's auxiliary-loss value, unsummed: ``value()`` is
    ``balance_coeff * E * sum_e f_e * P_e + z_coeff * mean_t logsumexp_t^2`` with ``f_e`` the
    share of the t * k routing choices that picked expert e and ``P_e`` its mean balance score
    over the t tokens."""

    partials: torch.Tensor  # [blocks, E + 1]: per block of tokens, balance-score sums, lse^2 sum
    counts: torch.Tensor  # [E] choices per expert label
    labels: torch.Tensor | None  # [E] each expert's label (None: its id)
    num_tokens: int
    top_k: int
    balance_coeff: float
    z_coeff: float

    def value(self) -> torch.Tensor:
        """The loss value (a scalar in the statistics' dtype)."""
        sums = self.partials.sum(dim=0)
        num_experts, t = sums.shape[0] - 1, self.num_tokens
        counts = (self.counts if self.labels is None else self.counts[self.labels]).to(sums.dtype)
        balance = num_experts / (t * self.top_k * t) * (counts * sums[:-1]).sum()
        return self.balance_coeff * balance + self.z_coeff * sums[-1] / t


class AuxLossLog:
    """Detached auxiliary-loss values of one layer's forwards, for logging (no globals)."""

    def __init__(self) -> None:
        self._values: list[torch.Tensor | AuxStatistics] = []

    def record(self, value: torch.Tensor | AuxStatistics) -> None:
        """Keep ``value`` (a loss tensor, detached, or statistics summed when read)."""
        self._values.append(value if isinstance(value, AuxStatistics) else value.detach())

    def __len__(self) -> int:
        return len(self._values)

    def values(self) -> list[torch.Tensor]:
        """Every value recorded since the last pop or take, in order (summed now)."""
        return [v.value() if isinstance(v, AuxStatistics) else v for v in self._values]

    def mean(self) -> torch.Tensor | None:
        """Mean of the values recorded since the last pop or take (None if none)."""
        if not self._values:
            return None
        return torch.stack(self.values()).mean()

    def pop_mean(self) -> torch.Tensor | None:
        """``mean()``, and forget the values."""
        mean = self.mean()
        self._values = []
        return mean

    def pop_all(self) -> list[torch.Tensor]:
        """``values()``, and forget them."""
        values = self.values()
        self._values = []
        return values

    def take(self) -> AuxLossLog:
        """A log of the values recorded since the last pop or take, which this one forgets:
        nothing is summed, so a caller that may never read them pays nothing for them."""
        taken = AuxLossLog()
        taken._values, self._values = self._values, []
        return taken
