"""The model's flags: its size and MoE layers (``--help`` group "model") and its architecture
(positions, attention, norms, embeddings: "model architecture"), in Megatron's names.
"""

from __future__ import annotations

from dataclasses import dataclass

from megapipe.train.config.declare import COUNT, POSITIVE, above, finite, flag, one_of
from megapipe.train.config.flag_checks import megapipe_model

MODEL, ARCHITECTURE = "model", "model architecture"  # their --help groups
POSITION_EMBEDDING_TYPES = ("rope", "learned_absolute")  # models.config's, without torch
QK_LAYERNORM_SCOPES = ("head", "all")  # models.config's, without torch


@dataclass(frozen=True)
class ModelFlags:
    """The model's size, its experts and router."""

    num_layers: int = flag(6, "transformer layers", POSITIVE, group=MODEL)
    hidden_size: int = flag(96, "model width", POSITIVE, group=MODEL)
    num_attention_heads: int = flag(4, "attention heads", POSITIVE, group=MODEL)
    ffn_hidden_size: int = flag(192, "dense SwiGLU width", POSITIVE, group=MODEL)
    seq_length: int = flag(64, "tokens (bytes) per sample", POSITIVE, group=MODEL)
    num_experts: int = flag(4, "routed experts (0: dense)", COUNT, group=MODEL)
    moe_router_topk: int = flag(2, "experts per token", POSITIVE, group=MODEL)
    moe_ffn_hidden_size: int = flag(96, "width of each expert", POSITIVE, group=MODEL)
    moe_shared_expert_intermediate_size: int | None = flag(
        None, "a shared expert of this width", group=MODEL
    )
    moe_layer_freq: str = flag(
        "1",
        "N: every Nth layer is MoE; or a 0/1 pattern per layer like '[0,1,1,1]' (dense "
        "layers first, then a period)",
        group=MODEL,
    )
    moe_aux_loss_coeff: float = flag(1e-2, "load-balancing loss weight", finite, group=MODEL)
    moe_router_dtype: str | None = flag(
        None,
        "fp32 or fp64: compute the router's logits in that precision (default: the "
        "activations' dtype; softmax, top-k and the auxiliary losses are always at least fp32)",
        one_of("fp32", "fp64"),
        group=MODEL,
    )
    moe_router_pre_softmax: bool = flag(
        True,
        "the top-k softmax probabilities weigh the experts as they are (default on here; "
        "Megatron's default is off: --no-moe-router-pre-softmax divides them by their sum, as "
        "Mixtral and Qwen3-MoE's norm_topk_prob)",
        group=MODEL,
    )
    moe_expert_capacity_factor: float | None = flag(
        None,
        "drop routing choices over capacity factor x tokens x top-k / experts per expert, "
        "padding every expert to that capacity (default: dropless)",
        above(0),
        group=MODEL,
    )
    moe_expert_rank_capacity_factor: float | None = flag(
        None,
        "dropless MoE without host reads: each EP rank's dispatch and expert buffers hold "
        "F x its routed rows, counts stay on the device, and a step in which any rank's rows do "
        "not fit runs again without the capacity (same losses; the log counts the steps run "
        "again)",
        finite,
        above(0),
        group=MODEL,
        metavar="F",
    )
    moe_pad_expert_input_to_capacity: bool = flag(
        False,
        "accepted for Megatron scripts: megapipe always pads to the capacity (needs "
        "--moe-expert-capacity-factor)",
        group=MODEL,
    )


@dataclass(frozen=True)
class ArchitectureFlags:
    """Positions, attention, norms, activations and embeddings (issue 31): Megatron's names,
    megapipe's defaults said in ``--help``."""

    position_embedding_type: str = flag(
        "rope",
        "rope (rotary, the default here; Megatron's default is learned_absolute) or "
        "learned_absolute",
        one_of(*POSITION_EMBEDDING_TYPES),
        group=ARCHITECTURE,
    )
    rotary_base: float = flag(
        10000.0, "rope's base (theta)", finite, above(0, "g"), group=ARCHITECTURE
    )
    group_query_attention: bool = flag(
        True,
        "grouped-query attention with --num-query-groups key/value heads (default on "
        "here; Megatron's default is off: --no-group-query-attention, one per query head)",
        group=ARCHITECTURE,
    )
    num_query_groups: int | None = flag(
        2,
        "key/value heads with --group-query-attention, dividing the attention heads "
        "(default 2 here; Megatron's 1)",
        POSITIVE,
        group=ARCHITECTURE,
    )
    qk_layernorm: bool = flag(
        True,
        "RMSNorm of each head's query and key (default on here, as Qwen3; Megatron's "
        "default is off: --no-qk-layernorm)",
        group=ARCHITECTURE,
    )
    qk_layernorm_scope: str = flag(
        "head",
        "with --qk-layernorm: head (an RMSNorm over each head, as Megatron and Qwen3) "
        "or all (one over all the queries and one over all the keys, as OLMoE)",
        one_of(*QK_LAYERNORM_SCOPES),
        group=ARCHITECTURE,
    )
    kv_channels: int | None = flag(
        None, "the head dim (default: hidden / heads)", POSITIVE, group=ARCHITECTURE
    )
    norm_epsilon: float = flag(
        1e-5, "the RMSNorms' epsilon", finite, above(0, "g"), group=ARCHITECTURE
    )
    untie_embeddings_and_output_weights: bool = flag(
        True,
        "the output layer has its own weight (default on here; Megatron ties without "
        "this flag: --no-untie-embeddings-and-output-weights ties them)",
        group=ARCHITECTURE,
    )
    normalization: str = flag(
        "RMSNorm",
        "RMSNorm (megapipe's only normalization; Megatron's default LayerNorm is refused)",
        megapipe_model("normalizes with RMSNorm", "LayerNorm (Megatron's default)"),
        group=ARCHITECTURE,
    )
    swiglu: bool = flag(
        True,
        "SwiGLU MLPs and experts (always on here: --no-swiglu, Megatron's GeLU without "
        "--swiglu, is refused)",
        megapipe_model("has SwiGLU MLPs and experts", "GeLU (Megatron's default without --swiglu)"),
        group=ARCHITECTURE,
    )
    disable_bias_linear: bool = flag(
        True,
        "no biases in the linear layers (always on here: --no-disable-bias-linear, "
        "Megatron's default with biases, is refused)",
        megapipe_model(
            "has no linear biases",
            "adding biases (Megatron's default without --disable-bias-linear)",
        ),
        group=ARCHITECTURE,
    )
    make_vocab_size_divisible_by: int = flag(
        128,
        "pad the tokenizer's vocabulary to a multiple of this, as Megatron does",
        POSITIVE,
        group=ARCHITECTURE,
    )
