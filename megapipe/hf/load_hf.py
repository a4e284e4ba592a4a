"""``--load-hf DIR``: a Qwen3-MoE directory (as ``export-hf`` writes it, or any whose features
megapipe's GPT mirrors) back into a ``GPTConfig`` and the single-process state dict, which
``checkpoint_reader.copy_into_stage`` copies into the stages of any layout."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megapipe.hf.qwen3_moe import gpt_config_from_hf, state_from_hf
from megapipe.models.config import GPTConfig


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / name for name in names]
    single = directory / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"--load-hf {directory}: no model.safetensors or its index")
    return [single]


def load_hf(directory: str | Path, seq_length: int | None = None
            ) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """The config and single-process state dict (experts stacked) of a Qwen3-MoE directory.
    ``seq_length``: the training sequence length (default: its max_position_embeddings)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ValueError(f"--load-hf {directory}: no config.json")
    config = gpt_config_from_hf(json.loads(config_file.read_text()), seq_length)
    tensors: dict[str, torch.Tensor] = {}
    for path in _weight_files(directory):
        tensors.update(load_file(str(path)))
    return config, state_from_hf(config, tensors)
