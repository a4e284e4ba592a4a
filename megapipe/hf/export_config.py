"""The Hugging Face family a ``GPTConfig`` is written as, and its ``config.json`` (export-hf).

``export_architecture`` chooses the family that has the model's attention and router (OLMoE for
a QK norm over all heads, Mixtral without QK norm, Qwen3-MoE otherwise) and refuses, in one line
naming the field, what that family cannot express. ``hf_config`` writes the keys of the installed
transformers release (5.25), plus the older name where an older release reads another. The
families themselves, and the way back: ``hf.architectures``.
"""

from __future__ import annotations

from typing import Any

from megapipe.hf.architectures import MIXTRAL, OLMOE, QWEN3_MOE, Architecture
from megapipe.models.config import GPTConfig


def export_architecture(config: GPTConfig) -> Architecture:
    """The family ``config`` is written as: OLMoE for a QK norm over all heads, Mixtral without
    QK norm, Qwen3-MoE otherwise; a ValueError naming the first field (and value) it cannot
    express."""
    arch = QWEN3_MOE
    if config.qk_layernorm and config.qk_layernorm_scope == "all":
        arch = OLMOE
    elif not config.qk_layernorm:
        arch = MIXTRAL
    for field, refused, why in _export_refusals(config, arch):
        if refused:
            raise ValueError(
                f"cannot export to {arch.name}: {field}="
                f"{getattr(config, field)!r} has no equivalent ({why})"
            )
    return arch


def _export_refusals(config: GPTConfig, arch: Architecture) -> list[tuple[str, bool, str]]:
    """(field, whether ``arch`` cannot express ``config``'s value, why), in the order
    ``export_architecture`` names the first refused one."""
    all_moe = (
        config.num_experts > 0 and config.first_k_dense_layers == 0 and config.moe_layer_freq == 1
    )
    refusals = [
        (
            "position_embedding_type",
            config.position_embedding_type != "rope",
            "rotary positions only (train with --position-embedding-type rope)",
        ),
        (
            "qk_layernorm",
            not config.qk_layernorm and (config.num_experts == 0 or not all_moe),
            "Qwen3-MoE and OLMoE always normalise q and k, Mixtral has no dense layer "
            "(train with --qk-layernorm)",
        ),
        (
            "first_k_dense_layers",
            arch is not QWEN3_MOE and not all_moe,
            f"{arch.name} has no dense layer",
        ),
        (
            "kv_channels",
            arch is OLMOE and config.head_dim * config.num_heads != config.hidden_size,
            "OLMoE's head dim is hidden / heads",
        ),
    ]
    if config.num_experts > 0:
        refusals += [
            (
                "moe_score_function",
                config.moe_score_function != "softmax",
                "the router is a softmax",
            ),
            (
                "moe_router_pre_softmax",
                arch is MIXTRAL and config.moe_router_pre_softmax,
                "Mixtral always renormalises the top-k weights: train with "
                "--no-moe-router-pre-softmax",
            ),
            (
                "moe_shared_expert_intermediate_size",
                config.moe_shared_expert_intermediate_size is not None,
                "no shared expert",
            ),
            (
                "moe_capacity_factor",
                config.moe_capacity_factor is not None,
                "megapipe drops tokens past an expert's capacity, Hugging Face routes every token",
            ),
        ]
    return refusals


def hf_config(config: GPTConfig, dtype: Any, eos_token_id: int | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``config`` (after ``export_architecture``), in the installed
    transformers' key names, with ``rope_theta`` (and Qwen3-MoE's ``num_experts``) for older
    releases."""
    arch = export_architecture(config)
    theta = float(config.rotary_base)
    experts = config.num_experts
    out: dict[str, Any] = {
        "architectures": [arch.name],
        "model_type": arch.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.query_groups,
        "hidden_act": "silu",
        "max_position_embeddings": config.seq_length,
        "rms_norm_eps": config.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "rope_theta": theta,
        "attention_dropout": 0.0,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
        arch.experts_key: experts,
        "num_experts_per_tok": config.moe_top_k if experts else 0,
        "router_aux_loss_coef": config.moe_aux_loss_coeff,
        "output_router_logits": False,
        "initializer_range": config.init_std,
        "use_cache": True,
        "eos_token_id": eos_token_id,
        "dtype": str(dtype).removeprefix("torch."),
    }
    if arch is QWEN3_MOE:
        out.update(
            num_experts=experts,
            head_dim=config.head_dim,
            attention_bias=False,
            intermediate_size=config.ffn_hidden_size,
            moe_intermediate_size=config.moe_ffn_hidden_size,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i in range(config.num_layers) if not config.is_moe_layer(i)],
            norm_topk_prob=not config.moe_router_pre_softmax,
            use_sliding_window=False,
            sliding_window=None,
        )
    elif arch is MIXTRAL:
        derived = config.head_dim * config.num_heads == config.hidden_size
        out.update(
            head_dim=None if derived else config.head_dim,
            intermediate_size=config.moe_ffn_hidden_size,
            sliding_window=None,
            router_jitter_noise=0.0,
        )
    else:
        out.update(
            attention_bias=False,
            clip_qkv=None,
            intermediate_size=config.moe_ffn_hidden_size,
            norm_topk_prob=not config.moe_router_pre_softmax,
        )
    return out
