"""Checkpoints on disk: written whole or not at all, verified before use, pruned on request.

A save directory (Megatron's naming)::

    SAVE/latest_checkpointed_iteration.txt   # the newest published iteration, written last
    SAVE/iter_0000100/                        # one complete checkpoint
        .metadata, __0_0.distcp, ...          #   torch.distributed.checkpoint's files
        megapipe_layout.json                  #   descriptor: model, layout, manifest (below)
    SAVE/.iter_0000200.tmp/                   # a save in progress (never read)

A save goes into the hidden temporary folder; when every rank has written and flushed its
files, rank 0 writes the descriptor (with a manifest: size and CRC-32 of every file), flushes
it, renames the folder to ``iter_NNNNNNN`` and only then moves the ``latest`` marker. A crash at
any point leaves either the previous checkpoints untouched plus a temporary folder, or the new
checkpoint complete. Loading verifies a checkpoint against its manifest (every file present,
with its size and checksum) and falls back to the newest complete one, naming the damaged ones.
Nothing here deletes a checkpoint except ``prune`` (``--keep-last``), and it deletes only
complete checkpoints older than the ones it keeps; a damaged folder is kept, and one in the way
of a new save is renamed aside, never removed. This module is plain Python (no torch) so checks run
before any process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LATEST_FILE = "latest_checkpointed_iteration.txt"
DESCRIPTOR_FILE = "megapipe_layout.json"
FORMAT = 2
_ITER = re.compile(r"iter_(\d{7,})")
_DESCRIPTOR_FIELDS = {
    "format": int,
    "iteration": int,
    "model": dict,
    "parallel": dict,
    "files": dict,
    "info": dict,
}
_CHUNK = 1 << 22


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (missing, damaged, or of another model); one line."""


def iteration_dir(save: str | Path, iteration: int) -> Path:
    return Path(save) / f"iter_{iteration:07d}"


def temporary_dir(save: str | Path, iteration: int) -> Path:
    """Where the save of ``iteration`` is written before it is published."""
    return Path(save) / f".iter_{iteration:07d}.tmp"


def file_digest(path: Path) -> dict[str, int]:
    """Size and CRC-32 of one file (what the manifest records)."""
    crc, size = 0, 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return {"bytes": size, "crc32": crc}


def read_descriptor(directory: Path) -> dict[str, Any]:
    """The descriptor of the checkpoint in ``directory``; CheckpointError naming the file."""
    path = directory / DESCRIPTOR_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a {type(data).__name__}, not a JSON object")
    missing = [name for name in _DESCRIPTOR_FIELDS if name not in data]
    if missing:
        raise CheckpointError(f"{path} lacks the field(s) {', '.join(missing)}")
    unknown = sorted(set(data) - set(_DESCRIPTOR_FIELDS))
    if unknown:
        raise CheckpointError(f"{path} has unknown field(s) {', '.join(unknown)}")
    for name, kind in _DESCRIPTOR_FIELDS.items():
        if not isinstance(data[name], kind) or isinstance(data[name], bool):
            raise CheckpointError(f"{path}: field {name!r} must be a JSON {kind.__name__}")
    if data["format"] != FORMAT:
        raise CheckpointError(
            f"{path} has format {data['format']}; this megapipe reads format {FORMAT}"
        )
    return data


def check_complete(directory: Path, checksums: bool = True) -> dict[str, Any]:
    """The descriptor, if every file of the manifest is present, whole and unchanged (without
    ``checksums``: present and of its size, which reads no file)."""
    descriptor = read_descriptor(directory)
    files = descriptor["files"]
    if ".metadata" not in files:
        raise CheckpointError(f"{directory / DESCRIPTOR_FILE}: the manifest lists no .metadata")
    for name, expected in sorted(files.items()):
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing")
        size = path.stat().st_size
        if size != expected.get("bytes"):
            raise CheckpointError(
                f"{path} has {size} bytes, the manifest says {expected.get('bytes')}"
            )
        if checksums and file_digest(path)["crc32"] != expected.get("crc32"):
            raise CheckpointError(f"{path} does not match its checksum (the bytes changed)")
    return descriptor


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint: its folder, iteration and descriptor."""

    path: Path
    iteration: int
    descriptor: dict[str, Any]


@dataclass
class Selection:
    """What ``select_checkpoint`` found: the checkpoint to resume (None: none) and why not
    others."""

    chosen: Checkpoint | None
    damaged: list[tuple[Path, str]] = field(default_factory=list)
    marker: int | None = None
    marker_problem: str | None = None

    def warnings(self) -> list[str]:
        """One line per damaged checkpoint skipped, and if the marker named another iteration."""
        lines = []
        to = f"iteration {self.chosen.iteration}" if self.chosen else "nothing"
        for path, problem in self.damaged:
            lines.append(
                f"warning: skipping damaged checkpoint {path} ({problem}); resuming from {to}"
            )
        if self.marker_problem is not None:
            lines.append(f"warning: {self.marker_problem}; using the newest complete checkpoint")
        elif self.chosen is not None and self.marker not in (
            None,
            self.chosen.iteration,
            *(_iteration_of(p) for p, _ in self.damaged),
        ):
            lines.append(
                f"warning: {LATEST_FILE} names iteration {self.marker}, the newest "
                f"complete checkpoint is iteration {self.chosen.iteration}"
            )
        return lines


def _iteration_of(path: Path) -> int | None:
    match = _ITER.fullmatch(path.name)
    return int(match.group(1)) if match else None


def checkpoint_dirs(directory: str | Path) -> list[tuple[int, Path]]:
    """Every ``iter_NNNNNNN`` folder under ``directory``, newest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _ITER.fullmatch(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found, reverse=True)


