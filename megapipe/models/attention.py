"""The reference GPT's causal self-attention: fused q/k/v rows, grouped-query heads, QK norm,
rotary embedding (rope), and the attention core that selective recompute may run again.

Every weight is drawn from a generator keyed by (seed, "attention", global layer index, name),
so any stage split rebuilds the single-process model's weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megapipe.models.config import GPTConfig
from megapipe.moe.seeding import seeded_normal
from megapipe.recompute.function import recompute


def _causal_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The attention core: causal softmax(q k^T / sqrt(d)) v."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _grouped_causal_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The attention core with fewer key/value heads than query heads: query head i attends
    with key/value head ``i // (heads / groups)``."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def rotary_tables(seq_length: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[seq_length, head_dim]`` (float32) of the rotary embedding in the "rotate
    half" form: channel j and j + d/2 of a head turn together by angle ``pos * base^(-2j/d)``
    (Megatron's non-interleaved rope, Hugging Face's Llama/Qwen3)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    angles = torch.outer(torch.arange(seq_length, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [b, heads, s, d]`` rotated: ``x cos + rotate_half(x) sin`` with
    ``rotate_half(x) = (-x[d/2:], x[:d/2])``."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class CausalSelfAttention(nn.Module):
    """Causal self-attention via ``scaled_dot_product_attention`` (no biases).

    ``w_qkv`` is ``[q; k; v]`` stacked by rows: ``heads * d`` rows of queries, then
    ``groups * d`` of keys and of values (head-major inside each), with ``d`` the head dim and
    ``groups`` the key/value heads (grouped-query attention when fewer than the heads). With
    ``qk_layernorm`` each head's q and k go through an RMSNorm over d (``q_norm``, ``k_norm``)
    before the rotary embedding (rope), as Qwen3 and Megatron's ``--qk-layernorm`` do; with
    ``qk_layernorm_scope="all"`` all the queries (heads x d) go through one RMSNorm and all the
    keys (groups x d) through another, as OLMoE's.
    """

    rotary_cos: torch.Tensor  # buffers, registered with rope only
    rotary_sin: torch.Tensor

    def __init__(self, config: GPTConfig, layer_index: int) -> None:
        super().__init__()
        h, std, seed = config.hidden_size, config.init_std, config.seed
        self.num_heads, self.groups, self.head_dim = (
            config.num_heads,
            config.query_groups,
            config.head_dim,
        )
        # Megatron's --recompute-modules core_attn: softmax(q k^T) v re-runs in backward
        self.recompute_core = "core_attn" in config.recompute_modules
        self.core = _causal_core if self.groups == self.num_heads else _grouped_causal_core
        keys = ("attention", layer_index)
        rows = (self.num_heads + 2 * self.groups) * self.head_dim
        self.w_qkv = nn.Parameter(seeded_normal((rows, h), std, seed, *keys, "qkv"))
        self.w_out = nn.Parameter(
            seeded_normal((h, self.num_heads * self.head_dim), std, seed, *keys, "out")
        )
        self.q_norm: nn.RMSNorm | None = None
        self.k_norm: nn.RMSNorm | None = None
        self.norm_all_heads = config.qk_layernorm and config.qk_layernorm_scope == "all"
        if config.qk_layernorm:
            q_size, k_size = self.head_dim, self.head_dim
            if self.norm_all_heads:
                q_size, k_size = self.num_heads * self.head_dim, self.groups * self.head_dim
            self.q_norm = nn.RMSNorm(q_size, eps=config.norm_eps)
            self.k_norm = nn.RMSNorm(k_size, eps=config.norm_eps)
        self.rotary = config.position_embedding_type == "rope"
        if self.rotary:  # tables in the model's dtype, as Megatron and Hugging Face apply them
            cos, sin = rotary_tables(config.seq_length, self.head_dim, config.rotary_base)
            self.register_buffer("rotary_cos", cos, persistent=False)
            self.register_buffer("rotary_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        d, heads, groups = self.head_dim, self.num_heads, self.groups
        q_norm, k_norm = self.q_norm, self.k_norm  # both or neither (qk_layernorm)
        qkv = F.linear(x, self.w_qkv)
        if self.norm_all_heads and q_norm is not None and k_norm is not None:
            q, k, v = qkv.split((heads * d, groups * d, groups * d), dim=-1)
            qkv = torch.cat((q_norm(q), k_norm(k), v), dim=-1)
        qkv = qkv.view(b, s, heads + 2 * groups, d).transpose(1, 2)
        q, k, v = qkv.split((heads, groups, groups), dim=1)  # [b, heads | groups, s, d]
        if q_norm is not None and k_norm is not None and not self.norm_all_heads:
            q, k = q_norm(q), k_norm(k)
        if self.rotary:
            cos, sin = self.rotary_cos[:s], self.rotary_sin[:s]
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = recompute(self.core, q, k, v) if self.recompute_core else self.core(q, k, v)
        return F.linear(y.transpose(1, 2).reshape(b, s, heads * d), self.w_out)
