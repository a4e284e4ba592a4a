"""``megapipe preprocess-data``: jsonl documents to Megatron's indexed dataset (``.bin``/``.idx``).

Megatron's ``tools/preprocess_data.py``, flag for flag where megapipe supports it: each
non-blank line of ``--input`` is a JSON object; for each of ``--json-keys`` its field (text, or
a list of texts: each one sequence) is tokenized, empty sequences dropped, and with
``--append-eod`` the end-of-document id appended to a non-empty document; the document goes to
``{--output-prefix}_{key}_document.bin`` and ``.idx`` through megatron-core's own
``IndexedDatasetBuilder``, ids stored as uint16 below 65,500 tokens, int32 above (Megatron's
``DType.optimal_dtype``). Documents keep the input's order. ``--workers N`` above 1 tokenizes in
a pool of N processes (batches of lines, results taken in order); ``--workers 1`` tokenizes in
this process. Sentence splitting (``--split-sentences``) and partitions are not offered.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from megapipe.data.errors import DataError
from megapipe.data.mcore_datasets import mcore_datasets
from megapipe.data.tokenizer import Tokenizer, build_tokenizer

LINES_PER_TASK = 64
Encoded = dict[str, tuple[list[int], list[int]]]  # key -> (document ids, sequence lengths)


@dataclass(frozen=True)
class PreprocessResult:
    """The datasets written (one prefix per json key), what they hold, who tokenized."""

    prefixes: list[str]
    documents: int
    tokens: int
    worker_pids: frozenset[int]


def output_prefix_of(output_prefix: str, key: str) -> str:
    """Megatron's naming: ``{prefix}_{key}_document`` (``.bin`` and ``.idx`` after it)."""
    return f"{output_prefix}_{key}_document"


@lru_cache(maxsize=2)
def _tokenizer(tokenizer_type: str, tokenizer_model: str | None) -> Tokenizer:
    return build_tokenizer(tokenizer_type, tokenizer_model)


