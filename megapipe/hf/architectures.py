"""The Hugging Face MoE architectures megapipe's GPT reads and writes; their ``config.json`` read.

Three published families share megapipe's layer (pre-norm RMSNorm, rotary "rotate half"
positions, grouped-query attention without biases, SwiGLU experts behind a softmax top-k
router); ``Architecture`` records where they differ:

- Qwen3-MoE (``qwen3_moe``): an RMSNorm over each head's q and k, dense layers where
  ``mlp_only_layers`` / ``decoder_sparse_step`` say, top-k weights renormalised when
  ``norm_topk_prob`` (the published models) and as they are otherwise;
- Mixtral (``mixtral``): no QK norm, every layer MoE, top-k weights always renormalised,
  experts ``w1 w3 w2``;
- OLMoE (``olmoe``): one RMSNorm over all the queries and one over all the keys
  (``qk_layernorm_scope="all"``), every layer MoE, ``norm_topk_prob`` as Qwen3-MoE.

``gpt_config_from_hf`` reads a ``config.json`` written by any transformers release (today's
``num_local_experts`` and ``rope_parameters``, older ``num_experts`` and ``rope_theta``); every key
is accounted for (``_MIRRORED``, ``_NEUTRAL``, ``_IGNORED``): one with another value, or one
megapipe does not know, is refused in one line naming it. The other way, a ``GPTConfig``
written as one of these families: ``hf.export_config``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megapipe.models.config import GPTConfig


@dataclass(frozen=True)
class Architecture:
    """How one Hugging Face MoE family spells megapipe's GPT."""

    name: str  # the class in ``architectures``
    model_type: str
    moe_block: str  # the MoE module of a layer: ``model.layers.{l}.{moe_block}.gate``
    expert_projections: tuple[str, str, str]  # gate, up, down
    experts_key: str  # the experts' count, as the installed transformers writes it
    qk_norm: str | None  # "head", "all" (qk_layernorm_scope) or None (no QK norm)
    dense_layers: bool  # mlp_only_layers and decoder_sparse_step (Qwen3-MoE)
    renormalises: bool | None  # always (True), or as norm_topk_prob says (None)
    keys: frozenset[str]  # the keys it reads besides ``_MIRRORED``


QWEN3_MOE = Architecture(
    "Qwen3MoeForCausalLM",
    "qwen3_moe",
    "mlp",
    ("gate_proj", "up_proj", "down_proj"),
    "num_local_experts",
    "head",
    True,
    None,
    frozenset(
        {
            "head_dim",
            "moe_intermediate_size",
            "decoder_sparse_step",
            "mlp_only_layers",
            "norm_topk_prob",
            "max_window_layers",
        }
    ),
)
MIXTRAL = Architecture(
    "MixtralForCausalLM",
    "mixtral",
    "block_sparse_moe",
    ("w1", "w3", "w2"),
    "num_local_experts",
    None,
    False,
    True,
    frozenset({"head_dim"}),
)
OLMOE = Architecture(
    "OlmoeForCausalLM",
    "olmoe",
    "mlp",
    ("gate_proj", "up_proj", "down_proj"),
    "num_experts",
    "all",
    False,
    None,
    frozenset({"norm_topk_prob"}),
)
ARCHITECTURES = {a.model_type: a for a in (QWEN3_MOE, MIXTRAL, OLMOE)}

_MIRRORED = frozenset(
    {  # read by every family
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "rope_parameters",
        "tie_word_embeddings",
        "num_experts",
        "num_local_experts",
        "num_experts_per_tok",
        "initializer_range",
        "router_aux_loss_coef",
        "hidden_act",
        "model_type",
        "architectures",
    }
)
_NEUTRAL: dict[str, Any] = {  # key -> the only value megapipe's GPT mirrors
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "clip_qkv": None,
    "router_jitter_noise": 0.0,
    "rope_scaling": None,
}
_IGNORED = frozenset(
    {  # not the model's numbers
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "dtype",
        "torch_dtype",
        "transformers_version",
        "use_cache",
        "output_router_logits",
        "_name_or_path",
    }
)


def _value(hf: Mapping[str, Any], key: str) -> str:
    """``config.json KEY=VALUE``, the value as JSON writes it."""
    return f"config.json {key}={json.dumps(hf[key])}"


def architecture_of(hf: Mapping[str, Any]) -> Architecture:
    """The ``Architecture`` of a ``config.json``; a ValueError for one megapipe does not read."""
    known = ", ".join(f"{a.model_type} ({a.name})" for a in ARCHITECTURES.values())
    # None (no model_type) finds nothing: refused below
    arch = ARCHITECTURES.get(hf.get("model_type"))  # type: ignore[arg-type]
    if arch is None:
        shown = json.dumps(hf.get("model_type"))
        raise ValueError(f"config.json model_type={shown}: --load-hf reads {known}")
    named = hf.get("architectures")
    if named is not None and list(named) != [arch.name]:
        raise ValueError(
            f"config.json architectures={json.dumps(named)}: megapipe reads "
            f'{arch.model_type} as ["{arch.name}"]'
        )
    return arch


