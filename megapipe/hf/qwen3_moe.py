"""megapipe's GPT as Hugging Face's Qwen3-MoE (``Qwen3MoeForCausalLM``), and back.

Qwen3-MoE is the nearest architecture: pre-norm RMSNorm layers, rotary positions ("rotate
half"), grouped-query attention with a per-head RMSNorm of q and k, SwiGLU experts behind a
softmax top-k router (without renormalising the top-k weights: ``norm_topk_prob`` false),
dense SwiGLU layers where ``mlp_only_layers`` says, and tied or untied embeddings. Mixtral has
no QK norm, no dense layers and renormalises the top-k weights, so it fits less. What has no
Qwen3-MoE equivalent is refused in one line (``check_exportable``); docs/pretraining.md,
"Export to Hugging Face", has the field table.

Weights are written in Qwen3-MoE's published format (one tensor per expert and projection,
``[out, in]``), which every Qwen3-MoE loader reads: ``tensor_plan`` lists each Hugging Face
tensor with the checkpoint key it comes from and how (a row block of ``w_qkv``; megapipe's
``x @ w`` MLP weights transposed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from megapipe.models.config import GPTConfig

ARCHITECTURE = "Qwen3MoeForCausalLM"
MODEL_TYPE = "qwen3_moe"


@dataclass(frozen=True)
class HFTensor:
    """One Hugging Face tensor: its name, the checkpoint key it comes from, and how."""

    name: str
    source: str  # a checkpoint key, ``model/{name}[/expert{e}]``
    rows: tuple[int, int] | None = None  # this row block of the source
    transpose: bool = False  # megapipe's [in, out] MLP weight -> Hugging Face's [out, in]

    def make(self, source: torch.Tensor) -> torch.Tensor:
        """This tensor from its source tensor (a fresh contiguous tensor)."""
        t = source if self.rows is None else source[self.rows[0]:self.rows[1]]
        return (t.t() if self.transpose else t).contiguous().clone()


def check_exportable(config: GPTConfig) -> None:
    """A ValueError naming the first field (and value) Qwen3-MoE cannot express."""
    refusals = [
        ("position_embedding_type", config.position_embedding_type != "rope",
         "Qwen3-MoE has rotary positions only (train with --position-embedding-type rope)"),
        ("qk_layernorm", not config.qk_layernorm,
         "Qwen3-MoE always normalises each head's q and k (train with --qk-layernorm)"),
    ]
    if config.num_experts > 0:
        refusals += [
            ("moe_score_function", config.moe_score_function != "softmax",
             "Qwen3-MoE's router is a softmax"),
            ("moe_shared_expert_intermediate_size",
             config.moe_shared_expert_intermediate_size is not None,
             "Qwen3-MoE has no shared expert"),
            ("moe_capacity_factor", config.moe_capacity_factor is not None,
             "megapipe drops tokens past an expert's capacity, Qwen3-MoE routes every token"),
        ]
    for field, refused, why in refusals:
        if refused:
            raise ValueError(f"cannot export to {ARCHITECTURE}: {field}="
                             f"{getattr(config, field)!r} has no equivalent ({why})")


def hf_config(config: GPTConfig, dtype: torch.dtype, eos_token_id: int | None = None
              ) -> dict[str, Any]:
    """The ``config.json`` of ``config`` (after ``check_exportable``)."""
    dense = [layer for layer in range(config.num_layers) if not config.is_moe_layer(layer)]
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.query_groups,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.seq_length,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": float(config.rotary_base),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(config.rotary_base)},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.moe_top_k if config.num_experts else 0,
        "moe_intermediate_size": config.moe_ffn_hidden_size,
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
        "norm_topk_prob": False,
        "router_aux_loss_coef": config.moe_aux_loss_coeff,
        "output_router_logits": False,
        "initializer_range": config.init_std,
        "use_cache": True,
        "eos_token_id": eos_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def tensor_plan(config: GPTConfig) -> list[HFTensor]:
    """Every Hugging Face tensor of ``config``'s model, in order, with its source."""
    heads, groups, d = config.num_heads, config.query_groups, config.head_dim
    plan = [HFTensor("model.embed_tokens.weight", "model/embedding.tokens")]
    for layer in range(config.num_layers):
        ours, theirs = f"model/layers.{layer}", f"model.layers.{layer}"
        qkv = f"{ours}.attention.w_qkv"
        plan += [
            HFTensor(f"{theirs}.input_layernorm.weight", f"{ours}.attention_norm.weight"),
            HFTensor(f"{theirs}.self_attn.q_proj.weight", qkv, rows=(0, heads * d)),
            HFTensor(f"{theirs}.self_attn.k_proj.weight", qkv,
                     rows=(heads * d, (heads + groups) * d)),
            HFTensor(f"{theirs}.self_attn.v_proj.weight", qkv,
                     rows=((heads + groups) * d, (heads + 2 * groups) * d)),
            HFTensor(f"{theirs}.self_attn.o_proj.weight", f"{ours}.attention.w_out"),
            HFTensor(f"{theirs}.self_attn.q_norm.weight", f"{ours}.attention.q_norm.weight"),
            HFTensor(f"{theirs}.self_attn.k_norm.weight", f"{ours}.attention.k_norm.weight"),
            HFTensor(f"{theirs}.post_attention_layernorm.weight", f"{ours}.ffn_norm.weight"),
        ]
        if not config.is_moe_layer(layer):
            plan += [HFTensor(f"{theirs}.mlp.{proj}_proj.weight", f"{ours}.mlp.w_{proj}",
                              transpose=True) for proj in ("gate", "up", "down")]
            continue
        plan.append(HFTensor(f"{theirs}.mlp.gate.weight", f"{ours}.moe.router.weight"))
        plan += [
            HFTensor(f"{theirs}.mlp.experts.{e}.{proj}_proj.weight",
                     f"{ours}.moe.experts.w_{proj}/expert{e}", transpose=True)
            for e in range(config.num_experts) for proj in ("gate", "up", "down")
        ]
    plan.append(HFTensor("model.norm.weight", "model/head.norm.weight"))
    if config.untie_embeddings_and_output_weights:
        plan.append(HFTensor("lm_head.weight", "model/head.weight"))
    return plan


