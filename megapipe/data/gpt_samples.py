"""Megatron's GPT samples from indexed datasets, as this data-parallel rank's microbatches.

``build_gpt_datasets`` makes the train, validation and test datasets exactly as Megatron's
``pretrain_gpt.py`` does, through megatron-core's ``BlendedMegatronDatasetBuilder``,
``GPTDataset`` and ``GPTDatasetConfig`` (``--data-path``, ``--split``, ``--data-cache-path``,
``--seq-length``, ``--seed``; no position or mask resets, no EOD loss masking: Megatron's
defaults), sized by ``megatron_sample_counts`` as Megatron sizes them; so sample i is Megatron's
sample i for the same flags. Sample i holds ``seq_length + 1`` tokens: tokens are the first
``seq_length``, labels the last ``seq_length``.

**Ranks.** The builder writes index caches (``--data-cache-path``, else
``PREFIX/cache/GPTDataset_indices/``, as Megatron) and reads them back. Where
``torch.distributed`` is initialized it is collective: global rank 0 builds and writes the
caches first, every rank waits at a barrier of the default group, then the other ranks build
from the caches; so every rank of the default group must call ``build_gpt_datasets``, and all
of them build (each rank reads its own samples). Without a process group the caller is alone:
it builds and writes the caches inside a default group of its own process that it makes and
ends (gloo, world size 1: Megatron's blended dataset asks the rank whenever it writes a
cache); never run several such processes on one cache directory at once.

**Sampling.** ``IndexedTrainBatches`` takes samples as Megatron's pretraining sampler does: the
global batch of iteration t is samples ``[t * G, (t + 1) * G)`` (G the global batch size), cut
into blocks of ``b * dp`` consecutive samples (b the micro batch size); data-parallel rank r's
microbatch is the r-th ``b`` samples of each block. The position is one integer, the samples
consumed, saved and restored as ``megapipe.data.raw_text.TrainBatches``' is.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from megapipe.data.blend import check_data_path, parse_split
from megapipe.data.errors import DataError
from megapipe.data.mcore_datasets import mcore_datasets
from megapipe.data.position import SamplingPosition
from megapipe.data.tokenizer import Tokenizer

Microbatch = tuple[torch.Tensor, torch.Tensor]  # (tokens [b, s], labels [b, s]), int64
SPLIT_NAMES = ("train", "validation", "test")


def megatron_sample_counts(
    train_iters: int, global_batch_size: int, eval_interval: int, eval_iters: int
) -> tuple[int, int, int]:
    """The samples Megatron asks of each split (its ``get_train_valid_test_num_samples``):
    train ``train_iters * G``; validation ``(train_iters // eval_interval + 1) * eval_iters * G``;
    test ``eval_iters * G``. The counts shape the datasets (how many epochs are shuffled), so
    the same counts give Megatron's samples; each split's samples depend on its own count only.
    ``eval_interval`` 0 (no evaluation): no validation samples."""
    evaluations = train_iters // eval_interval + 1 if eval_interval > 0 else 0
    return (
        train_iters * global_batch_size,
        evaluations * eval_iters * global_batch_size,
        eval_iters * global_batch_size,
    )


class _MegatronTokenizerView:
    """What ``GPTDatasetConfig`` reads of a tokenizer: the vocabulary size, the end of document
    and the identifiers its cache names hash. No pad id: Megatron then pads with -1, an id no
    dataset holds, so no loss is masked."""

    def __init__(self, tokenizer: Tokenizer):
        self.vocab_size = tokenizer.vocab_size
        self.eod = tokenizer.eod
        path = getattr(tokenizer, "path", None)
        self.unique_identifiers = OrderedDict(
            [("class", type(tokenizer).__name__), ("tokenizer_path", [str(path)] if path else [])]
        )


def gpt_dataset_config(
    data_path: Sequence[str],
    split: str,
    seq_length: int,
    seed: int,
    tokenizer: Tokenizer,
    data_cache_path: str | os.PathLike | None = None,
):
    """megatron-core's ``GPTDatasetConfig`` for these flags (checked: see ``check_gpt_data``)."""
    blend = check_data_path(data_path)
    parse_split(split)
    if seq_length < 1:
        raise DataError(f"--seq-length={seq_length} must be >= 1")
    mcore = mcore_datasets("--data-path with indexed datasets")
    return mcore.GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend.megatron(),
        split=split,
        path_to_cache=None if data_cache_path is None else str(data_cache_path),
        tokenizer=_MegatronTokenizerView(tokenizer),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )


