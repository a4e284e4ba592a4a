"""megapipe's GPT tensors as a Hugging Face MoE family writes them (``hf.architectures``), and
back.

Every family stores one tensor per expert and projection, ``[out, in]``, under the names its
transformers class has (Qwen3-MoE and OLMoE ``mlp.experts.{e}.gate_proj``, Mixtral
``block_sparse_moe.experts.{e}.w1``; today's transformers fuses them in memory but writes these).
``tensor_sources`` lists each tensor with the checkpoint key it comes from and how (a row block of
``w_qkv``; megapipe's ``x @ w`` MLP weights transposed); ``state_from_hf`` reads them back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from megapipe.hf.architectures import Architecture
from megapipe.models.config import GPTConfig

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older checkpoints hold


@dataclass(frozen=True)
class HFTensor:
    """One Hugging Face tensor: its name, the checkpoint key it comes from, and how."""

    name: str
    source: str  # a checkpoint key, ``model/{name}[/expert{e}]``
    rows: tuple[int, int] | None = None  # this row block of the source
    transpose: bool = False  # megapipe's [in, out] MLP weight -> Hugging Face's [out, in]

    def make(self, source: torch.Tensor) -> torch.Tensor:
        """This tensor from its source tensor (a fresh contiguous tensor)."""
        t = source if self.rows is None else source[self.rows[0] : self.rows[1]]
        return (t.t() if self.transpose else t).contiguous().clone()


def _attention(config: GPTConfig, arch: Architecture, layer: int) -> list[HFTensor]:
    heads, groups, d = config.num_heads, config.query_groups, config.head_dim
    ours, theirs = f"model/layers.{layer}", f"model.layers.{layer}.self_attn"
    qkv = f"{ours}.attention.w_qkv"
    sources = [
        HFTensor(f"{theirs}.q_proj.weight", qkv, rows=(0, heads * d)),
        HFTensor(f"{theirs}.k_proj.weight", qkv, rows=(heads * d, (heads + groups) * d)),
        HFTensor(
            f"{theirs}.v_proj.weight", qkv, rows=((heads + groups) * d, (heads + 2 * groups) * d)
        ),
        HFTensor(f"{theirs}.o_proj.weight", f"{ours}.attention.w_out"),
    ]
    if arch.qk_norm is not None:
        sources += [
            HFTensor(f"{theirs}.{n}_norm.weight", f"{ours}.attention.{n}_norm.weight")
            for n in ("q", "k")
        ]
    return sources


def tensor_sources(config: GPTConfig, arch: Architecture) -> list[HFTensor]:
    """Every Hugging Face tensor of ``config``'s model as ``arch`` names it, in order."""
    sources = [HFTensor("model.embed_tokens.weight", "model/embedding.tokens")]
    gate, up, down = arch.expert_projections
    for layer in range(config.num_layers):
        ours, theirs = f"model/layers.{layer}", f"model.layers.{layer}"
        sources.append(
            HFTensor(f"{theirs}.input_layernorm.weight", f"{ours}.attention_norm.weight")
        )
        sources += _attention(config, arch, layer)
        sources.append(
            HFTensor(f"{theirs}.post_attention_layernorm.weight", f"{ours}.ffn_norm.weight")
        )
        if not config.is_moe_layer(layer):
            sources += [
                HFTensor(f"{theirs}.mlp.{proj}_proj.weight", f"{ours}.mlp.w_{proj}", transpose=True)
                for proj in ("gate", "up", "down")
            ]
            continue
        block = f"{theirs}.{arch.moe_block}"
        sources.append(HFTensor(f"{block}.gate.weight", f"{ours}.moe.router.weight"))
        sources += [
            HFTensor(
                f"{block}.experts.{e}.{name}.weight",
                f"{ours}.moe.experts.w_{proj}/expert{e}",
                transpose=True,
            )
            for e in range(config.num_experts)
            for name, proj in ((gate, "gate"), (up, "up"), (down, "down"))
        ]
    sources.append(HFTensor("model.norm.weight", "model/head.norm.weight"))
    if config.untie_embeddings_and_output_weights:
        sources.append(HFTensor("lm_head.weight", "model/head.weight"))
    return sources


def check_names(config: GPTConfig, arch: Architecture, names: set[str]) -> None:
    """A ValueError naming the first tensor the model needs and ``names`` lacks, or the first
    it holds that the model does not have (e.g. a bias megapipe does not mirror)."""
    sources = {item.name for item in tensor_sources(config, arch)}
    missing = sorted(sources - names)
    if missing:
        raise ValueError(f"the Hugging Face weights lack {missing[0]} ({len(missing)} missing)")
    extra = sorted(n for n in names - sources if not n.endswith(IGNORED_SUFFIXES))
    if extra:
        raise ValueError(
            f"the Hugging Face weights hold {extra[0]}, which megapipe's "
            f"{arch.name} model does not have ({len(extra)} such tensor(s))"
        )


def state_from_hf(
    config: GPTConfig,
    arch: Architecture,
    tensors: Mapping[str, torch.Tensor],
    keep: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """The single-process model's state dict (experts stacked) from Hugging Face tensors; with
    ``keep``, only the parameters whose names it keeps (their tensors alone are read)."""
    sources: dict[str, list[tuple[HFTensor, torch.Tensor]]] = {}
    for item in tensor_sources(config, arch):
        if keep is not None and not keep(item.source.removeprefix("model/").split("/")[0]):
            continue
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
