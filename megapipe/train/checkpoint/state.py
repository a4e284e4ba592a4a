"""Checkpoint state with torch.distributed.checkpoint, keyed by what each tensor *is*.

Keys do not depend on the parallel layout, so a checkpoint written under one (pp, vpp, ep, dp,
schedule) loads under another and DCP reshards it:

- a parameter is ``model/{name}`` where ``name`` is the stage's own parameter name, which
  already carries the global layer index (``layers.3.attention.w_qkv``, ``embedding.tokens``,
  ``head.weight``); the stage number is not part of it;
- the local experts of a grouped-experts weight are stacked along dim 0 on each EP rank; each
  expert is its own key, ``model/{name}/expert{e}`` with ``e`` the global expert index;
- an optimizer state follows its parameter: ``optim/{name}[/expert{e}]/{field}`` (AdamW's
  ``exp_avg``, ``exp_avg_sq``, with ``--bf16`` the fp32 ``main_param``; the scalar ``step``
  once per parameter); the distributed optimizer (``FlatAdamW``, sharded) writes under the same
  keys only the element ranges of its shards (``pieces.PieceTensor``), so its
  checkpoints load into any dp size, with or without it;
- ``rng/rank{r}`` holds each rank's RNG states; a run with another world size restores rank
  ``r``'s from saved rank ``r % saved_world``; ``extra/...`` holds the states every rank shares
  (LR schedule, data position).

A tensor held twice on one rank (DualPipe's mirrored stages) is written once and loaded into
every copy; one held by several ranks (dense weights over DP) is written by one of them (DCP's
de-duplication). ``files`` makes the folder whole-or-nothing and verifies it.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import StorageMeta

from megapipe.moe.experts import GroupedExperts
from megapipe.train.checkpoint.files import (
    FORMAT,
    describe_files,
    file_digest,
    iteration_dir,
    prepare_temporary,
    prune,
    publish,
    temporary_dir,
)
from megapipe.train.checkpoint.pieces import PieceTensor
from megapipe.train.optim.flat_adamw import FlatAdamW
from megapipe.train.optim.mixed_precision import MixedPrecisionAdamW

Entries = dict[str, list[torch.Tensor]]


def _expert_offsets(module: nn.Module) -> dict[int, int]:
    """id(param) -> global index of its first expert, for every grouped-experts weight."""
    offsets = {}
    for sub in module.modules():
        if isinstance(sub, GroupedExperts):
            for param in sub.parameters(recurse=False):
                offsets[id(param)] = sub.first_expert
    return offsets


def _pieces(
    key: str, tensor: torch.Tensor, first_expert: int | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensor`` whole, or one view per expert (dim 0) keyed by its global expert index."""
    if first_expert is None or tensor.dim() == 0:
        yield key, tensor
        return
    for local in range(tensor.shape[0]):
        yield f"{key}/expert{first_expert + local}", tensor[local]


