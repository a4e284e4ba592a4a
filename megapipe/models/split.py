"""Split the model into pipeline parts and say which parts (stages) each rank holds.

``split_layers`` balances the load of each part, where the embedding and the head count as
``input_weight`` and ``output_weight`` layers (as torchtitan does), so the first and last parts
get fewer transformer layers. Layers are handed out one at a time to the least-loaded part
(middle parts first on a tie, then the lower index), which minimises the heaviest part and
keeps the layer counts contiguous in order.

Placement follows ``megapipe.schedule.ir``: loop (stage s on rank s % pp) or V (zig-zag).
``copy_into_stage`` fills a stage of any split and EP rank from the single-process model's
state dict (a checkpoint read in one process, or a Hugging Face directory's weights).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megapipe.models.config import GPTConfig
from megapipe.models.gpt import GPTStage
from megapipe.moe.experts import GroupedExperts
from megapipe.schedule.ir import loop_placement, v_placement

PLACEMENTS = {"loop": loop_placement, "v": v_placement}


def split_layers(
    num_layers: int, num_parts: int, input_weight: int = 1, output_weight: int = 1
) -> list[range]:
    """Global layer indices of each part, lighter first and last parts (ranges may be empty)."""
    checks = (
        ("num_layers", num_layers, 0),
        ("num_parts", num_parts, 1),
        ("input_weight", input_weight, 0),
        ("output_weight", output_weight, 0),
    )
    for name, value, low in checks:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    load = [0] * num_parts
    load[0] += input_weight
    load[-1] += output_weight
    counts = [0] * num_parts
    for _ in range(num_layers):
        part = min(
            range(num_parts),
            key=lambda p: (load[p], p in (0, num_parts - 1) and num_parts > 2, p),
        )
        load[part] += 1
        counts[part] += 1
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def stage_ids_of_rank(pp_rank: int, pp: int, num_stages: int, placement: str = "loop") -> list[int]:
    """The stages rank ``pp_rank`` holds, in increasing order, under loop or V placement."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r} must be one of {sorted(PLACEMENTS)}")
    if pp < 1 or num_stages % pp != 0:
        raise ValueError(f"num_stages={num_stages} must be a positive multiple of pp={pp}")
    if placement == "v" and num_stages % (2 * pp) != 0:
        raise ValueError(
            f"V placement needs num_stages={num_stages} to be a multiple of 2*pp={2 * pp}"
        )
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank={pp_rank} outside [0, pp={pp})")
    stage_to_rank = PLACEMENTS[placement](pp, num_stages)
    return [stage for stage, rank in enumerate(stage_to_rank) if rank == pp_rank]


def build_stage(
    config: GPTConfig,
    model_part: int,
    num_parts: int,
    ep_group: dist.ProcessGroup | None = None,
    input_weight: int = 1,
    output_weight: int = 1,
) -> GPTStage:
    """Model part ``model_part`` of ``num_parts`` (part 0 has the embedding, the last the head)."""
    if not 0 <= model_part < num_parts:
        raise ValueError(f"model_part={model_part} outside [0, num_parts={num_parts})")
    layers = split_layers(config.num_layers, num_parts, input_weight, output_weight)[model_part]
    return GPTStage(
        config,
        layers,
        is_first=model_part == 0,
        is_last=model_part == num_parts - 1,
        ep_group=ep_group,
    )


def copy_into_stage(stage: nn.Module, state: Mapping[str, Any]) -> None:
    """Copy the single-process ``state`` into one stage (any split, any EP rank): each
    parameter by its global name, a grouped-experts weight sliced to this rank's experts."""
    first_expert = {
        id(p): m.first_expert
        for m in stage.modules()
        if isinstance(m, GroupedExperts)
        for p in m.parameters(recurse=False)
    }
    with torch.no_grad():
        for name, param in stage.named_parameters():
            if name not in state:
                raise ValueError(f"the state holds no {name}")
            value = state[name]
            if id(param) in first_expert:
                first = first_expert[id(param)]
                value = value[first : first + param.shape[0]]
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(
                    f"{name} has shape {tuple(value.shape)}, the stage's {tuple(param.shape)}"
                )
            param.copy_(value)
