"""megapipe.moe: router, all-to-all token dispatcher, grouped experts and the MoE layer."""

from megapipe.moe.aux_loss import AuxLossLog, attach_aux_loss
from megapipe.moe.dispatcher import DispatchSplits, HostCounts, TokenDispatcher, all_to_all
from megapipe.moe.experts import GroupedExperts, SwiGLUMLP
from megapipe.moe.grouped_gemm import grouped_matmul
from megapipe.moe.layer import MoEConfig, MoELayer, MoEState, pass_leading
from megapipe.moe.link import EmulatedLink
from megapipe.moe.permutation import expert_counts, sort_by_expert
from megapipe.moe.router import Router, RouterOutput

__all__ = [
    "AuxLossLog",
    "DispatchSplits",
    "EmulatedLink",
    "GroupedExperts",
    "HostCounts",
    "MoEConfig",
    "MoELayer",
    "MoEState",
    "Router",
    "RouterOutput",
    "SwiGLUMLP",
    "TokenDispatcher",
    "all_to_all",
    "attach_aux_loss",
    "expert_counts",
    "grouped_matmul",
    "pass_leading",
    "sort_by_expert",
]