def encode_record(
    line: str, where: str, tokenizer: Tokenizer, json_keys: Sequence[str], append_eod: bool
) -> Encoded:
    """One jsonl line as Megatron's preprocess encodes it (``where`` names it in errors)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{where} is not JSON ({err.msg})") from None
    encoded = {}
    for key in json_keys:
        if not isinstance(record, dict) or key not in record:
            raise DataError(f"{where} has no {key!r} field (--json-keys)")
        value = record[key]
        ids: list[int] = []
        lengths: list[int] = []
        for text in value if isinstance(value, list) else [value]:
            if not isinstance(text, str):
                raise DataError(f"{where}: field {key!r} holds {type(text).__name__}, not text")
            sequence = tokenizer.encode(text)
            if sequence:
                ids.extend(sequence)
                lengths.append(len(sequence))
        if ids and append_eod:
            assert tokenizer.eod is not None  # preprocess refuses --append-eod without one
            ids.append(tokenizer.eod)
            lengths[-1] += 1
        encoded[key] = (ids, lengths)
    return encoded


def _encode_task(
    task: tuple,
    tokenizer: Tokenizer | None = None,
) -> tuple[int, list[Encoded | None]]:
    """A batch of lines -> (this process's id, their encodings; None for a blank line). A pool
    process builds its tokenizer once (cached) from the names in the task."""
    path, first_line, lines, tokenizer_type, tokenizer_model, json_keys, append_eod = task
    tokenizer = tokenizer or _tokenizer(tokenizer_type, tokenizer_model)
    out = []
    for number, line in enumerate(lines, start=first_line):
        out.append(
            None
            if not line.strip()
            else encode_record(line, f"{path} line {number}", tokenizer, json_keys, append_eod)
        )
    return os.getpid(), out


def _tasks(path: Path, rest: tuple) -> Iterator[tuple]:
    with open(path, encoding="utf-8") as lines:
        batch: list[str] = []
        first = 1
        for number, line in enumerate(lines, start=1):
            batch.append(line)
            if len(batch) == LINES_PER_TASK:
                yield (str(path), first, batch, *rest)
                batch, first = [], number + 1
        if batch:
            yield (str(path), first, batch, *rest)


def preprocess(
    input_path: str | os.PathLike,
    json_keys: Sequence[str],
    tokenizer_type: str,
    tokenizer_model: str | None,
    output_prefix: str,
    append_eod: bool = False,
    workers: int = 1,
    log_interval: int = 1000,
    log: Callable[[str], None] | None = None,
) -> PreprocessResult:
    """Tokenize ``input_path`` (jsonl) into ``{output_prefix}_{key}_document.{bin,idx}``."""
    if workers < 1:
        raise DataError(f"--workers={workers} must be >= 1")
    if not json_keys:
        raise DataError("--json-keys needs at least one key")
    path = Path(input_path)
    if not path.is_file():
        raise DataError(
            f"--input {path} " + ("is not a regular file" if path.exists() else "does not exist")
        )
    tokenizer = build_tokenizer(tokenizer_type, tokenizer_model)
    if append_eod and tokenizer.eod is None:
        raise DataError(
            f"--append-eod: the tokenizer names no end-of-document token ({tokenizer.describe()})"
        )
    mcore = mcore_datasets("preprocess-data")
    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    prefixes = [output_prefix_of(output_prefix, key) for key in json_keys]
    dtype = mcore.DType.optimal_dtype(tokenizer.vocab_size)
    builders = {
        key: mcore.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
        for key, prefix in zip(json_keys, prefixes)
    }
    tasks = _tasks(path, (tokenizer_type, tokenizer_model, tuple(json_keys), append_eod))
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    start = time.perf_counter()  # the pace counts the pool's start
    try:
        with _TaskResults(tasks, workers, tokenizer) as results:
            documents, tokens, pids = _add_documents(results, builders, start, log_interval, log)
        for key, prefix in zip(json_keys, prefixes):
            builders[key].finalize(prefix + ".idx")
    except BaseException:
        for prefix in prefixes:
            for suffix in (".bin", ".idx"):
                Path(prefix + suffix).unlink(missing_ok=True)
        raise
    return PreprocessResult(prefixes, documents, tokens, frozenset(pids))


def _add_documents(
    results: Iterator[tuple[int, list[Encoded | None]]],
    builders: dict[str, Any],
    start: float,
    log_interval: int,
    log: Callable[[str], None],
) -> tuple[int, int, set[int]]:
    """Each encoded document into its key's dataset builder, in input order, logging the pace
    since ``start`` every ``log_interval`` documents: (documents, tokens, the ids of the
    processes that tokenized)."""
    documents = tokens = 0
    pids: set[int] = set()
    for pid, batch in results:
        pids.add(pid)
        for encoded in batch:
            if encoded is None:
                continue
            for key, (ids, lengths) in encoded.items():
                builders[key].add_document(ids, lengths)
                tokens += len(ids)
            documents += 1
            if documents % log_interval == 0:
                log(
                    f"processed {documents:,} documents "
                    f"({documents / (time.perf_counter() - start):.0f} docs/s)"
                )
    return documents, tokens, pids


class _TaskResults:
    """The encoded batches in input order: in this process, or from a pool of ``workers``
    spawned processes (spawned: the parent's threads, torch's or tokenizers', are not forked)."""

    def __init__(self, tasks: Iterator[tuple], workers: int, tokenizer: Tokenizer):
        self.tasks, self.workers, self.tokenizer = tasks, workers, tokenizer
        self.pool: multiprocessing.pool.Pool | None = None

    def __enter__(self) -> Iterator[tuple[int, list[Encoded | None]]]:
        if self.workers == 1:
            return (_encode_task(task, self.tokenizer) for task in self.tasks)
        pool = self.pool = multiprocessing.get_context("spawn").Pool(self.workers)
        return pool.imap(_encode_task, self.tasks)

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
