"""Which checkpoint a run resumes from, and where it may save, decided before any process starts.

``choose_resume(args)`` picks the newest complete checkpoint of ``--load`` (warning about damaged
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

from megapipe.train.args import PretrainArgs, parse_moe_layer_freq
from megapipe.train.checkpoint_files import (
    Checkpoint, CheckpointError, checkpoint_dirs, select_checkpoint,
)

MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
               "seq_length", "num_experts", "moe_ffn_hidden_size",
               "moe_shared_expert_intermediate_size", "moe_layer_freq", "seed")
"""The flags a checkpoint must share with the run that resumes it (shapes, data, seed)."""


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


def model_fields(args: PretrainArgs) -> dict[str, Any]:
    return {name: getattr(args, name) for name in MODEL_FLAGS}


def descriptor_parts(args: PretrainArgs, schedule: str, info: dict[str, Any]) -> dict[str, Any]:
    """The ``model``, ``parallel`` and ``info`` parts of a checkpoint written by ``args``."""
    parallel = {"pp": args.pp, "vpp": args.vpp, "ep": args.ep, "dp": args.dp,
                "world_size": args.world_size, "schedule": schedule,
                "overlap": args.overlap_moe_expert_parallel_comm}
    return {"model": model_fields(args), "parallel": parallel, "info": info}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _same(name: str, saved: Any, mine: Any, saved_layers: Any, my_layers: int) -> bool:
    if name != "moe_layer_freq" or not isinstance(saved, str):
        return saved == mine
    try:
        return parse_moe_layer_freq(saved, int(saved_layers)) == parse_moe_layer_freq(mine, my_layers)
    except (ValueError, TypeError):
        return False


def check_model(checkpoint: Checkpoint, args: PretrainArgs) -> None:
    """Refuse a checkpoint of another model, naming the flag and both values."""
    saved = checkpoint.descriptor["model"]
    where = f"--load {checkpoint.path.parent}: {checkpoint.path.name}"
    for name in MODEL_FLAGS:
        if name not in saved:
            raise CheckpointError(f"{where}: its descriptor lacks the model field {name!r}")
        mine = getattr(args, name)
        if not _same(name, saved[name], mine, saved.get("num_layers"), args.num_layers):
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


def check_paths(args: PretrainArgs) -> None:
    """--save can become a folder we may write; --load is a folder (or --save, not made yet)."""
    if args.save is not None:
        existing = _nearest_existing(args.save)
        if not os.path.isdir(existing):
            what = ("is" if existing == os.path.abspath(args.save)
                    else f"lies under {existing!r}, which is")
            raise CheckpointError(f"--save {args.save!r} {what} a file, not a directory")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise CheckpointError(f"--save {args.save!r}: {existing!r} is not writable")
    if args.load is not None and not os.path.isdir(args.load):
        if os.path.exists(args.load):
            raise CheckpointError(f"--load {args.load!r} is a file, not a directory")
        same = args.save is not None and os.path.abspath(args.save) == os.path.abspath(args.load)
        if not same:
            raise CheckpointError(f"--load {args.load!r} does not exist")


def _check_save_target(args: PretrainArgs) -> None:
    """A --save folder holding checkpoints is resumed, never overwritten by another run."""
    if args.save is None:
        return
    existing = checkpoint_dirs(args.save)
    if not existing:
        return
    same = args.load is not None and Path(args.load).resolve() == Path(args.save).resolve()
    if not same:
        newest = existing[0][0]
        raise CheckpointError(
            f"--save {args.save} already holds checkpoints (newest: iteration {newest}); resume "
            f"them with --load {args.save}, or save into another folder"
        )


def choose_resume(args: PretrainArgs) -> ResumeChoice:
    """The resume decision for ``args`` (see the module docstring); CheckpointError if none."""
    check_paths(args)
    _check_save_target(args)
    if args.load is None:
        return ResumeChoice(None)
    selection = select_checkpoint(args.load)
    if selection.chosen is None:
        if selection.damaged:
            path, problem = selection.damaged[0]
            raise CheckpointError(
                f"--load {args.load}: no complete checkpoint ({len(selection.damaged)} damaged; "
                f"newest {path.name}: {problem})"
            )
        return ResumeChoice(None, note=f"--load {args.load}: no checkpoint yet, starting from scratch")
    check_model(selection.chosen, args)
    return ResumeChoice(selection.chosen, selection.warnings())
