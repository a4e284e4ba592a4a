"""Rank-side code of the Hugging Face export tests: checkpoints of one model under several
layouts, written with ``train.checkpoint.save_checkpoint`` in the 4-rank pool.

Every layout builds its stages from the same seeded init, then moves every weight by
``perturb`` (a pure function of the parameter's global name and expert index, so every layout
holds the same model, and norm weights differ from 1 so a swapped norm shows).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from megapipe.models.config import GPTConfig
from megapipe.models.split import build_stage, copy_into_stage
from megapipe.moe.experts import GroupedExperts
from megapipe.moe.seeding import seeded_normal
from megapipe.parallel.config import ParallelConfig
from megapipe.schedule import build_schedule
from megapipe.train.checkpoint.reader import CONFIG_KEY, TOKENIZER_KEY, read_model_state
from megapipe.train.checkpoint.state import save_checkpoint
from support.pipeline_cases import subworld_groups

# rope + GQA (2 query groups) + QK norm + untied, head dim 12 (kv_channels, not hidden/heads),
# dense first layer then MoE layers, softmax top-2
MODERN = GPTConfig(
    vocab_size=300, hidden_size=32, num_layers=3, num_heads=4, seq_length=16,
    ffn_hidden_size=64, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32,
    first_k_dense_layers=1, position_embedding_type="rope", rotary_base=1000,
    num_query_groups=2, qk_layernorm=True, kv_channels=12,
)
TIED = dataclasses.replace(MODERN, untie_embeddings_and_output_weights=False)
BYTE_LEVEL = {"tokenizer_type": "ByteTokenizer"}
# (name, config, pp, vpp, ep, dp, dtype): world 4 each
LAYOUTS = [
    ("whole", MODERN, 1, 1, 1, 4, torch.float32),  # every rank holds the whole model
    ("split", MODERN, 2, 2, 2, 2, torch.float32),  # interleaved 1F1B, experts over 2 ranks
    ("tied", TIED, 2, 1, 2, 2, torch.float32),  # the tied weight in the first and last stage
    ("bf16", MODERN, 2, 1, 2, 2, torch.bfloat16),  # the weights of a --bf16 run
]


def perturb(stage: nn.Module) -> None:
    """Move every weight by seeded noise keyed by its global name (and expert)."""
    first = {id(p): m.first_expert for m in stage.modules() if isinstance(m, GroupedExperts)
             for p in m.parameters(recurse=False)}
    with torch.no_grad():
        for name, param in stage.named_parameters():
            std = 0.2 if param.dim() == 1 else 0.05
            if id(param) in first:
                for i in range(param.shape[0]):
                    param[i] += seeded_normal(tuple(param.shape[1:]), std, 7, name,
                                              first[id(param)] + i)
            else:
                param += seeded_normal(tuple(param.shape), std, 7, name)


def reference_model(config: GPTConfig) -> nn.Module:
    """The single-process model every layout's checkpoint holds."""
    model = build_stage(config, 0, 1)
    perturb(model)
    return model


def descriptor(config: GPTConfig, pp: int, vpp: int, ep: int, dp: int) -> dict:
    """What the lead's ``pretrain`` stores: the config and tokenizer under ``model``."""
    return {
        "model": {CONFIG_KEY: config.to_dict(), TOKENIZER_KEY: BYTE_LEVEL},
        "parallel": {"pp": pp, "vpp": vpp, "ep": ep, "dp": dp, "world_size": pp * dp},
        "info": {},
    }


def _stages(config: GPTConfig, pp: int, vpp: int, ep: int, dp: int) -> dict[int, nn.Module]:
    groups = subworld_groups(ParallelConfig(pp, dp, ep))
    name = "1f1b" if vpp == 1 else "interleaved-1f1b"
    schedule = build_schedule(name, pp, 4, vpp=vpp)
    ep_group = groups.ep if ep > 1 else None
    return {s: build_stage(config, schedule.model_part(s), schedule.stages_per_pipeline, ep_group)
            for s in schedule.stages_of_rank(groups.pp_rank)}


def write_checkpoints(root: str) -> dict:
    """Every layout's checkpoint under ``root/NAME``; then each rank reads the "whole"
    checkpoint back into fresh stages of the "split" layout (``copy_into_stage``): per rank,
    whether they equal its own split stages bitwise."""
    held = {}
    for name, config, pp, vpp, ep, dp, dtype in LAYOUTS:
        stages = _stages(config, pp, vpp, ep, dp)
        for stage in stages.values():
            perturb(stage)
            stage.to(dtype)
        optimizer = torch.optim.AdamW([p for s in stages.values() for p in s.parameters()])
        save_checkpoint(Path(root) / name, 10, stages, optimizer, {},
                        descriptor(config, pp, vpp, ep, dp))
        held[name] = stages
    state = read_model_state(Path(root) / "whole" / "iter_0000010")
    fresh = _stages(MODERN, 2, 2, 2, 2)
    for stage in fresh.values():
        copy_into_stage(stage, state)
    same = all(
        torch.equal(p, q)
        for s, stage in fresh.items()
        for p, q in zip(stage.parameters(), held["split"][s].parameters())
    )
    dist.barrier()
    return {"rank": dist.get_rank(), "split_stages_from_whole_checkpoint": same}
