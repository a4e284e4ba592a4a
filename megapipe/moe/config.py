"""``MoEConfig``: the shape and behaviour of one MoE layer (``moe.layer``), checked when made."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megapipe.moe.link import EmulatedLink
from megapipe.moe.router import ROUTER_DTYPES, SCORE_FUNCTIONS


@dataclass
class MoEConfig:
    """Shape and behaviour of one MoE layer (see docs/architecture.md, "MoE layer")."""

    hidden_size: int
    num_experts: int
    top_k: int
    ffn_hidden_size: int  # per expert
    score_function: str = "softmax"  # "softmax" | "sigmoid"
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    capacity_factor: float | None = None  # None: dropless; else padded to the capacity
    # dropless in fixed-size buffers, no host read (moe.rank_capacity); None: off
    rank_capacity_factor: float | None = None
    shared_expert_intermediate_size: int | None = None
    link: EmulatedLink | None = None
    init_std: float = 0.02
    router_dtype: str | None = None  # None: the input's dtype; "fp32" (Megatron's flag)
    # softmax's top-k probabilities as they are (True) or divided by their sum (Megatron's
    # --moe-router-pre-softmax, whose default is off)
    pre_softmax: bool = True
    recompute_activation: bool = False  # --recompute-modules moe_act

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_experts", "top_k", "ffn_hidden_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoEConfig.{name}={getattr(self, name)} must be >= 1")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEConfig.top_k={self.top_k} must be <= num_experts={self.num_experts}"
            )
        if self.score_function not in SCORE_FUNCTIONS:
            raise ValueError(
                f"MoEConfig.score_function={self.score_function!r} is not one of {SCORE_FUNCTIONS}"
            )
        if self.router_dtype not in ROUTER_DTYPES:
            raise ValueError(
                f"MoEConfig.router_dtype={self.router_dtype!r} is not one of {ROUTER_DTYPES}"
            )
        if self.aux_loss_coeff < 0 or self.z_loss_coeff < 0:
            raise ValueError(
                f"MoEConfig aux_loss_coeff={self.aux_loss_coeff} and z_loss_coeff="
                f"{self.z_loss_coeff} must be >= 0"
            )
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(
                f"MoEConfig.capacity_factor={self.capacity_factor} must be > 0 or None (dropless)"
            )
        if self.rank_capacity_factor is not None and (
            self.capacity_factor is not None or not self.rank_capacity_factor > 0
        ):
            raise ValueError(
                f"MoEConfig.rank_capacity_factor={self.rank_capacity_factor} must be > 0, and "
                "it keeps the layer dropless: it excludes capacity_factor (token dropping)"
            )
        if (
            self.shared_expert_intermediate_size is not None
            and self.shared_expert_intermediate_size < 1
        ):
            raise ValueError(
                f"MoEConfig.shared_expert_intermediate_size={self.shared_expert_intermediate_size} "
                "must be >= 1 or None"
            )

    def capacity(self, num_tokens: int) -> int | None:
        """Rows each expert keeps for ``num_tokens`` local tokens (None: dropless)."""
        if self.capacity_factor is None:
            return None
        return max(1, math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts))
