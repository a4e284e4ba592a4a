"""The tokenizer and the data of the one-pass build (``build``): the tokenizer read once, the
data checked against it before any process group exists.

Raw text is read byte level and needs enough of it for two windows; Megatron's indexed datasets
need the tokenizer type preprocess-data used and splits that hold tokens. Each refusal is an
``ArgsError`` of one line.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from megapipe.train.config.declare import ArgsError
from megapipe.train.config.flag_checks import values_are_indexed
from megapipe.train.config.flags import PretrainFlags
from megapipe.train.config.job_config import DEFAULT_SPLIT, DataConfig, TokenizerConfig

if TYPE_CHECKING:  # a type only: the tokenizer is built inside, where tests can count it
    from megapipe.data.tokenizer import Tokenizer


def tokenizer_and_data(
    f: PretrainFlags, vocab_size: int | None
) -> tuple[TokenizerConfig, DataConfig]:
    """The tokenizer, read once, and the data it reads (raw text: byte level; indexed:
    Megatron's files, splits that hold tokens, the type preprocess-data used). The model's
    vocabulary: ``vocab_size``, else the tokenizer's padded as Megatron pads it."""
    from megapipe.data.errors import DataError  # torch-free
    from megapipe.data.tokenizer import build_tokenizer, padded_vocab_size

    data = DataConfig(
        f.data_path,
        f.micro_batch_size,
        f.global_batch_size,
        f.eval_interval,
        f.eval_iters,
        values_are_indexed(f.data_path),
        f.split or DEFAULT_SPLIT,
        f.data_cache_path,
    )
    kind = f.tokenizer_type or "ByteTokenizer"
    path = None if f.tokenizer_model is None else os.path.abspath(f.tokenizer_model)
    try:
        tokenizer = build_tokenizer(kind, path)
        if data.indexed:
            _check_indexed(f, data, tokenizer)
        else:
            _check_text(f)
    except DataError as err:
        raise ArgsError(str(err).splitlines()[0]) from None
    size = tokenizer.vocab_size
    padded = vocab_size or padded_vocab_size(size, f.make_vocab_size_divisible_by)
    return TokenizerConfig(kind, path, size, padded), data


def _check_text(f: PretrainFlags) -> None:
    """Raw text: read byte level, its own validation share, enough for two windows."""
    from megapipe.data.raw_text import check_corpus  # torch: only when flags are run

    if f.tokenizer_type not in (None, "ByteTokenizer"):
        raise ArgsError(
            f"--tokenizer-type {f.tokenizer_type} reads Megatron's indexed "
            "datasets (megapipe preprocess-data makes them); raw text "
            "--data-path files are read byte level (ByteTokenizer)"
        )
    for flag, value in (("--split", f.split), ("--data-cache-path", f.data_cache_path)):
        if value is not None:
            raise ArgsError(
                f"{flag} {value} needs indexed datasets in --data-path "
                "(raw text keeps its last 5% of windows for validation)"
            )
    try:  # every --data-path names readable text, enough for two windows of seq-length + 1
        check_corpus(f.data_path, f.seq_length)
    except (OSError, ValueError) as err:
        raise ArgsError(str(err).splitlines()[0]) from None


def _check_indexed(f: PretrainFlags, data: DataConfig, tokenizer: Tokenizer) -> None:
    """Megatron's dataset files and splits, before any process group (``check_gpt_data``)."""
    from megapipe.data.blend import parse_split
    from megapipe.data.gpt_samples import check_gpt_data, megatron_sample_counts

    if f.tokenizer_type is None:
        raise ArgsError(
            "--data-path with indexed datasets needs --tokenizer-type (the one "
            "preprocess-data used; with HuggingFaceTokenizer also --tokenizer-model)"
        )
    if f.eval_interval and f.eval_iters and parse_split(data.split)[1] == 0:
        raise ArgsError(
            f"--split {data.split} gives validation no share but --eval-interval="
            f"{f.eval_interval} evaluates (--eval-interval 0, or a share)"
        )
    counts = megatron_sample_counts(
        f.train_iters, f.global_batch_size, f.eval_interval, f.eval_iters
    )
    check_gpt_data(data.paths, data.split, f.seq_length, f.seed, counts, tokenizer, data.cache_path)
