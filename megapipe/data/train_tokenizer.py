"""``megapipe train-tokenizer``: a byte-level BPE trained on local files with ``tokenizers``.

Inputs are files and directories (walked recursively, sorted, hidden entries skipped); a
``.jsonl`` file contributes the ``--json-keys`` fields of each line (a list field: each item),
any other file its whole text (a file that is not UTF-8 text is skipped in a directory and
refused when named). The model is GPT-2's kind of BPE: bytes mapped to 256 printable
characters, so any text encodes with no unknown token, merges learnt up to ``vocab_size`` ids,
and ``<|endoftext|>`` (id 0) as the end-of-document token. ``tokenizer.json`` and a
``tokenizer_config.json`` naming that token ``eos_token`` (so ``transformers`` and Megatron's
``HuggingFaceTokenizer`` find the end of document) are written to the output directory. The
same inputs give the same files byte for byte.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from megapipe.data.errors import DataError
from megapipe.data.files import files_under

END_OF_DOCUMENT_TOKEN = "<|endoftext|>"
MIN_VOCAB_SIZE = 257  # the 256 byte characters and the end-of-document token


@dataclass(frozen=True)
class TrainedTokenizer:
    """What ``train_tokenizer`` wrote: the file, its vocabulary size, the corpus it read."""

    path: Path
    vocab_size: int
    files: int
    skipped: int
    texts: int


def corpus_files(inputs: Sequence[str | os.PathLike]) -> tuple[list[Path], list[Path]]:
    """The files ``inputs`` name, and those of them named explicitly (refused if not text)."""
    if not inputs:
        raise DataError("--input needs at least one file or directory")
    files, named = [], []
    for item in map(Path, inputs):
        if item.is_dir():
            found = files_under(item)
            if not found:
                raise DataError(f"--input directory {item} holds no files")
            files.extend(found)
        elif item.is_file():
            files.append(item)
            named.append(item)
        elif item.exists():
            raise DataError(f"--input {item} is neither a regular file nor a directory")
        else:
            raise DataError(f"--input {item} does not exist")
    return files, named


def jsonl_texts(path: Path, json_keys: Sequence[str]) -> Iterator[str]:
    """The ``json_keys`` fields of each non-blank line of ``path`` (a list field: its items)."""
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path} line {number} is not JSON ({err.msg})") from None
            for key in json_keys:
                if not isinstance(record, dict) or key not in record:
                    raise DataError(f"{path} line {number} has no {key!r} field")
                value = record[key]
                for text in value if isinstance(value, list) else [value]:
                    if not isinstance(text, str):
                        raise DataError(
                            f"{path} line {number}: field {key!r} holds "
                            f"{type(text).__name__}, not text"
                        )
                    yield text


class _Corpus:
    """The texts of the input files in order, counting the files skipped as not text."""

    def __init__(self, files: Sequence[Path], named: Sequence[Path], json_keys: Sequence[str]):
        self.files, self.named, self.json_keys = files, set(named), json_keys
        self.skipped = 0
        self.texts = 0

    def __iter__(self) -> Iterator[str]:
        for path in self.files:
            if path.suffix == ".jsonl":
                for text in jsonl_texts(path, self.json_keys):
                    self.texts += 1
                    yield text
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                if path in self.named:
                    raise DataError(f"--input {path} is not UTF-8 text") from None
                self.skipped += 1
                continue
            self.texts += 1
            yield text


def train_tokenizer(
    inputs: Sequence[str | os.PathLike],
    vocab_size: int,
    output: str | os.PathLike,
    json_keys: Sequence[str] = ("text",),
) -> TrainedTokenizer:
    """Train a byte-level BPE of at most ``vocab_size`` ids on ``inputs``; write
    ``output/tokenizer.json`` and ``output/tokenizer_config.json``."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise DataError(
            f"--vocab-size={vocab_size} must be at least {MIN_VOCAB_SIZE} (the 256 "
            "byte characters and the end-of-document token)"
        )
    out_dir = Path(output)
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"--output {out_dir} is a file; name a directory")
    files, named = corpus_files(inputs)
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise DataError(
            "train-tokenizer needs Hugging Face's tokenizers library (pip install -e '.[data]')"
        ) from None
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_DOCUMENT_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = _Corpus(files, named, json_keys)
    tokenizer.train_from_iterator(corpus, trainer)
    if corpus.texts == 0:
        raise DataError(f"--input {' '.join(map(str, inputs))} holds no text to train on")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "tokenizer.json"
    tokenizer.save(str(path))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": END_OF_DOCUMENT_TOKEN,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return TrainedTokenizer(
        path,
        tokenizer.get_vocab_size(with_added_tokens=True),
        len(files),
        corpus.skipped,
        corpus.texts,
    )