def _check_keys(hf: Mapping[str, Any], arch: Architecture) -> None:
    """Every key mirrored, at its neutral value, or ignored; one line naming the first other."""
    for key in hf:
        if key in _MIRRORED or key in arch.keys or key in _IGNORED:
            continue
        if key == "sliding_window":  # Qwen3-MoE keeps a size beside use_sliding_window=false
            if hf[key] is not None and hf.get("use_sliding_window", True):
                raise ValueError(f"{_value(hf, key)}: megapipe's attention has no sliding window")
            continue
        if key not in _NEUTRAL:
            raise ValueError(
                f"{_value(hf, key)}: megapipe does not mirror this {arch.model_type} key"
            )
        if hf[key] != _NEUTRAL[key]:
            raise ValueError(f"{_value(hf, key)} has no equivalent in megapipe's GPT")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{_value(hf, 'hidden_act')}: megapipe's SwiGLU uses silu")


def _experts(hf: Mapping[str, Any]) -> int:
    """The experts' count under either name (both, when present, must agree)."""
    counts = {hf[key] for key in ("num_local_experts", "num_experts") if key in hf}
    if len(counts) > 1:
        raise ValueError(
            f"config.json num_local_experts={hf['num_local_experts']} and "
            f"num_experts={hf['num_experts']} disagree"
        )
    return counts.pop() if counts else 0


def _rotary_base(hf: Mapping[str, Any]) -> float:
    """``rope_parameters["rope_theta"]`` (today's name) or ``rope_theta`` (older); the default
    rope only."""
    rope = hf.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(
            f"config.json rope_type={json.dumps(kind)}: megapipe's rope has "
            "no scaling ('default' only)"
        )
    theta = rope.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise ValueError("config.json has no rope_theta (in rope_parameters or on its own)")
    return theta


def _moe_pattern(
    hf: Mapping[str, Any], arch: Architecture, experts: int, num_layers: int
) -> tuple[int, int]:
    """(first_k_dense_layers, moe_layer_freq) giving the config's MoE layers."""
    dense = set(hf.get("mlp_only_layers") or []) if arch.dense_layers else set()
    step = hf.get("decoder_sparse_step", 1) if arch.dense_layers else 1
    moe = [i for i in range(num_layers) if experts > 0 and i not in dense and (i + 1) % step == 0]
    if not moe:
        return num_layers, 1
    first, gaps = moe[0], {b - a for a, b in zip(moe, moe[1:])}
    freq = gaps.pop() if len(gaps) == 1 else (num_layers - first if not gaps else 0)
    expected = [i for i in range(first, num_layers) if freq and (i - first) % freq == 0]
    if moe != expected:
        raise ValueError(
            f"config.json's MoE layers {moe} are not 'the first k dense, then every "
            "n-th' (megapipe's first_k_dense_layers and moe_layer_freq)"
        )
    return first, freq


def gpt_config_from_hf(hf: Mapping[str, Any], seq_length: int | None = None) -> GPTConfig:
    """The ``GPTConfig`` of a ``config.json`` (module docstring; a ValueError naming what
    megapipe's GPT cannot mirror). ``seq_length``: the training sequence length (default: the
    model's ``max_position_embeddings``)."""
    arch = architecture_of(hf)
    _check_keys(hf, arch)
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    experts = _experts(hf)
    first_dense, freq = _moe_pattern(hf, arch, experts, layers)
    renormalise = arch.renormalises or bool(hf.get("norm_topk_prob", False))
    expert_size = hf["moe_intermediate_size" if arch.dense_layers else "intermediate_size"]
    fields: dict[str, Any] = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=layers,
        num_heads=heads,
        seq_length=seq_length or hf["max_position_embeddings"],
        ffn_hidden_size=hf["intermediate_size"],
        num_experts=experts,
        first_k_dense_layers=first_dense,
        moe_layer_freq=freq,
        position_embedding_type="rope",
        rotary_base=_rotary_base(hf),
        num_query_groups=hf.get("num_key_value_heads", heads),
        qk_layernorm=arch.qk_norm is not None,
        qk_layernorm_scope=arch.qk_norm or "head",
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        init_std=hf.get("initializer_range", 0.02),
        moe_aux_loss_coeff=hf.get("router_aux_loss_coef", 1e-3),
        moe_router_pre_softmax=not renormalise,
    )
    if experts:
        fields.update(moe_top_k=hf["num_experts_per_tok"], moe_ffn_hidden_size=expert_size)
    return GPTConfig(**fields)
