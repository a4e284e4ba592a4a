"""Which checkpoint a run resumes from, and where it may save, decided before any process starts.

``choose_resume(config)`` picks the newest complete checkpoint of ``--load`` (warning about damaged
newer ones), and refuses, with one line naming the flag and both values, a checkpoint of another
model: the model's shape, the sequence length and the seed must match (the parallel layout and
the schedule may change: the checkpoint's keys are layout-free, see ``checkpoint``). It also
guards what is already saved: a ``--save`` folder that holds checkpoints must be the ``--load``
folder, so a new run never overwrites or interleaves with another run's checkpoints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megapipe.train.checkpoint_files import (
    Checkpoint, CheckpointError, checkpoint_dirs, select_checkpoint,
)
from megapipe.train.config import MODEL_FLAGS, CheckpointConfig, JobConfig, parse_moe_layer_freq


@dataclass(frozen=True)
class ResumeChoice:
    """The checkpoint to load (None: start from scratch) and the lines to show the user."""

    checkpoint: Checkpoint | None
    warnings: list[str] = field(default_factory=list)
    note: str | None = None

    @property
    def saved_world(self) -> int:
        assert self.checkpoint is not None
        return int(self.checkpoint.descriptor["parallel"]["world_size"])


def descriptor_parts(config: JobConfig, schedule: str, info: dict[str, Any]) -> dict[str, Any]:
    """The ``model``, ``parallel`` and ``info`` parts of a checkpoint written by ``config``."""
    layout = config.parallel
    parallel = {"pp": layout.pp, "vpp": config.schedule.vpp, "ep": layout.ep, "dp": layout.dp,
                "world_size": layout.world_size, "schedule": schedule,
                "overlap": config.overlap.enabled}
    return {"model": dict(config.checkpoint.model_fields), "parallel": parallel, "info": info}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _same(name: str, saved: Any, mine: Any, saved_layers: Any, my_layers: int) -> bool:
    if name != "moe_layer_freq" or not isinstance(saved, str):
        return saved == mine
    try:
        return parse_moe_layer_freq(saved, int(saved_layers)) == parse_moe_layer_freq(mine, my_layers)
    except (ValueError, TypeError):
        return False


def check_model(checkpoint: Checkpoint, config: CheckpointConfig) -> None:
    """Refuse a checkpoint of another model, naming the flag and both values."""
    saved, model = checkpoint.descriptor["model"], config.model_fields
    where = f"--load {checkpoint.path.parent}: {checkpoint.path.name}"
    for name in MODEL_FLAGS:
        if name not in saved:
            raise CheckpointError(f"{where}: its descriptor lacks the model field {name!r}")
        mine = model[name]
        if not _same(name, saved[name], mine, saved.get("num_layers"), model["num_layers"]):
            raise CheckpointError(
                f"{where} was saved with {_flag(name)}={saved[name]!r} but this run has "
                f"{_flag(name)}={mine!r}; a checkpoint resumes only the same model shape, "
                "sequence length and seed"
            )
    parallel = checkpoint.descriptor["parallel"]
    world = parallel.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise CheckpointError(f"{where}: its descriptor's parallel.world_size is {world!r}")


def _nearest_existing(path: str) -> str:
    """``path`` or its closest existing ancestor."""
    current = os.path.abspath(path)
    while not os.path.exists(current):
        current = os.path.dirname(current)
    return current


def check_paths(save: str | None, load: str | None) -> None:
    """--save can become a folder we may write; --load is a folder (or --save, not made yet)."""
    if save is not None:
        existing = _nearest_existing(save)
        if not os.path.isdir(existing):
            what = ("is" if existing == os.path.abspath(save)
                    else f"lies under {existing!r}, which is")
            raise CheckpointError(f"--save {save!r} {what} a file, not a directory")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise CheckpointError(f"--save {save!r}: {existing!r} is not writable")
    if load is not None and not os.path.isdir(load):
        if os.path.exists(load):
            raise CheckpointError(f"--load {load!r} is a file, not a directory")
        same = save is not None and os.path.abspath(save) == os.path.abspath(load)
        if not same:
            raise CheckpointError(f"--load {load!r} does not exist")


def _check_save_target(save: str | None, load: str | None) -> None:
    """A --save folder holding checkpoints is resumed, never overwritten by another run."""
    if save is None:
        return
    existing = checkpoint_dirs(save)
    if not existing:
        return
    same = load is not None and Path(load).resolve() == Path(save).resolve()
    if not same:
        newest = existing[0][0]
        raise CheckpointError(
            f"--save {save} already holds checkpoints (newest: iteration {newest}); resume "
            f"them with --load {save}, or save into another folder"
        )


def choose_resume(config: JobConfig) -> ResumeChoice:
    """The resume decision for ``config`` (module docstring); CheckpointError if none."""
    save, load = config.checkpoint.save, config.checkpoint.load
    check_paths(save, load)
    _check_save_target(save, load)
    if load is None:
        return ResumeChoice(None)
    selection = select_checkpoint(load)
    if selection.chosen is None:
        if selection.damaged:
            path, problem = selection.damaged[0]
            raise CheckpointError(
                f"--load {load}: no complete checkpoint ({len(selection.damaged)} damaged; "
                f"newest {path.name}: {problem})"
            )
        return ResumeChoice(None, note=f"--load {load}: no checkpoint yet, starting from scratch")
    check_model(selection.chosen, config.checkpoint)
    return ResumeChoice(selection.chosen, selection.warnings())
