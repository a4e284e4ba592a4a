"""The flags of speed: CUDA graphs of static nodes (``--help`` group "CUDA graphs") and the
traces that measure a run ("profiling").
"""

from __future__ import annotations

from dataclasses import dataclass

from megapipe.train.config.declare import flag
from megapipe.train.config.flag_checks import GRAPH_IMPLS, GRAPH_MODULES, graph_impl, graph_modules

GRAPHS, PROFILING = "CUDA graphs", "profiling"  # their --help groups


@dataclass(frozen=True)
class GraphFlags:
    """Megatron's CUDA graph flags, in megapipe's node split."""

    cuda_graph_impl: str = flag(
        "none",
        "local: replay the static nodes that --cuda-graph-modules names as CUDA graphs "
        "(Megatron's local implementation, in megapipe's node split; without CUDA the run says "
        "so and runs eager); none: eager; transformer_engine: refused (TransformerEngine is "
        "not used)",
        graph_impl,
        group=GRAPHS,
        choices=GRAPH_IMPLS,
    )
    cuda_graph_modules: tuple[str, ...] = flag(
        (),
        f"with --cuda-graph-impl local: any of {', '.join(GRAPH_MODULES)} (Megatron's "
        "names; megapipe captures whole nodes: a MoE layer's attention node holds attn, "
        "moe_router and moe_preprocess, a dense layer's node attn and mlp; moe: also the MoE "
        "layer's experts and finish nodes, with --moe-expert-rank-capacity-factor)",
        graph_modules,
        group=GRAPHS,
    )
    cuda_graph_scope: tuple[str, ...] = flag(
        (), "Megatron 0.16-0.17's name of --cuda-graph-modules", graph_modules, group=GRAPHS
    )


@dataclass(frozen=True)
class ProfilingFlags:
    """A Perfetto trace of chosen iterations, optionally torch.profiler's."""

    profile_trace: str | None = flag(
        None,
        "write one Perfetto/Chrome trace of every rank's steps --profile-step-start.."
        "--profile-step-end to FILE (read it with `megapipe trace summarize FILE`)",
        group=PROFILING,
        metavar="FILE",
    )
    profile_step_start: int = flag(
        2, "first iteration traced (1-based, included; default 2)", group=PROFILING
    )
    profile_step_end: int | None = flag(
        None, "last iteration traced (included; default: the start)", group=PROFILING
    )
    use_pytorch_profiler: bool = flag(
        False,
        "also run torch.profiler over the traced steps, writing one trace per rank next "
        "to --profile-trace, with megapipe's node names as ranges",
        group=PROFILING,
    )