def check_gpt_data(
    data_path: Sequence[str],
    split: str,
    seq_length: int,
    seed: int,
    num_samples: Sequence[int],
    tokenizer: Tokenizer,
    data_cache_path: str | os.PathLike | None = None,
):
    """Everything ``build_gpt_datasets`` needs, checked without a process group: the blend
    parses, each prefix's ``.idx`` and ``.bin`` exist and agree, each split of a share above 0
    holds tokens in every dataset (Megatron would loop forever building an empty one, even
    asked for 0 samples). Returns the ``GPTDatasetConfig``; DataError otherwise."""
    config = gpt_dataset_config(data_path, split, seq_length, seed, tokenizer, data_cache_path)
    mcore = mcore_datasets("--data-path with indexed datasets")
    for prefix in config.blend[0]:
        dataset = mcore.IndexedDataset(prefix)
        lengths = dataset.sequence_lengths
        expected = (
            0
            if len(lengths) == 0
            else int(dataset.index.sequence_pointers[-1] + lengths[-1] * dataset.index.dtype_size)
        )
        actual = os.path.getsize(prefix + ".bin")
        if actual != expected:
            raise DataError(
                f"--data-path {prefix}: {prefix}.bin holds {actual:,} bytes, its "
                f"index describes {expected:,} (files of two different datasets?)"
            )
        count = len(lengths)
        for name, bookends in zip(SPLIT_NAMES, config.split_matrix):
            if bookends is None:  # a share of 0: Megatron builds no dataset
                continue
            begin, end = (int(round(edge * float(count))) for edge in bookends)
            if int(lengths[begin:end].sum()) == 0:
                raise DataError(
                    f"--data-path {prefix}: its {name} split (--split {split}: sequences "
                    f"{begin} to {end} of {count}) holds no tokens; give it more documents, "
                    "that split a larger share, or a share of 0 (e.g. --split 98,2,0)"
                )
    return config


@dataclass(frozen=True)
class GPTDatasets:
    """Megatron's train, validation and test datasets (None where ``--split`` gives no share)."""

    train: Any
    valid: Any
    test: Any


def build_gpt_datasets(
    data_path: Sequence[str],
    split: str,
    seq_length: int,
    seed: int,
    num_samples: Sequence[int],
    tokenizer: Tokenizer,
    data_cache_path: str | os.PathLike | None = None,
) -> GPTDatasets:
    """Megatron's datasets for these flags (``num_samples``: ``megatron_sample_counts``).

    Collective where ``torch.distributed`` is initialized: call it on every rank of the default
    group (global rank 0 writes the caches, a barrier, then the others read them)."""
    config = check_gpt_data(
        data_path, split, seq_length, seed, num_samples, tokenizer, data_cache_path
    )
    mcore = mcore_datasets("--data-path with indexed datasets")
    builder = mcore.BlendedMegatronDatasetBuilder(
        mcore.GPTDataset, [int(n) for n in num_samples], lambda: True, config
    )
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        train, valid, test = builder.build()
    else:
        with _one_process_group():
            train, valid, test = builder.build()
    return GPTDatasets(train, valid, test)


@contextmanager
def _one_process_group() -> Iterator[None]:
    """A default process group of this process alone (gloo, an in-memory store), ended on exit:
    Megatron's blended dataset asks the rank whenever it writes a cache."""
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def stack_samples(dataset: Any, indices: Sequence[int]) -> Microbatch:
    """Samples ``indices`` of a Megatron GPT dataset as (tokens [b, s], labels [b, s]) int64."""
    samples = [dataset[int(i)] for i in indices]
    return (
        torch.stack([s["tokens"] for s in samples]),
        torch.stack([s["labels"] for s in samples]),
    )


@dataclass
class IndexedTrainBatches(SamplingPosition):
    """This data-parallel rank's microbatches of a Megatron train dataset, iteration by
    iteration, in Megatron's sampler order (see the module); position ``consumed_samples``."""

    dataset: Any
    global_batch_size: int
    micro_batch_size: int
    dp: int
    dp_rank: int
    seed: int
    consumed_samples: int = 0

    def __post_init__(self) -> None:
        self.check_batch_shape()

    def next_batch(self) -> list[Microbatch]:
        """The next iteration's ``num_microbatches`` microbatches of this rank."""
        end = self.consumed_samples + self.global_batch_size
        if end > len(self.dataset):
            raise DataError(
                f"the train split holds {len(self.dataset):,} samples and the next iteration "
                f"needs samples up to {end:,} (build the datasets with megatron_sample_counts "
                "of this run's --train-iters)"
            )
        mbs, stride = self.micro_batch_size, self.micro_batch_size * self.dp
        batches = []
        for start in range(self.consumed_samples, end, stride):
            first = start + self.dp_rank * mbs
            batches.append(stack_samples(self.dataset, range(first, first + mbs)))
        self.consumed_samples = end
        return batches


def indexed_validation_batches(
    dataset: Any,
    eval_iters: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp: int,
    dp_rank: int,
) -> list[list[Microbatch]]:
    """The same ``eval_iters`` validation batches at every evaluation (the validation split's
    first samples, in the train batches' order; wrapping if the split is small)."""
    if eval_iters == 0:
        return []
    if dataset is None or len(dataset) == 0:
        raise DataError(
            "the validation split holds no samples (--split gives it no share) "
            f"but --eval-iters={eval_iters}"
        )
    mbs, stride = micro_batch_size, micro_batch_size * dp
    batches = []
    for it in range(eval_iters):
        begin = it * global_batch_size
        batches.append(
            [
                stack_samples(dataset, [(s + dp_rank * mbs + j) % len(dataset) for j in range(mbs)])
                for s in range(begin, begin + global_batch_size, stride)
            ]
        )
    return batches