def _range_pieces(
    key: str, param: torch.Tensor, lo: int, hi: int, values: torch.Tensor, first: int | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Elements ``lo..hi`` of ``param`` flattened (``values``, 1-D) under ``key``, or per
    expert: a whole tensor where the range covers it, else a ``PieceTensor``."""
    if first is None:
        shapes = [(key, tuple(param.shape), 0)]
    else:
        each = param[0].numel()
        shapes = [
            (f"{key}/expert{first + e}", tuple(param.shape[1:]), e * each)
            for e in range(param.shape[0])
        ]
    for sub_key, shape, base in shapes:
        numel = math.prod(shape)
        a, b = max(lo, base), min(hi, base + numel)
        if a >= b:
            continue
        part = values[a - lo : b - lo]
        if a == base and b == base + numel:
            yield sub_key, part.view(shape)
        else:
            yield sub_key, PieceTensor(shape, a - base, b - base, part)


def checkpoint_entries(
    stages: Mapping[int, nn.Module],
    optimizer: torch.optim.Optimizer | MixedPrecisionAdamW | FlatAdamW,
) -> Entries:
    """Every key this rank holds -> the tensors that hold it (views sharing storage)."""
    entries: Entries = {}
    names: dict[int, tuple[str, int | None]] = {}
    for stage in sorted(stages):
        module = stages[stage]
        offsets = _expert_offsets(module)
        for name, param in module.named_parameters():
            first = offsets.get(id(param))
            if getattr(param, "expert_parallel", False) and first is None:
                raise ValueError(
                    f"expert parameter {name} is not part of a GroupedExperts "
                    "module: its global expert indices are unknown"
                )
            names[id(param)] = (name, first)
            for key, view in _pieces(f"model/{name}", param.detach(), first):
                entries.setdefault(key, []).append(view)
            if isinstance(optimizer, FlatAdamW):
                continue
            for field, value in optimizer.state.get(param, {}).items():
                if not isinstance(value, torch.Tensor):
                    continue
                pieces = _pieces(f"optim/{name}", value, None if field == "step" else first)
                for key, view in pieces:
                    entries.setdefault(f"{key}/{field}", []).append(view)
    if isinstance(optimizer, FlatAdamW):
        for piece, state in optimizer.state_pieces():
            name, first = names[id(piece.param)]
            for field, value in state.items():
                if field == "step":
                    entries.setdefault(f"optim/{name}/step", []).append(value)
                    continue
                for key, view in _range_pieces(
                    f"optim/{name}", piece.param, piece.lo, piece.hi, value, first
                ):
                    entries.setdefault(f"{key}/{field}", []).append(view)
    return entries


def ensure_optimizer_state(
    optimizer: torch.optim.Optimizer | MixedPrecisionAdamW | FlatAdamW,
) -> None:
    """Give every parameter AdamW's state so DCP can load into it (a fresh AdamW has none; a
    ``MixedPrecisionAdamW`` or ``FlatAdamW`` has its state, main weights included, from
    construction)."""
    if isinstance(optimizer, (MixedPrecisionAdamW, FlatAdamW)):
        return
    for group in optimizer.param_groups:
        fused = bool(group.get("fused"))
        for p in group["params"]:
            if optimizer.state.get(p):
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


def _flat(entries: Entries, extra: Mapping[str, Any], rng_key: str) -> dict[str, Any]:
    flat: dict[str, Any] = {key: tensors[0] for key, tensors in entries.items()}
    flat.update({f"extra/{key}": value for key, value in extra.items()})
    flat[rng_key] = _rng_state()
    return flat


def _checksums(directory: Path) -> dict[str, dict[str, int]]:
    """Every rank checksums its share of the files; everyone gets the whole table."""
    names = sorted(p.name for p in directory.iterdir() if p.is_file())
    mine = {n: file_digest(directory / n) for n in names[dist.get_rank() :: dist.get_world_size()]}
    tables: list[dict[str, dict[str, int]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(tables, mine)
    return {name: digest for table in tables if table for name, digest in table.items()}


class _SameBytesWriter(dcp.FileSystemWriter):
    """torch's file writer with the save's id named by the iteration, not a random uuid: the
    same run saved to the same folder writes the same bytes, ``.metadata`` included."""

    def __init__(self, path: Path, iteration: int) -> None:
        super().__init__(str(path))
        self._save_id = f"iteration {iteration}"

    def storage_meta(self) -> StorageMeta | None:
        meta = super().storage_meta()
        return None if meta is None else dataclasses.replace(meta, save_id=self._save_id)


def save_checkpoint(
    save: str | Path,
    iteration: int,
    stages: Mapping[int, nn.Module],
    optimizer: torch.optim.Optimizer | MixedPrecisionAdamW | FlatAdamW,
    extra: Mapping[str, Any],
    descriptor: Mapping[str, Any],
    keep_last: int | None = None,
) -> Path:
    """Write checkpoint ``iteration`` on every rank together; returns its folder.

    ``extra`` holds states identical on every rank (scheduler, data position); ``descriptor``
    the ``model``, ``parallel`` and ``info`` parts of the descriptor (``files``).
    The folder appears, complete, only once every rank has written its files.
    """
    rank, save = dist.get_rank(), Path(save)
    tmp = temporary_dir(save, iteration)
    if rank == 0:
        prepare_temporary(save, iteration)
    dist.barrier()
    dcp.save(
        _flat(checkpoint_entries(stages, optimizer), extra, f"rng/rank{rank}"),
        storage_writer=_SameBytesWriter(tmp, iteration),
        checkpoint_id=str(tmp),
    )
    dist.barrier()
    digests = _checksums(tmp)
    if rank == 0:
        full = {
            "format": FORMAT,
            "iteration": iteration,
            **dict(descriptor),
            "files": describe_files(tmp, digests),
        }
        publish(save, iteration, full)
        if keep_last:
            prune(save, keep_last, newest=iteration)
    dist.barrier()
    return iteration_dir(save, iteration)


def load_checkpoint(
    path: str | Path,
    stages: Mapping[int, nn.Module],
    optimizer: torch.optim.Optimizer | MixedPrecisionAdamW | FlatAdamW,
    extra: Mapping[str, Any],
    saved_world: int,
) -> dict[str, Any]:
    """Load the checkpoint folder ``path`` in place; returns the loaded ``extra`` states.

    ``extra`` gives the keys (and placeholder values) of the rank-identical states to restore;
    ``saved_world`` is the world size that wrote it (for the RNG states).
    """
    ensure_optimizer_state(optimizer)
    entries = checkpoint_entries(stages, optimizer)
    rng_key = f"rng/rank{dist.get_rank() % saved_world}"
    flat = _flat(entries, extra, rng_key)
    dcp.load(flat, checkpoint_id=str(path))
    for key, tensors in entries.items():
        loaded = flat[key]
        for tensor in tensors:
            if isinstance(tensor, PieceTensor) and tensor is not loaded:
                tensor.copy_pieces_from(loaded)
            elif tensor is not loaded:
                tensor.copy_(loaded)
    if isinstance(optimizer, (MixedPrecisionAdamW, FlatAdamW)):
        optimizer.copy_main_to_model()  # the same bits as the loaded model weights
    _set_rng_state(flat[rng_key])
    return {key: flat[f"extra/{key}"] for key in extra}