# ------------------------------------------------------------------ back: --load-hf
def _moe_pattern(hf: Mapping[str, Any], num_layers: int) -> tuple[int, int, int]:
    """(num_experts, first_k_dense_layers, moe_layer_freq) giving Qwen3-MoE's MoE layers."""
    experts, step = hf.get("num_experts", 0), hf.get("decoder_sparse_step", 1)
    dense = set(hf.get("mlp_only_layers") or [])
    moe = [l for l in range(num_layers) if experts > 0 and l not in dense and (l + 1) % step == 0]
    if not moe:
        return 0, num_layers, 1
    first, gaps = moe[0], {b - a for a, b in zip(moe, moe[1:])}
    freq = gaps.pop() if len(gaps) == 1 else (num_layers - first if not gaps else 0)
    expected = [l for l in range(first, num_layers) if freq and (l - first) % freq == 0]
    if moe != expected:
        raise ValueError(f"config.json's MoE layers {moe} are not 'the first k dense, then every "
                         "n-th' (megapipe's first_k_dense_layers and moe_layer_freq)")
    return experts, first, freq


def gpt_config_from_hf(hf: Mapping[str, Any], seq_length: int | None = None) -> GPTConfig:
    """The ``GPTConfig`` of a Qwen3-MoE ``config.json`` (a ValueError naming what megapipe's
    GPT cannot mirror). ``seq_length``: the training sequence length (default: the model's
    ``max_position_embeddings``)."""
    if hf.get("model_type") != MODEL_TYPE:
        raise ValueError(f"config.json model_type={hf.get('model_type')!r}: --load-hf reads "
                         f"{MODEL_TYPE!r} ({ARCHITECTURE}) only")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act={hf['hidden_act']!r}: megapipe's SwiGLU uses "
                         "silu")
    for flag in ("attention_bias", "use_sliding_window", "norm_topk_prob"):
        if hf.get(flag):
            raise ValueError(f"config.json {flag}=true has no equivalent in megapipe's GPT")
    rope = hf.get("rope_parameters") or {"rope_type": "default", "rope_theta": hf.get("rope_theta")}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"config.json rope_type={rope.get('rope_type')!r}: megapipe's rope has "
                         "no scaling ('default' only)")
    layers = hf["num_hidden_layers"]
    experts, first_dense, freq = _moe_pattern(hf, layers)
    heads = hf["num_attention_heads"]
    fields = dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=layers,
        num_heads=heads, seq_length=seq_length or hf["max_position_embeddings"],
        ffn_hidden_size=hf["intermediate_size"], num_experts=experts,
        first_k_dense_layers=first_dense, moe_layer_freq=freq,
        position_embedding_type="rope", rotary_base=rope.get("rope_theta") or 10000,
        num_query_groups=hf.get("num_key_value_heads", heads), qk_layernorm=True,
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        norm_eps=hf.get("rms_norm_eps", 1e-6), init_std=hf.get("initializer_range", 0.02),
        moe_aux_loss_coeff=hf.get("router_aux_loss_coef", 1e-3),
    )
    if experts:
        fields.update(moe_top_k=hf["num_experts_per_tok"],
                      moe_ffn_hidden_size=hf["moe_intermediate_size"])
    return GPTConfig(**fields)


def state_from_hf(config: GPTConfig, tensors: Mapping[str, torch.Tensor],
                  keep: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """The single-process model's state dict (experts stacked) from Hugging Face tensors; with
    ``keep``, only the parameters whose names it keeps (their tensors alone are read)."""
    sources: dict[str, list[tuple[HFTensor, torch.Tensor]]] = {}
    for item in tensor_plan(config):
        if keep is not None and not keep(item.source.removeprefix("model/").split("/")[0]):
            continue
        if item.name not in tensors:
            raise ValueError(f"the Hugging Face weights lack {item.name}")
        t = tensors[item.name]
        sources.setdefault(item.source, []).append((item, t.t() if item.transpose else t))
    experts: dict[str, dict[int, torch.Tensor]] = {}
    state: dict[str, torch.Tensor] = {}
    for key, parts in sources.items():
        parts.sort(key=lambda part: part[0].rows or (0, 0))
        value = torch.cat([t for _, t in parts]) if len(parts) > 1 else parts[0][1]
        name, _, expert = key.removeprefix("model/").partition("/expert")
        if expert:
            experts.setdefault(name, {})[int(expert)] = value
        else:
            state[name] = value.contiguous()
    for name, by_index in experts.items():
        state[name] = torch.stack([by_index[e] for e in sorted(by_index)])
    return state
