"""Which checkpoint a run resumes from, and where it may save, decided before any process starts.

``choose_resume(config)`` picks the newest complete checkpoint of ``--load`` (warning about damaged
newer ones), and refuses, with one line naming the flag and both values, a checkpoint of another
model: the model's shape and architecture (``RESUMED_FIELDS`` of its ``GPTConfig``, which the
descriptor stores under ``model.gpt_config``), the tokenizer, the sequence length and the seed
must match (the parallel layout and the schedule may change: the checkpoint's keys are
layout-free, see ``state``). Megatron's tracker file ``latest_checkpointed_iteration.txt``
must name an iteration whose folder is there (one line otherwise: a run never starts from
scratch over a folder that says it holds a checkpoint). Without a checkpoint to resume, a run
may start from the weights of a Hugging Face directory (``--load-hf``), whose model the flags must
describe (``check_hf_model``). It also guards what is already saved: a
``--save`` folder that holds checkpoints must be the ``--load`` folder, so a new run never
overwrites or interleaves with another run's checkpoints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megapipe.train.checkpoint.files import (
    LATEST_FILE,
    Checkpoint,
    CheckpointError,
    Selection,
    checkpoint_dirs,
    iteration_dir,
    select_checkpoint,
)
from megapipe.train.config.job_config import JobConfig, TokenizerConfig

if TYPE_CHECKING:
    from megapipe.models.config import GPTConfig

CONFIG_KEY, TOKENIZER_KEY = "gpt_config", "tokenizer"  # reader's, without torch
RESUMED_FIELDS = {  # GPTConfig field -> how the message names it (its flag)
    "hidden_size": "--hidden-size",
    "num_layers": "--num-layers",
    "num_heads": "--num-attention-heads",
    "seq_length": "--seq-length",
    "ffn_hidden_size": "--ffn-hidden-size",
    "num_experts": "--num-experts",
    "moe_ffn_hidden_size": "--moe-ffn-hidden-size",
    "moe_shared_expert_intermediate_size": "--moe-shared-expert-intermediate-size",
    "first_k_dense_layers": "--moe-layer-freq (dense layers first)",
    "moe_layer_freq": "--moe-layer-freq",
    "position_embedding_type": "--position-embedding-type",
    "rotary_base": "--rotary-base",
    "num_query_groups": "--num-query-groups",
    "qk_layernorm": "--qk-layernorm",
    "kv_channels": "--kv-channels",
    "qk_layernorm_scope": "--qk-layernorm-scope",
    "moe_router_pre_softmax": "--moe-router-pre-softmax",
    "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
    "vocab_size": "a padded vocabulary",
    "seed": "--seed",
}
"""What a checkpoint must share with the run that resumes it (shapes, architecture, seed)."""


@dataclass(frozen=True)
class ResumeChoice:
    """The checkpoint to load (None: start from scratch) and the lines to show the user."""

    checkpoint: Checkpoint | None
    warnings: list[str] = field(default_factory=list)
    note: str | None = None
    hf_dir: str | None = None  # no checkpoint: start from this Hugging Face directory's weights

    @property
    def saved_world(self) -> int:
        assert self.checkpoint is not None
        return int(self.checkpoint.descriptor["parallel"]["world_size"])


def descriptor_parts(config: JobConfig, schedule: str, info: dict[str, Any]) -> dict[str, Any]:
    """The ``model``, ``parallel`` and ``info`` parts of a checkpoint written by ``config``."""
    layout = config.parallel
    parallel = {
        "pp": layout.pp,
        "vpp": config.schedule.vpp,
        "ep": layout.ep,
        "dp": layout.dp,
        "world_size": layout.world_size,
        "schedule": schedule,
        "overlap": config.overlap.enabled,
    }
    model = {CONFIG_KEY: config.model.to_dict(), TOKENIZER_KEY: config.tokenizer.descriptor()}
    return {"model": model, "parallel": parallel, "info": info}


def check_model(checkpoint: Checkpoint, config: JobConfig) -> None:
    """Refuse a checkpoint of another model or tokenizer, naming the flag and both values."""
    saved = checkpoint.descriptor["model"]
    where = f"--load {checkpoint.path.parent}: {checkpoint.path.name}"
    fields = saved.get(CONFIG_KEY)
    if not isinstance(fields, dict):
        raise CheckpointError(
            f"{where}: its descriptor has no model.{CONFIG_KEY} (written by "
            "an older megapipe), so its model cannot be compared"
        )
    _check_tokenizer(where, saved.get(TOKENIZER_KEY), config.tokenizer, fields.get("vocab_size"))
    from megapipe.models.config import GPTConfig  # torch: the ranks have not started yet

    try:
        theirs = _architecture(GPTConfig.from_dict(fields))
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{where}: its model.{CONFIG_KEY}: {err}") from None
    mine = _architecture(config.model)
    for name, shown in RESUMED_FIELDS.items():
        if theirs[name] != mine[name]:
            raise CheckpointError(
                f"{where} was saved with {shown}={theirs[name]!r} but this run has "
                f"{shown}={mine[name]!r}; a checkpoint resumes only the same model shape and "
                "architecture, tokenizer, sequence length and seed"
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
            what = (
                "is" if existing == os.path.abspath(save) else f"lies under {existing!r}, which is"
            )
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
    save, load, hf_dir = config.checkpoint.save, config.checkpoint.load, config.checkpoint.load_hf
    check_paths(save, load)
    _check_save_target(save, load)
    if hf_dir is not None:  # checked even when --load's checkpoint wins: a typo is told at once
        check_hf_model(hf_dir, config)
    if load is None:
        return ResumeChoice(None, note=_hf_note(hf_dir), hf_dir=hf_dir)
    selection = select_checkpoint(load)
    _check_marker(load, selection)
    if selection.chosen is None:
        if selection.damaged:
            path, problem = selection.damaged[0]
            raise CheckpointError(
                f"--load {load}: no complete checkpoint ({len(selection.damaged)} damaged; "
                f"newest {path.name}: {problem})"
            )
        note = _hf_note(hf_dir) or f"--load {load}: no checkpoint yet, starting from scratch"
        return ResumeChoice(None, note=note, hf_dir=hf_dir)
    check_model(selection.chosen, config)
    warnings = selection.warnings()
    if hf_dir is not None:
        warnings.append(
            f"warning: --load-hf {hf_dir} is not read: --load {load} holds a "
            f"checkpoint (iteration {selection.chosen.iteration}), which is resumed"
        )
    return ResumeChoice(selection.chosen, warnings)


def _hf_note(hf_dir: str | None) -> str | None:
    return None if hf_dir is None else f"starting from the weights of --load-hf {hf_dir}"


HF_FIELDS = {  # GPTConfig field -> how the message names it, beside RESUMED_FIELDS
    "moe_top_k": "--moe-router-topk",
    "moe_capacity_factor": "--moe-expert-capacity-factor",
    "norm_eps": "--norm-epsilon",
}
"""What a Hugging Face directory's model must share with the run it starts, besides the
``RESUMED_FIELDS`` (less the seed and the sequence length: rotary positions fix no length)."""


def check_hf_model(hf_dir: str, config: JobConfig) -> None:
    """Refuse a ``--load-hf`` directory megapipe cannot read or whose model the flags do not
    describe, naming the flag and both values."""
    from megapipe.hf.load_hf import check_hf_weights, hf_model_config  # torch: no rank yet

    mine = config.model
    try:
        theirs = hf_model_config(hf_dir, mine.seq_length)
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    if config.tokenizer.vocab_size > theirs.vocab_size:
        raise CheckpointError(
            f"--load-hf {hf_dir}: the tokenizer has "
            f"{config.tokenizer.vocab_size:,} tokens, more than its model's "
            f"vocabulary of {theirs.vocab_size:,}"
        )
    fields = {
        name: shown for name, shown in RESUMED_FIELDS.items() if name not in ("seed", "seq_length")
    }
    fields.update(HF_FIELDS)
    ours, its = _architecture(mine, fields), _architecture(theirs, fields)
    for name, shown in fields.items():
        if ours[name] != its[name]:
            raise CheckpointError(
                f"--load-hf {hf_dir}: its config.json has {shown}={its[name]!r} but this run "
                f"has {shown}={ours[name]!r}; pass the model flags of its model"
            )
    try:
        check_hf_weights(hf_dir, mine.seq_length)
    except ValueError as err:
        raise CheckpointError(str(err)) from None


def _architecture(model: GPTConfig, fields: dict[str, str] = RESUMED_FIELDS) -> dict[str, Any]:
    """The ``fields`` of ``model``, the query groups and head dim as they are (the defaults
    None and the heads, or hidden / heads, are the same model)."""
    values = {name: getattr(model, name) for name in fields}
    values.update(num_query_groups=model.query_groups, kv_channels=model.head_dim)
    return values


def _check_tokenizer(where: str, saved: Any, mine: TokenizerConfig, saved_vocab: Any) -> None:
    """The tokenizer type is the checkpoint's and fits its model's vocabulary (a tokenizer
    larger than the model's vocabulary is refused)."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"{where}: its descriptor has no model.{TOKENIZER_KEY}")
    if isinstance(saved_vocab, int) and mine.vocab_size > saved_vocab:
        raise CheckpointError(
            f"{where}: the tokenizer has {mine.vocab_size:,} tokens, more than "
            f"the checkpoint's model vocabulary of {saved_vocab:,}"
        )
    if saved.get("tokenizer_type") != mine.tokenizer_type:
        raise CheckpointError(
            f"{where} was trained with --tokenizer-type "
            f"{saved.get('tokenizer_type')} but this run has --tokenizer-type "
            f"{mine.tokenizer_type}: the ids would mean other tokens"
        )


def _check_marker(load: str, selection: Selection) -> None:
    """Megatron's tracker file names an iteration, and its folder is there (damaged or not)."""
    if selection.marker_problem is not None:
        raise CheckpointError(f"--load {load}: {selection.marker_problem} (fix or remove the file)")
    marker = selection.marker
    if marker is not None and not iteration_dir(load, marker).is_dir():
        found = [iteration for iteration, _ in checkpoint_dirs(load)]
        held = f"it holds iterations {', '.join(map(str, found))}" if found else "it holds none"
        raise CheckpointError(
            f"--load {load}: {LATEST_FILE} names iteration {marker}, whose "
            f"folder {iteration_dir(load, marker).name} is not there ({held})"
        )
