"""A megapipe checkpoint read in one process, without process groups: its model config and its
model tensors, whatever layout (pp, vpp, ep, dp, schedule) wrote it.

The checkpoint's keys are layout-free (``train.checkpoint.state``): ``model/{name}`` per parameter
and ``model/{name}/expert{e}`` per expert, so the single-process model's state dict is the
``model/`` keys with each expert weight stacked back along dim 0. torch.distributed.checkpoint
loads any subset of keys in one process (``dcp.load(..., no_dist=True)``), so a caller reads
only the tensors it needs at a time (``read_tensors``).

The model config lives in the descriptor (``megapipe_layout.json``) under
``model.gpt_config`` (``CONFIG_KEY``: ``GPTConfig.to_dict()``), the tokenizer under
``model.tokenizer`` (``TOKENIZER_KEY``: ``{"tokenizer_type": "ByteTokenizer"}`` or
``{"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": PATH}``, Megatron's names).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megapipe.models.config import GPTConfig
from megapipe.train.checkpoint.files import (
    Checkpoint,
    CheckpointError,
    check_complete,
    select_checkpoint,
)

CONFIG_KEY = "gpt_config"
"""The descriptor's ``model`` entry holding ``GPTConfig.to_dict()``."""
TOKENIZER_KEY = "tokenizer"
"""The descriptor's ``model`` entry naming the tokenizer (module docstring)."""
_EXPERT = re.compile(r"(.+)/expert(\d+)")


def find_checkpoint(load: str | Path) -> Checkpoint:
    """The checkpoint ``load`` names: a save folder (its newest complete checkpoint) or one
    ``iter_NNNNNNN`` folder; a ValueError (one line) when there is none or it is damaged."""
    path = Path(load)
    if not path.is_dir():
        raise ValueError(f"--load {load}: no such directory")
    match = re.fullmatch(r"iter_(\d{7,})", path.name)
    try:
        if match:
            descriptor = check_complete(path)
            return Checkpoint(path, int(match.group(1)), descriptor)
        selection = select_checkpoint(path)
    except CheckpointError as err:
        raise ValueError(f"--load {load}: {err}") from None
    if selection.chosen is None:
        damaged = "; ".join(f"{p.name}: {why}" for p, why in selection.damaged)
        raise ValueError(
            f"--load {load} holds no complete checkpoint" + (f" ({damaged})" if damaged else "")
        )
    return selection.chosen


def config_of(checkpoint: Checkpoint) -> GPTConfig:
    """The model config stored in the checkpoint's descriptor (``model.gpt_config``)."""
    model = checkpoint.descriptor["model"]
    if CONFIG_KEY not in model:
        raise ValueError(
            f"{checkpoint.path}: its descriptor has no model.{CONFIG_KEY} (the checkpoint was "
            "written without its model config), so its model cannot be rebuilt"
        )
    try:
        return GPTConfig.from_dict(model[CONFIG_KEY])
    except (TypeError, ValueError) as err:
        raise ValueError(f"{checkpoint.path}: model.{CONFIG_KEY}: {err}") from None


def tensor_shapes(path: str | Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every ``model/`` key of the checkpoint folder ``path``: (shape, dtype), from DCP's
    metadata (no tensor is read)."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    return {
        key: (tuple(meta.size), meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model/") and isinstance(meta, TensorStorageMetadata)
    }


Shapes = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


def read_tensors(path: str | Path, keys: Iterable[str], shapes: Shapes) -> dict[str, torch.Tensor]:
    """The tensors of ``keys`` (checkpoint keys, ``shapes`` from ``tensor_shapes``), read in
    this process alone."""
    wanted = {key: torch.empty(shapes[key][0], dtype=shapes[key][1]) for key in keys}
    with warnings.catch_warnings():  # DCP warns that it loads without process groups: we ask it
        warnings.filterwarnings("ignore", message=".*load in a single process")
        dcp.load(wanted, checkpoint_id=str(path), no_dist=True)
    return wanted


def read_model_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The single-process model's state dict (global names, experts stacked along dim 0) from
    the checkpoint folder ``path``."""
    shapes = tensor_shapes(path)
    loaded = read_tensors(path, shapes, shapes)
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for key, tensor in loaded.items():
        name = key.removeprefix("model/")
        match = _EXPERT.fullmatch(name)
        if match:
            experts.setdefault(match.group(1), {})[int(match.group(2))] = tensor
        else:
            state[name] = tensor
    for name, by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise ValueError(f"{path}: the experts of {name} are {sorted(by_index)}, not 0..E-1")
        state[name] = torch.stack([by_index[e] for e in range(len(by_index))])
    return state
