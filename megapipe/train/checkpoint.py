"""Checkpoints with torch.distributed.checkpoint: every rank writes its own shard.

Layout on disk (Megatron's naming)::

    SAVE/latest_checkpointed_iteration.txt     # written last, so a partial save is never latest
    SAVE/iter_0000100/megapipe_layout.json     # pp, vpp, ep, dp, num_layers, ...
    SAVE/iter_0000100/*.distcp, .metadata      # DCP shards

Keys name what a tensor *is*, so DCP writes each distinct tensor once: a dense parameter is
``model/stage{s}/{name}`` (identical on the DP ranks, written by one of them); an expert
parameter adds ``/ep{ep_rank}`` (identical on its expert-DP ranks). Optimizer moments follow
their parameter's key. RNG states are per rank (``rng/rank{r}/...``); the scheduler and data
position are the same on every rank. The layout is schedule-independent (a run may resume with
another schedule or with the overlap switched), but a different pp, vpp, ep, dp or model shape is
refused before any process group starts, with both layouts named.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from megapipe.train.optim import is_expert_param

LATEST_FILE = "latest_checkpointed_iteration.txt"
LAYOUT_FILE = "megapipe_layout.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this run (missing, or another layout)."""


@dataclass(frozen=True)
class CheckpointLayout:
    """What the shards depend on: the parallel grid and the model's shape (not the schedule)."""

    pp: int
    vpp: int
    ep: int
    dp: int
    num_layers: int
    hidden_size: int
    num_experts: int
    ffn_hidden_size: int
    moe_ffn_hidden_size: int

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in asdict(self).items())


def iteration_dir(save: str | Path, iteration: int) -> Path:
    return Path(save) / f"iter_{iteration:07d}"


def latest_iteration(directory: str | Path) -> int | None:
    """The iteration of the newest complete checkpoint under ``directory`` (None if none)."""
    marker = Path(directory) / LATEST_FILE
    if not marker.exists():
        return None
    text = marker.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{marker} holds {text!r}, not an iteration number")
    return int(text)


def read_layout(directory: str | Path) -> tuple[int, CheckpointLayout]:
    """(iteration, layout) of the latest checkpoint in ``directory``; CheckpointError if none."""
    iteration = latest_iteration(directory)
    if iteration is None:
        raise CheckpointError(f"--load {directory}: no {LATEST_FILE} (no complete checkpoint)")
    path = iteration_dir(directory, iteration) / LAYOUT_FILE
    if not path.exists():
        raise CheckpointError(f"--load {directory}: {path} is missing")
    fields = json.loads(path.read_text())["layout"]
    return iteration, CheckpointLayout(**fields)


def check_layout(directory: str | Path, current: CheckpointLayout) -> int:
    """The latest iteration in ``directory`` if its layout equals ``current``; else raise."""
    iteration, saved = read_layout(directory)
    if saved != current:
        raise CheckpointError(
            f"--load {directory} (iteration {iteration}) was saved with layout [{saved.describe()}] "
            f"but this run has [{current.describe()}]; resharding is not supported, resume with "
            "the saved layout"
        )
    return iteration


def _param_key(prefix: str, stage: int, name: str, param: torch.Tensor, ep_rank: int) -> str:
    key = f"{prefix}/stage{stage}/{name}"
    return f"{key}/ep{ep_rank}" if is_expert_param(param) else key


def _ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter AdamW's state so DCP can load into it (a fresh optimizer has none)."""
    for group in optimizer.param_groups:
        fused = bool(group.get("fused"))
        for p in group["params"]:
            if p in optimizer.state and optimizer.state[p]:
                continue
            optimizer.state[p] = {
                "step": torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu"),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _state_dict(
    stages: Mapping[int, nn.Module],
    optimizer: torch.optim.Optimizer,
    ep_rank: int,
    rank: int,
) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
    """Flat DCP state dict (tensors share storage with the model/optimizer), plus optimizer refs."""
    flat: dict[str, Any] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for stage, module in sorted(stages.items()):
        for name, param in module.named_parameters():
            key = _param_key("model", stage, name, param, ep_rank)
            flat[key] = param.detach()
            state = optimizer.state.get(param)
            if state:
                okey = _param_key("optim", stage, name, param, ep_rank)
                moments[okey] = state
                for field, value in state.items():
                    flat[f"{okey}/{field}"] = value
    flat[f"rng/rank{rank}"] = _rng_state()
    return flat, moments


def save_checkpoint(
    save: str | Path,
    iteration: int,
    stages: Mapping[int, nn.Module],
    optimizer: torch.optim.Optimizer,
    extra: Mapping[str, Any],
    layout: CheckpointLayout,
    ep_rank: int,
    info: Mapping[str, Any] | None = None,
) -> Path:
    """Write this rank's shard of iteration ``iteration``; call on every rank together.

    ``extra`` holds states identical on every rank (scheduler, data position); ``info`` is
    written into the layout file for people to read (schedule, flags).
    """
    rank = dist.get_rank()
    directory = iteration_dir(save, iteration)
    flat, _ = _state_dict(stages, optimizer, ep_rank, rank)
    for key, value in extra.items():
        flat[f"extra/{key}"] = value
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dcp.save(flat, checkpoint_id=str(directory))
    dist.barrier()
    if rank == 0:
        payload = {"iteration": iteration, "layout": asdict(layout), "info": dict(info or {})}
        (directory / LAYOUT_FILE).write_text(json.dumps(payload, indent=2) + "\n")
        tmp = Path(save) / (LATEST_FILE + ".tmp")
        tmp.write_text(f"{iteration}\n")
        tmp.replace(Path(save) / LATEST_FILE)
    dist.barrier()
    return directory


def load_checkpoint(
    load: str | Path,
    stages: Mapping[int, nn.Module],
    optimizer: torch.optim.Optimizer,
    extra: Mapping[str, Any],
    layout: CheckpointLayout,
    ep_rank: int,
) -> tuple[int, dict[str, Any]]:
    """Load the latest checkpoint in place; returns (iteration, loaded ``extra`` states).

    ``extra`` gives the keys (and placeholder values) of the rank-identical states to restore.
    RNG states are restored too, so the resumed run draws the same numbers.
    """
    iteration = check_layout(load, layout)
    _ensure_optimizer_state(optimizer)
    rank = dist.get_rank()
    flat, moments = _state_dict(stages, optimizer, ep_rank, rank)
    for key, value in extra.items():
        flat[f"extra/{key}"] = value
    dcp.load(flat, checkpoint_id=str(iteration_dir(load, iteration)))
    for okey, state in moments.items():
        for field in list(state):
            loaded = flat[f"{okey}/{field}"]
            if loaded is not state[field]:
                state[field] = loaded
    _set_rng_state(flat[f"rng/rank{rank}"])
    return iteration, {key: flat[f"extra/{key}"] for key in extra}