def read_marker(directory: str | Path) -> tuple[int | None, str | None]:
    """(iteration the ``latest`` marker names, problem with it); (None, None) without one."""
    path = Path(directory) / LATEST_FILE
    if not path.exists():
        return None, None
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as err:
        return None, f"{path} cannot be read ({err})"
    if not text.isdigit():
        return None, f"{path} holds {text[:40]!r}, not an iteration number"
    return int(text), None


def select_checkpoint(directory: str | Path) -> Selection:
    """The newest complete checkpoint under ``directory``, and the damaged ones newer than it."""
    marker, problem = read_marker(directory)
    selection = Selection(None, marker=marker, marker_problem=problem)
    for iteration, path in checkpoint_dirs(directory):
        try:
            descriptor = check_complete(path)
        except CheckpointError as err:
            selection.damaged.append((path, str(err)))
            continue
        if descriptor["iteration"] != iteration:
            selection.damaged.append(
                (path, f"its descriptor says iteration {descriptor['iteration']}")
            )
            continue
        selection.chosen = Checkpoint(path, iteration, descriptor)
        break
    return selection


# ---------------------------------------------------------------------- writing (rank 0)
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a flushed temporary file and an atomic rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    tmp.replace(path)
    _fsync_dir(path.parent)


def describe_files(directory: Path, digests: Mapping[str, Mapping[str, int]]) -> dict[str, Any]:
    """The manifest: ``digests`` (computed by the ranks) checked to cover every file present."""
    present = sorted(p.name for p in directory.iterdir() if p.is_file())
    missing = sorted(set(present) - set(digests))
    if missing:
        raise CheckpointError(f"{directory}: no checksum for {', '.join(missing)}")
    return {name: dict(digests[name]) for name in present}


def publish(save: Path, iteration: int, descriptor: Mapping[str, Any]) -> Path:
    """Seal the temporary folder of ``iteration`` with its descriptor, rename it into place,
    then move the ``latest`` marker. A folder already named like it is renamed aside."""
    tmp, final = temporary_dir(save, iteration), iteration_dir(save, iteration)
    write_durably(tmp / DESCRIPTOR_FILE, json.dumps(descriptor, indent=2) + "\n")
    _fsync_dir(tmp)
    if final.exists():
        final.rename(_aside_name(final))
    tmp.rename(final)
    _fsync_dir(save)
    write_durably(save / LATEST_FILE, f"{iteration}\n")
    return final


def _aside_name(path: Path) -> Path:
    """``iter_0000100.replaced-K`` with the first K that is free (kept, never deleted)."""
    k = 1
    while path.with_name(f"{path.name}.replaced-{k}").exists():
        k += 1
    return path.with_name(f"{path.name}.replaced-{k}")


def prepare_temporary(save: Path, iteration: int) -> Path:
    """An empty temporary folder for ``iteration`` (a leftover of a crashed save is removed)."""
    tmp = temporary_dir(save, iteration)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def prune(save: Path, keep_last: int, newest: int) -> list[Path]:
    """Delete complete checkpoints beyond the ``keep_last`` newest up to iteration ``newest``
    (the one just saved); returns what was deleted.

    Folders after ``newest`` (damaged ones a run fell back from) are not counted, and a folder
    missing a file or with a file of the wrong size is evidence and is kept: only checkpoints
    whose files are all present with their sizes count, and only such are deleted. Each is
    renamed before it is deleted, so a crash mid-delete leaves no folder that looks like one.
    """
    complete = []
    for iteration, path in checkpoint_dirs(save):
        if iteration > newest:
            continue
        try:
            check_complete(path, checksums=False)
        except CheckpointError:
            continue
        complete.append(path)
    deleted = []
    for path in complete[keep_last:]:
        doomed = path.with_name(f".{path.name}.deleting")
        path.rename(doomed)
        shutil.rmtree(doomed)
        deleted.append(path)
    return deleted
