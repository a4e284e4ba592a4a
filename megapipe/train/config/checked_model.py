"""The model's config of the one-pass build (``build``): the reference GPT the flags describe,
made once, and Megatron's ``--moe-layer-freq`` read as megapipe's dense-then-MoE layers.

A shape the model cannot take is an ``ArgsError`` of one line, before any process group exists.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from megapipe.train.config.checks import selective_recompute_modules
from megapipe.train.config.declare import ArgsError
from megapipe.train.config.flags import PretrainFlags
from megapipe.train.config.job_config import emulated_link

if TYPE_CHECKING:  # the model modules import torch; the CLI stays light
    from megapipe.models.config import GPTConfig


def model_config(f: PretrainFlags, vocab_size: int) -> GPTConfig:
    """The reference MoE GPT of ``vocab_size`` ids; one ArgsError line for a shape it cannot
    take."""
    from megapipe.models.config import GPTConfig

    first_dense, freq = parse_moe_layer_freq(f.moe_layer_freq, f.num_layers)
    full = f.recompute_granularity == "full"
    link = f.moe_emulated_link_gbps
    try:
        return GPTConfig(
            vocab_size=vocab_size,
            hidden_size=f.hidden_size,
            num_layers=f.num_layers,
            num_heads=f.num_attention_heads,
            seq_length=f.seq_length,
            ffn_hidden_size=f.ffn_hidden_size,
            num_experts=f.num_experts,
            moe_top_k=f.moe_router_topk,
            moe_ffn_hidden_size=f.moe_ffn_hidden_size,
            first_k_dense_layers=first_dense,
            moe_layer_freq=freq,
            moe_aux_loss_coeff=f.moe_aux_loss_coeff,
            moe_shared_expert_intermediate_size=f.moe_shared_expert_intermediate_size,
            moe_link=None if link is None else emulated_link(link, f.moe_emulated_link_latency_us),
            moe_capacity_factor=f.moe_expert_capacity_factor,
            moe_expert_rank_capacity_factor=f.moe_expert_rank_capacity_factor,
            moe_router_dtype=f.moe_router_dtype,
            moe_router_pre_softmax=f.moe_router_pre_softmax,
            recompute_modules=selective_recompute_modules(f),
            recompute_method=f.recompute_method if full else None,
            recompute_num_layers=(f.recompute_num_layers or 1) if full else 1,
            seed=f.seed,
            position_embedding_type=f.position_embedding_type,
            rotary_base=f.rotary_base,
            num_query_groups=(f.num_query_groups or 1) if f.group_query_attention else None,
            qk_layernorm=f.qk_layernorm,
            qk_layernorm_scope=f.qk_layernorm_scope,
            kv_channels=f.kv_channels,
            norm_eps=f.norm_epsilon,
            untie_embeddings_and_output_weights=f.untie_embeddings_and_output_weights,
        )
    except ValueError as err:
        raise ArgsError(str(err).splitlines()[0]) from None


def parse_moe_layer_freq(value: str, num_layers: int) -> tuple[int, int]:
    """Megatron's --moe-layer-freq as (first_k_dense_layers, moe_layer_freq).

    An int N means layers 0, N, 2N, ... are MoE. A pattern ``[0,1,1,1]`` (one entry per layer,
    or ``([0]*1+[1]*3)``) must be dense layers first, then MoE every N layers.
    """
    text = value.strip()
    if re.fullmatch(r"\d+", text):
        freq = int(text)
        if freq < 1:
            raise ArgsError(f"--moe-layer-freq={value} must be >= 1")
        return 0, freq
    pattern = _expand_pattern(text)
    if pattern is None or len(pattern) != num_layers:
        raise ArgsError(
            f"--moe-layer-freq={value!r} must be an int or a 0/1 list with one entry per layer "
            f"(num_layers={num_layers})"
        )
    first = pattern.index(1) if 1 in pattern else num_layers
    moe = [i - first for i, v in enumerate(pattern) if v == 1]
    freq = moe[1] - moe[0] if len(moe) > 1 else 1
    rebuilt = [1 if i >= first and (i - first) % freq == 0 else 0 for i in range(num_layers)]
    if rebuilt != pattern:
        raise ArgsError(
            f"--moe-layer-freq={value!r}: only 'dense layers first, then MoE every N layers' "
            "patterns are supported"
        )
    return first, freq


def _expand_pattern(text: str) -> list[int] | None:
    """'[0,1,1]' or '([0]*1+[1]*3)' -> list of 0/1; None if it is neither form."""
    text = text.replace(" ", "")
    if re.fullmatch(r"\[[01](,[01])*\]", text):
        return [int(v) for v in text[1:-1].split(",")]
    inner = text[1:-1] if text.startswith("(") and text.endswith(")") else text
    out: list[int] = []
    for term in inner.split("+"):
        match = re.fullmatch(r"\[([01])\]\*(\d+)", term)
        if match is None:
            return None
        out.extend([int(match.group(1))] * int(match.group(2)))
    return out
