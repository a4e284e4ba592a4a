"""Rank-side refusal checks of the Megatron-Core adapter, for one release (run in its pool).

``refusal_checks`` returns ``{check: (message or None, expected text or None)}`` from every
rank: the one-line refusal each setting the adapter does not mirror gets (expected text: what
the line must name), or None where the setting is mirrored. It runs in the layout of the
deferred-weight-gradient control before it (pp 1, ep 2), so Megatron's groups are not made
again; every rank runs the same forwards, so their all-to-alls match.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from support.mcore_cases import _setup
from support.mcore_models import SEQ, VOCAB, McoreCase, TEContractLinear, build_chunks, make_config
from support.mcore_releases import use_release


def _message(fn: Callable[[], Any]) -> str | None:
    try:
        fn()
    except (NotImplementedError, ValueError, TypeError, RuntimeError) as refused:
        return str(refused)
    return None


def _config_checks(version: tuple[int, ...]) -> dict[str, tuple[str | None, str | None]]:
    from megapipe.megatron.mcore_config import config_problem
    from megapipe.megatron.mcore_release import McoreRelease

    case = McoreCase(pp=1, ep=1)
    out: dict[str, tuple[str | None, str | None]] = {}

    def check(name: str, expected: str | None, **overrides: Any) -> None:
        config = make_config(case, **overrides.pop("_fields", {}))
        for field, value in overrides.items():
            setattr(config, field, value)  # after Megatron's own checks, as a script could
        out[name] = (config_problem(config), expected)

    check("the tests' configuration", None)
    check("TP 2 with sequence parallelism", None, tensor_model_parallel_size=2,
          sequence_parallel=True)
    check("TP without sequence parallelism", "sequence_parallel", tensor_model_parallel_size=2)
    check("expert tensor parallelism", "expert_tensor_parallel_size",
          expert_tensor_parallel_size=2)
    check("context parallelism", "context_parallel_size", context_parallel_size=2)
    check("flex dispatcher", "moe_token_dispatcher_type", moe_token_dispatcher_type="flex")
    check("shared expert overlap", "moe_shared_expert_overlap", moe_shared_expert_overlap=True)
    check("fp16", "fp16", fp16=True)
    check("loss scaling", "grad_scale_func", grad_scale_func=lambda loss: loss)
    check("per-token loss", "calculate_per_token_loss", calculate_per_token_loss=True)
    check("recompute of the MoE layer", "recompute_modules",
          recompute_granularity="selective", recompute_modules=["moe"])
    check("full recompute with dropout", "dropout", recompute_granularity="full",
          recompute_method="uniform", recompute_num_layers=1, hidden_dropout=0.1)
    check("selective recompute", None, recompute_granularity="selective",
          recompute_modules=["core_attn", "layernorm", "moe_act", "shared_experts", "mlp"])
    check("full recompute", None, recompute_granularity="full", recompute_method="block",
          recompute_num_layers=2)
    check("CUDA graphs", "cuda_graph_impl", cuda_graph_impl="local")
    check("FP8", "TransformerConfig.fp8", fp8="hybrid")
    check("activation offloading", "cpu_offloading", cpu_offloading=True)
    check("DDP's sync hooks", None, param_sync_func=lambda *a: None,
          grad_sync_func=lambda *a: None, no_sync_func=lambda: None)
    check("autocast", "enable_autocast", enable_autocast=True)
    check("routing replay", "moe_enable_routing_replay", moe_enable_routing_replay=True)
    check("MTP", None, mtp_num_layers=1)
    check("delayed weight gradients", None, delay_wgrad_compute=True)
    check("Megatron's own overlap flag", None, overlap_moe_expert_parallel_comm=True)
    if version >= (0, 18, 0):
        check("mlp_chunks_for_training", "mlp_chunks_for_training", mlp_chunks_for_training=2)
    if version >= (0, 17, 0):
        check("fused residual RMSNorm", None, fused_residual_rmsnorm=True)
        check("fp32 residual connection", None, fp32_residual_connection=True)
    # a field a future release adds is refused until it is classified
    config = make_config(case)
    future = dataclasses.make_dataclass(
        "FutureConfig", [("moe_future_option", int, dataclasses.field(default=0))],
        bases=(type(config),), init=False,
    )
    config.__class__ = future
    config.moe_future_option = 0
    out["a new field at its default"] = (config_problem(config), None)
    config.moe_future_option = 3
    out["a new field set"] = (config_problem(config), "moe_future_option=3")
    release = McoreRelease(version)
    mtp_full = make_config(case, mtp_num_layers=1, recompute_granularity="full",
                           recompute_method="uniform", recompute_num_layers=1)
    out["MTP with full recompute"] = (
        release.config_problem(mtp_full), "cannot run MTP" if version[:2] == (0, 18) else None
    )
    return out


def _forward_checks(version: tuple[int, ...]) -> dict[str, tuple[str | None, str | None]]:
    """Forward arguments the adapter does not mirror, and the models it does not adapt."""
    from megapipe.megatron.mcore_adapter import McoreGPTStage, as_stage_module
    from megapipe.overlap.sequential import TapeRunner

    out: dict[str, tuple[str | None, str | None]] = {}
    case = McoreCase(pp=1, ep=2)
    _, (chunk,), _ = build_chunks(case)
    stage = McoreGPTStage(chunk)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ).unsqueeze(0).expand_as(tokens)

    def forward(**kwargs: Any) -> torch.Tensor:
        stage.node_runner = TapeRunner()
        try:
            return stage(tokens, positions, None, labels=tokens, **kwargs)
        finally:
            stage.node_runner = None

    from megatron.core.packed_seq_params import PackedSeqParams

    out["packed sequences"] = (_message(lambda: forward(
        packed_seq_params=PackedSeqParams(qkv_format="thd"))), "packed_seq_params")
    out["inference context"] = (_message(lambda: forward(inference_context=object())),
                                "inference_context")
    out["extra block kwargs"] = (_message(lambda: forward(extra_block_kwargs={"x": 1})),
                                 "extra_block_kwargs")
    if version[:2] == (0, 17):
        out["speculative decoding"] = (_message(lambda: forward(is_spec_decode=True)),
                                       "is_spec_decode")
    if version >= (0, 18, 0):  # mirrored: handed to _postprocess as GPTModel.forward does
        def processor(hidden_states, output_layer, output_weight, labels, **_):
            logits, _ = output_layer(hidden_states, weight=output_weight)
            return logits.float().square().mean()

        with torch.no_grad():
            want = chunk(tokens, positions, None, labels=tokens, output_processor=processor)
            got = forward(output_processor=processor)
        out["output_processor"] = (None if torch.equal(got, want) else "differs", None)

    # Megatron models that are not GPTModel, and GPT subclasses that change the mirrored code
    from megatron.core.models.common.language_module.language_module import LanguageModule

    try:
        from megatron.core.models.hybrid.hybrid_model import HybridModel as Other
    except ImportError:  # before 0.18
        from megatron.core.models.mamba.mamba_model import MambaModel as Other
    assert issubclass(Other, LanguageModule)
    other = Other.__new__(Other)
    torch.nn.Module.__init__(other)
    out[f"{Other.__name__} chunk"] = (_message(lambda: as_stage_module(other)), Other.__name__)

    class MyGPT(type(chunk)):
        def forward(self, *args, **kwargs):  # changes what the adapter would mirror
            return super().forward(*args, **kwargs) * 2

    chunk.__class__ = MyGPT
    out["GPT subclass overriding forward"] = (_message(lambda: McoreGPTStage(chunk)),
                                              "MyGPT overrides GPTModel.forward")
    chunk.__class__ = MyGPT.__mro__[1]

    # called outside megapipe's engine, a chunk whose layers defer weight gradients runs its
    # node plans with plain autograd, so its backward still drives every backward_dw()
    _, (chunk,), _ = build_chunks(replace(case, delay_wgrad=True))
    chunk.config.delay_wgrad_compute = True
    stage = McoreGPTStage(chunk)
    stage(tokens, positions, None, labels=tokens).float().mean().backward()
    undriven = [n for n, p in chunk.named_parameters() if p.grad is None]
    out["a direct call drives backward_dw"] = (
        f"pending {TEContractLinear.pending(chunk)}, no gradient: {undriven[:3]}"
        if undriven or TEContractLinear.pending(chunk) else None, None)

    # a deferred weight gradient no node drives (the output layer's)
    _, (chunk,), _ = build_chunks(replace(case, delay_wgrad=True))
    chunk.config.delay_wgrad_compute = True
    from support.mcore_models import WeightGradStore, _backward_dw, _forward_impl

    head = chunk.output_layer
    head.wgrad_store = WeightGradStore(True)
    head._forward_impl, head.backward_dw = _forward_impl(head), _backward_dw(head)
    out["an undriven deferred weight gradient"] = (_message(lambda: McoreGPTStage(chunk)),
                                                   "output_layer")
    assert TEContractLinear.pending(chunk) == 0
    return out


def refusal_checks(release: tuple[str, str | None]) -> dict | None:
    use_release(*release)
    from megapipe.megatron.mcore_release import parse_version

    version = parse_version(release[0])
    _setup(McoreCase(pp=1, ep=2))
    out = {**_config_checks(version), **_forward_checks(version)}
    dist.barrier()
    return out
