"""megapipe.moe: router, all-to-all token dispatcher, grouped experts and the MoE layer."""

from megapipe.moe.aux_loss import AuxLossLog, attach_aux_loss
from megapipe.moe.dispatcher import DispatchPlan, TokenDispatcher, all_to_all, plan_permutation
from megapipe.moe.experts import GroupedExperts, SwiGLUMLP
from megapipe.moe.layer import MoEConfig, MoELayer, pass_leading
from megapipe.moe.link import EmulatedLink
from megapipe.moe.router import Router, RouterOutput

__all__ = [
    "AuxLossLog",
    "DispatchPlan",
    "EmulatedLink",
    "GroupedExperts",
    "MoEConfig",
    "MoELayer",
    "Router",
    "RouterOutput",
    "SwiGLUMLP",
    "TokenDispatcher",
    "all_to_all",
    "attach_aux_loss",
    "pass_leading",
    "plan_permutation",
]
