"""The job's data: raw text read byte level, or Megatron's indexed datasets read through its
``GPTDataset`` (``megapipe.data.gpt_samples``), as this rank's batches.

``build_data(config, dp, dp_rank)`` returns the train batches (resumable: ``state_dict``), the
validation batches, the log's data line and, for bits per byte, the UTF-8 bytes each token id
stands for (``megapipe.data.bits_per_byte``; None for a tokenizer without fixed bytes per
token). With indexed data the datasets are sized as Megatron sizes them
(``megatron_sample_counts``) and built collectively: every rank of the default group calls
``build_data`` (global rank 0 writes the index caches, then the others read them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megapipe.data.bits_per_byte import token_byte_counts
from megapipe.data.blend import parse_data_path
from megapipe.data.gpt_samples import (
    IndexedTrainBatches,
    build_gpt_datasets,
    indexed_validation_batches,
    megatron_sample_counts,
)
from megapipe.data.raw_text import (
    Microbatch,
    TrainBatches,
    load_tokens,
    resolve_data_files,
    split_corpus,
    validation_batches,
)
from megapipe.train.config.job_config import JobConfig


@dataclass
class JobData:
    """What ``build_data`` makes (module docstring)."""

    batches: TrainBatches | IndexedTrainBatches
    valid: list[list[Microbatch]]
    description: str
    byte_counts: torch.Tensor | None  # int64 [padded vocabulary]: bytes per token id


def build_data(config: JobConfig, dp: int, dp_rank: int) -> JobData:
    """This data-parallel rank's data (collective with indexed data: see the module)."""
    data, tok = config.data, config.tokenizer
    tokenizer = tok.build()
    counts = token_byte_counts(tokenizer, tok.padded_vocab_size) if tokenizer.byte_level else None
    gbs, mbs, seq = data.global_batch_size, data.micro_batch_size, config.model.seq_length
    evaluates = bool(data.eval_interval and data.eval_iters)
    if not data.indexed:
        files = resolve_data_files(data.paths)
        splits = split_corpus(load_tokens(files), seq)
        batches: TrainBatches | IndexedTrainBatches = TrainBatches(
            splits, gbs, mbs, dp, dp_rank, config.seed
        )
        valid = validation_batches(splits, data.eval_iters, gbs, mbs, dp, dp_rank)
        line = (
            f"data: {len(files)} files, {splits.tokens.numel():,} byte tokens, "
            f"{splits.num_train:,} train / {splits.num_valid:,} validation windows"
        )
        return JobData(batches, valid, line, counts)
    samples = megatron_sample_counts(config.train_iters, gbs, data.eval_interval, data.eval_iters)
    datasets = build_gpt_datasets(
        data.paths, data.split, seq, config.seed, samples, tokenizer, data.cache_path
    )
    batches = IndexedTrainBatches(datasets.train, gbs, mbs, dp, dp_rank, config.seed)
    valid = (
        indexed_validation_batches(datasets.valid, data.eval_iters, gbs, mbs, dp, dp_rank)
        if evaluates
        else []
    )
    return JobData(batches, valid, _indexed_line(config, datasets), counts)


def _indexed_line(config: JobConfig, datasets) -> str:
    """``data: 2 indexed datasets (0.7 A, 0.3 B), split 98,2,0: N train / M validation
    samples of Megatron's GPTDataset``."""
    blend = parse_data_path(config.data.paths)
    weights = blend.weights or [None] * len(blend.prefixes)
    named = ", ".join(f"{w:g} {p}" if w is not None else p for w, p in zip(weights, blend.prefixes))
    valid = 0 if datasets.valid is None else len(datasets.valid)
    return (
        f"data: {len(blend.prefixes)} indexed dataset(s) ({named}), split "
        f"{config.data.split}: {len(datasets.train):,} train / {valid:,} validation samples "
        "of Megatron's GPTDataset"
    )
