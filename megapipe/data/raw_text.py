"""Raw text read byte level: files split into windows, sharded over DP, with saveable position.

The corpus is a list of files read as bytes (``tokenizer.ByteTokenizer``'s ids: one per byte,
nothing to download); documents are joined with a NUL byte as end-of-document. Without
``--data-path`` the corpus is the Python standard library's top-level source files, sorted by
name: real text present on every machine. Samples are non-overlapping windows of
``seq_length + 1`` tokens (inputs and next-token labels); the last ``valid_fraction`` of windows is
the validation split. Training takes a seeded permutation per epoch. At iteration t the global
batch is the next ``global_batch_size`` samples of that permutation; DP rank r takes its contiguous
``global_batch_size / dp`` slice, cut into microbatches. Every rank of one pipeline (same dp
rank) therefore reads the same microbatches, and the position is one integer (consumed samples).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from megapipe.data.files import files_under
from megapipe.data.position import SamplingPosition
from megapipe.data.tokenizer import BYTE_END_OF_DOCUMENT as END_OF_DOCUMENT


def default_corpus_files() -> list[Path]:
    """The standard library's top-level ``*.py`` files (next to ``os.py``), sorted by name."""
    stdlib = Path(os.__file__).resolve().parent
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    if not files:
        raise FileNotFoundError(f"no *.py files next to os.py in {stdlib} for the default corpus")
    return files


def resolve_data_files(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """Files named by ``paths`` (a directory contributes its files, recursively, sorted)."""
    if not paths:
        return default_corpus_files()
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found = files_under(path)
            if not found:
                raise FileNotFoundError(f"--data-path directory {path} holds no files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        elif path.exists():
            raise ValueError(
                f"--data-path {path} is neither a regular file nor a directory "
                "(a FIFO, socket or device cannot be read twice)"
            )
        else:
            raise FileNotFoundError(
                f"--data-path {path} does not exist (neither text files nor "
                f"an indexed dataset: no {path}.idx, no {path}.bin)"
            )
    return files


def check_corpus(paths: Sequence[str | os.PathLike], seq_length: int) -> None:
    """Before any process starts: the files exist, can be read, and hold at least two windows
    of ``seq_length + 1`` bytes (one to train on, one to validate); ValueError otherwise."""
    files = resolve_data_files(paths)
    total = 0
    for path in files:
        try:
            with open(path, "rb"):
                pass
        except OSError as err:
            raise ValueError(f"--data-path file {path} cannot be read ({err.strerror})") from None
        total += path.stat().st_size + 1  # each document ends with one END_OF_DOCUMENT
    needed = 2 * (seq_length + 1)
    if total < needed:
        where = str(paths[0]) if len(paths) == 1 else f"{len(files)} files"
        raise ValueError(
            f"--data-path {where} holds {total - len(files)} bytes in {len(files)} file(s): "
            f"too few for two windows of --seq-length + 1 = {seq_length + 1} bytes "
            f"(need at least {needed - len(files)})"
        )


def load_tokens(files: Sequence[Path]) -> torch.Tensor:
    """The concatenated byte tokens of ``files`` (uint8), one END_OF_DOCUMENT after each."""
    chunks = []
    for path in files:
        chunks.append(path.read_bytes().replace(b"\x00", b""))
        chunks.append(bytes([END_OF_DOCUMENT]))
    data = b"".join(chunks)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@dataclass(frozen=True)
class Splits:
    """Token stream cut into windows: train windows first, validation windows last."""

    tokens: torch.Tensor
    seq_length: int
    num_train: int
    num_valid: int

    def window(self, index: int) -> torch.Tensor:
        """Window ``index`` (over all windows) as int64 of length seq_length + 1."""
        span = self.seq_length + 1
        return self.tokens[index * span : (index + 1) * span].long()


def split_corpus(tokens: torch.Tensor, seq_length: int, valid_fraction: float = 0.05) -> Splits:
    """Deterministic train/validation split of the windows (at least one of each)."""
    windows = tokens.numel() // (seq_length + 1)
    if windows < 2:
        raise ValueError(
            f"the corpus has {tokens.numel()} tokens: too few for two windows of "
            f"seq_length + 1 = {seq_length + 1}"
        )
    num_valid = min(windows - 1, max(1, int(windows * valid_fraction)))
    return Splits(tokens, seq_length, windows - num_valid, num_valid)


Microbatch = tuple[torch.Tensor, torch.Tensor]  # (tokens [b, s], labels [b, s]), int64


def _stack(splits: Splits, indices: Sequence[int]) -> Microbatch:
    windows = torch.stack([splits.window(i) for i in indices])
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


@dataclass
class TrainBatches(SamplingPosition):
    """This DP rank's microbatches, iteration by iteration; its position is ``consumed_samples``.

    ``next_batch()`` returns the ``num_microbatches`` microbatches of the next iteration. The
    samples come in a permutation of the training windows seeded by ``(seed, epoch)``.
    """

    splits: Splits
    global_batch_size: int
    micro_batch_size: int
    dp: int
    dp_rank: int
    seed: int
    consumed_samples: int = 0

    def __post_init__(self) -> None:
        self.check_batch_shape()
        self._permutation_epoch = -1
        self._permutation = torch.empty(0, dtype=torch.long)

    def _sample(self, position: int) -> int:
        epoch, offset = divmod(position, self.splits.num_train)
        if epoch != self._permutation_epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._permutation = torch.randperm(self.splits.num_train, generator=gen)
            self._permutation_epoch = epoch
        return int(self._permutation[offset])

    def next_batch(self) -> list[Microbatch]:
        per_rank = self.global_batch_size // self.dp
        start = self.consumed_samples + self.dp_rank * per_rank
        indices = [self._sample(start + i) for i in range(per_rank)]
        self.consumed_samples += self.global_batch_size
        mbs = self.micro_batch_size
        return [_stack(self.splits, indices[i : i + mbs]) for i in range(0, per_rank, mbs)]


def validation_batches(
    splits: Splits,
    eval_iters: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp: int,
    dp_rank: int,
) -> list[list[Microbatch]]:
    """The same ``eval_iters`` validation batches every time (wrapping if the split is small)."""
    per_rank = global_batch_size // dp
    batches = []
    for it in range(eval_iters):
        start = it * global_batch_size + dp_rank * per_rank
        indices = [splits.num_train + (start + i) % splits.num_valid for i in range(per_rank)]
        batches.append(
            [
                _stack(splits, indices[i : i + micro_batch_size])
                for i in range(0, per_rank, micro_batch_size)
            ]
        )
    return batches
