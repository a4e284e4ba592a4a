"""``megapipe train-tokenizer`` and ``megapipe preprocess-data``, declared as ``Subcommand`` values.

``TRAIN_TOKENIZER`` and ``PREPROCESS_DATA`` are registered by ``cli.py``. A bad value is refused
by their ``check`` (``ArgsError``); bad input found while running raises ``DataError`` (a
``ValueError``); the command prints either as one line with exit status 2.
"""

from __future__ import annotations

import argparse

from megapipe.data.tokenizer import TOKENIZER_TYPES
from megapipe.data.train_tokenizer import MIN_VOCAB_SIZE
from megapipe.subcommand import Subcommand, at_least, check_values


def _train_tokenizer_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="DIR_OR_FILE",
        help="text files, .jsonl files (their --json-keys fields) and directories "
        "(walked recursively, sorted; files that are not UTF-8 text skipped)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=2048,
        help="the vocabulary size to reach, special token included (default 2048; "
        "at least 257: 256 bytes and the end of document)",
    )
    p.add_argument(
        "--output",
        required=True,
        metavar="TOKDIR",
        help="directory to write tokenizer.json and tokenizer_config.json to",
    )
    p.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="the fields of each .jsonl line to train on (default: text)",
    )


def _check_train_tokenizer(args: argparse.Namespace) -> argparse.Namespace:
    check_values(args, {"--vocab-size": (at_least(MIN_VOCAB_SIZE),)})
    return args


def _preprocess_data_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", required=True, help="a jsonl file: one JSON object per line")
    p.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="fields to tokenize, one dataset each (default: text)",
    )
    p.add_argument(
        "--tokenizer-type",
        required=True,
        choices=TOKENIZER_TYPES,
        help="HuggingFaceTokenizer (needs --tokenizer-model) or ByteTokenizer "
        "(megapipe's 256 byte ids)",
    )
    p.add_argument(
        "--tokenizer-model",
        default=None,
        metavar="PATH",
        help="a tokenizer.json, or a directory holding one (train-tokenizer's output)",
    )
    p.add_argument(
        "--output-prefix",
        required=True,
        help="path prefix of the output files (its folder is made if missing)",
    )
    p.add_argument(
        "--append-eod",
        action="store_true",
        help="end every non-empty document with the end-of-document token",
    )
    p.add_argument(
        "--workers", type=int, default=1, help="tokenizing processes (default 1: this process)"
    )
    p.add_argument(
        "--log-interval",
        type=int,
        default=1000,
        help="report progress every this many documents (default 1000)",
    )


def _check_preprocess_data(args: argparse.Namespace) -> argparse.Namespace:
    check_values(args, {"--workers": (at_least(1),), "--log-interval": (at_least(1),)})
    return args


def run_train_tokenizer(args: argparse.Namespace) -> int:
    """``megapipe train-tokenizer``: train, write, say what was written."""
    from megapipe.data.train_tokenizer import train_tokenizer

    result = train_tokenizer(args.input, args.vocab_size, args.output, args.json_keys)
    skipped = (
        f"; skipped {result.skipped} file(s) that are not UTF-8 text" if result.skipped else ""
    )
    short = (
        f" (the corpus gave no more merges than that; asked {args.vocab_size:,})"
        if result.vocab_size < args.vocab_size
        else ""
    )
    print(
        f"wrote {result.path}: {result.vocab_size:,} tokens{short}, <|endoftext|> = 0; "
        f"trained on {result.texts:,} texts from {result.files} file(s){skipped}"
    )
    return 0


def run_preprocess_data(args: argparse.Namespace) -> int:
    """``megapipe preprocess-data``: tokenize, write, say what was written."""
    from megapipe.data.preprocess import preprocess

    result = preprocess(
        args.input,
        args.json_keys,
        args.tokenizer_type,
        args.tokenizer_model,
        args.output_prefix,
        args.append_eod,
        args.workers,
        args.log_interval,
    )
    where = "in this process" if args.workers == 1 else f"in {args.workers} worker processes"
    for prefix in result.prefixes:
        print(f"wrote {prefix}.bin and {prefix}.idx")
    print(f"{result.documents:,} documents, {result.tokens:,} tokens, tokenized {where}")
    return 0


TRAIN_TOKENIZER = Subcommand(
    "train-tokenizer",
    "train a byte-level BPE tokenizer on local text files",
    "Train a byte-level BPE (Hugging Face tokenizers) on local files; write "
    "OUTPUT/tokenizer.json and OUTPUT/tokenizer_config.json, with <|endoftext|> (id 0) as "
    "the end-of-document token. The same inputs give the same files.",
    _train_tokenizer_arguments,
    _check_train_tokenizer,
    run_train_tokenizer,
)
PREPROCESS_DATA = Subcommand(
    "preprocess-data",
    "tokenize jsonl documents into Megatron's indexed dataset",
    "Megatron's tools/preprocess_data.py: tokenize each line's --json-keys "
    "fields and write OUTPUT_PREFIX_{key}_document.bin and .idx with megatron-core's "
    "IndexedDatasetBuilder (needs megatron-core).",
    _preprocess_data_arguments,
    _check_preprocess_data,
    run_preprocess_data,
)
