"""GPTConfig: the reference MoE GPT's sizes, with tiny defaults so tests run in milliseconds.

``to_dict`` / ``GPTConfig.from_dict`` turn a config into a JSON-safe dict and back (versioned:
``CONFIG_VERSION``), the form a checkpoint's descriptor stores it in (``train.checkpoint.reader``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megapipe.moe.layer import MoEConfig
from megapipe.moe.link import EmulatedLink
from megapipe.recompute.full import check_full_recompute
from megapipe.recompute.function import check_recompute_modules

CONFIG_VERSION = 1
"""The version of ``GPTConfig.to_dict``'s form; ``from_dict`` reads this version only."""
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
QK_LAYERNORM_SCOPES = ("head", "all")


@dataclass(frozen=True)
class GPTConfig:
    """A byte-level GPT whose layers ``first_k_dense_layers..`` are MoE (DeepSeek style).

    Layer l (global index) is MoE when ``l >= first_k_dense_layers`` and
    ``(l - first_k_dense_layers) % moe_layer_freq == 0``; the others use a dense SwiGLU MLP of
    ``ffn_hidden_size``. ``num_experts=0`` makes every layer dense. The ``moe_*`` fields map
    onto ``megapipe.moe.MoEConfig`` (``moe_config()``).

    Attention fields carry Megatron's flag names: ``position_embedding_type`` ("learned_absolute"
    or "rope", rotary with ``rotary_base``, "rotate half" form on the head dim),
    ``num_query_groups`` (grouped-query attention; None: one group per head), ``qk_layernorm``
    (RMSNorm over each head's q and k; ``qk_layernorm_scope="all"``: over all heads at once, as
    OLMoE), ``kv_channels`` (the head dim; None: hidden/heads) and
    ``untie_embeddings_and_output_weights`` (False: the output layer uses the token embedding;
    across stages both copies get the summed gradient, ``shared_embedding``).
    """

    vocab_size: int = 256
    hidden_size: int = 32
    num_layers: int = 4
    num_heads: int = 4
    seq_length: int = 16
    ffn_hidden_size: int = 64
    num_experts: int = 4
    moe_top_k: int = 2
    moe_ffn_hidden_size: int = 32
    first_k_dense_layers: int = 1
    moe_layer_freq: int = 1
    moe_score_function: str = "softmax"
    moe_aux_loss_coeff: float = 1e-2
    moe_z_loss_coeff: float = 1e-3
    moe_capacity_factor: float | None = None
    # dropless in fixed-size buffers, no host read, an overflowed step run again (rank_capacity)
    moe_expert_rank_capacity_factor: float | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_link: EmulatedLink | None = None  # emulated interconnect for the A2A (CPU overlap studies)
    moe_router_dtype: str | None = None  # None: the activations' dtype; "fp32" / "fp64"
    # Megatron's --moe-router-pre-softmax: softmax's top-k probabilities as they are; False:
    # divided by their sum (Megatron's default; Mixtral, Qwen3-MoE's norm_topk_prob)
    moe_router_pre_softmax: bool = True
    # Megatron's --recompute-modules (selective recompute): "core_attn", "moe_act"
    recompute_modules: tuple[str, ...] = ()
    # Megatron's --recompute-granularity full: None (off), "uniform" (every layer of a chunk)
    # or "block" (the first recompute_num_layers of each chunk), node by node (recompute.full)
    recompute_method: str | None = None
    recompute_num_layers: int = 1
    position_embedding_type: str = "learned_absolute"
    rotary_base: float = 10000
    num_query_groups: int | None = None  # None: num_heads (plain multi-head attention)
    qk_layernorm: bool = False
    # with qk_layernorm: "head", one RMSNorm over each head's d (Qwen3, Megatron); "all", one
    # over all the heads' q (heads x d) and one over all the keys (groups x d), as OLMoE
    qk_layernorm_scope: str = "head"
    kv_channels: int | None = None  # None: hidden_size // num_heads
    untie_embeddings_and_output_weights: bool = True
    norm_eps: float = 1e-5
    init_std: float = 0.02
    seed: int = 0

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "seq_length",
            "ffn_hidden_size",
            "moe_ffn_hidden_size",
            "moe_layer_freq",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        check_recompute_modules(tuple(self.recompute_modules))
        check_full_recompute(self.recompute_method, self.recompute_num_layers)
        if self.recompute_method is not None and self.recompute_modules:
            raise ValueError(
                f"GPTConfig.recompute_modules={tuple(self.recompute_modules)} is selective "
                f"recompute; it cannot go with recompute_method={self.recompute_method!r} (full)"
            )
        self._check_attention()
        if self.first_k_dense_layers < 0:
            raise ValueError(
                f"GPTConfig.first_k_dense_layers must be >= 0, got {self.first_k_dense_layers}"
            )
        if self.num_experts < 0:
            raise ValueError(f"GPTConfig.num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts > 0 and not 1 <= self.moe_top_k <= self.num_experts:
            raise ValueError(
                f"GPTConfig.moe_top_k={self.moe_top_k} must lie in [1, num_experts="
                f"{self.num_experts}]"
            )
        if self.moe_score_function not in ("softmax", "sigmoid"):
            raise ValueError(
                f"GPTConfig.moe_score_function={self.moe_score_function!r} must be 'softmax' "
                "or 'sigmoid'"
            )
        if self.init_std <= 0:
            raise ValueError(f"GPTConfig.init_std must be > 0, got {self.init_std}")

    def _check_attention(self) -> None:
        for name in ("num_query_groups", "kv_channels"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"GPTConfig.{name} must be a positive int or None, got {value!r}")
        if self.kv_channels is None and self.hidden_size % self.num_heads != 0:
            raise ValueError(
                f"GPTConfig.hidden_size={self.hidden_size} must be divisible by "
                f"num_heads={self.num_heads}"
            )
        if self.num_heads % self.query_groups != 0:
            raise ValueError(
                f"GPTConfig.num_query_groups={self.num_query_groups} must divide "
                f"num_heads={self.num_heads}"
            )
        if self.qk_layernorm_scope not in QK_LAYERNORM_SCOPES:
            raise ValueError(
                f"GPTConfig.qk_layernorm_scope={self.qk_layernorm_scope!r} must be "
                f"one of {', '.join(QK_LAYERNORM_SCOPES)}"
            )
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"GPTConfig.position_embedding_type={self.position_embedding_type!r} must be one "
                f"of {', '.join(POSITION_EMBEDDING_TYPES)}"
            )
        if self.position_embedding_type == "rope":
            if self.head_dim % 2 != 0:
                raise ValueError(
                    f"rotary embeddings need an even head dim (kv_channels), got {self.head_dim}"
                )
            if isinstance(self.rotary_base, bool) or not self.rotary_base > 0:
                raise ValueError(f"GPTConfig.rotary_base must be > 0, got {self.rotary_base!r}")

    @property
    def head_dim(self) -> int:
        """The size of each attention head (``kv_channels``, else hidden / heads)."""
        if self.kv_channels is not None:
            return self.kv_channels
        return self.hidden_size // self.num_heads

    @property
    def query_groups(self) -> int:
        """The number of key/value heads (``num_query_groups``, else one per head)."""
        return self.num_heads if self.num_query_groups is None else self.num_query_groups

    def to_dict(self) -> dict[str, Any]:
        """Every field as JSON-safe values (tuples as lists, the emulated link as a dict), with
        ``"version": CONFIG_VERSION``; ``GPTConfig.from_dict`` rebuilds the same config."""
        out: dict[str, Any] = {"version": CONFIG_VERSION}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "moe_link" and value is not None:
                value = {
                    "bandwidth_bytes_per_s": value.bandwidth_bytes_per_s,
                    "latency_s": value.latency_s,
                }
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Any) -> GPTConfig:
        """The config ``to_dict`` wrote; a ValueError names a wrong version or unknown field (a
        field the dict lacks takes its default, so configs saved before a field existed load
        as they trained)."""
        if not isinstance(data, dict):
            raise ValueError(f"a GPTConfig dict must be a JSON object, got {type(data).__name__}")
        if data.get("version") != CONFIG_VERSION:
            raise ValueError(
                f"GPTConfig dict has version {data.get('version')!r}; this megapipe "
                f"reads version {CONFIG_VERSION}"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names - {"version"})
        if unknown:
            raise ValueError(f"GPTConfig dict has unknown field(s) {', '.join(unknown)}")
        fields = {k: v for k, v in data.items() if k != "version"}
        if fields.get("moe_link") is not None:
            fields["moe_link"] = EmulatedLink(**fields["moe_link"])
        if "recompute_modules" in fields:
            fields["recompute_modules"] = tuple(fields["recompute_modules"])
        return cls(**fields)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` has an MoE FFN (otherwise a dense SwiGLU MLP)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer} outside [0, num_layers={self.num_layers})")
        if self.num_experts == 0 or layer < self.first_k_dense_layers:
            return False
        return (layer - self.first_k_dense_layers) % self.moe_layer_freq == 0

    def recomputes_layer(self, position: int) -> bool:
        """Whether the layer at ``position`` in its chunk (0: the chunk's first) is recomputed
        whole (full granularity): every layer with uniform, the first N with block."""
        if self.recompute_method == "uniform":
            return True
        return self.recompute_method == "block" and position < self.recompute_num_layers

    def moe_config(self) -> MoEConfig:
        """The MoE layer config of this model's MoE layers."""
        if self.num_experts == 0:
            raise ValueError("GPTConfig.num_experts=0: this model has no MoE layers")
        return MoEConfig(
            hidden_size=self.hidden_size,
            num_experts=self.num_experts,
            top_k=self.moe_top_k,
            ffn_hidden_size=self.moe_ffn_hidden_size,
            score_function=self.moe_score_function,
            aux_loss_coeff=self.moe_aux_loss_coeff,
            z_loss_coeff=self.moe_z_loss_coeff,
            capacity_factor=self.moe_capacity_factor,
            rank_capacity_factor=self.moe_expert_rank_capacity_factor,
            shared_expert_intermediate_size=self.moe_shared_expert_intermediate_size,
            link=self.moe_link,
            init_std=self.init_std,
            router_dtype=self.moe_router_dtype,
            pre_softmax=self.moe_router_pre_softmax,
            recompute_activation="moe_act" in self.recompute_modules,
        )
