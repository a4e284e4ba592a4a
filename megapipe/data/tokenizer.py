"""Tokenizers: one protocol, two implementations, and the vocabulary padded as Megatron pads it.

``--tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH`` (Megatron's names) reads a
Hugging Face ``tokenizer.json`` (PATH is the file or a directory holding it) through Hugging
Face's ``tokenizers`` library; it encodes as Megatron's ``_HuggingFaceTokenizer`` does
(``transformers``' tokenizer call: the post-processor's special tokens included), its vocabulary
is every id including added tokens, and its end of document is ``eos_token`` of the
``tokenizer_config.json`` beside the file (what ``transformers`` and so Megatron read), else the
first added token among ``<|endoftext|>``, ``</s>``, ``<|end_of_text|>``, ``<eos>``.
``--tokenizer-type ByteTokenizer`` is megapipe's own byte level tokenizer (the raw-text demo's):
one id per byte, 256 ids, end of document = id 0 (the NUL byte, which the raw-text reader strips
from files, so id 0 only ever marks a document's end).

Importing this module imports neither torch nor ``tokenizers`` (preprocess-data's worker
processes start fast).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Protocol

from megapipe.data.errors import DataError

TOKENIZER_TYPES = ("HuggingFaceTokenizer", "ByteTokenizer")
END_OF_DOCUMENT_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
BYTE_END_OF_DOCUMENT = 0


class Tokenizer(Protocol):
    """What megapipe needs of a tokenizer.

    ``vocab_size``: every id the tokenizer can produce (before Megatron's padding); ``eod``: the
    end-of-document id (None if the tokenizer names none); ``byte_level``: every id stands for a
    fixed byte string whatever its neighbours (then ``decode_bytes`` of one id is that token's
    bytes, as bits per byte needs); ``describe()``: one line for logs.
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def eod(self) -> int | None: ...

    @property
    def byte_level(self) -> bool: ...

    def encode(self, text: str) -> list[int]: ...

    def decode_bytes(self, ids: Sequence[int]) -> bytes: ...

    def describe(self) -> str: ...


class ByteTokenizer:
    """One id per UTF-8 byte: 256 ids; id 0 (the NUL byte) is the end of document."""

    vocab_size = 256
    eod = BYTE_END_OF_DOCUMENT
    byte_level = True

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return bytes(int(i) for i in ids)

    def describe(self) -> str:
        return "ByteTokenizer: 256 tokens, one per byte; end of document = byte 0"


@lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): each of the 256 characters -> the byte it stands
    for. Printable Latin-1 bytes stand for themselves; the others, in byte order, take the
    characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def resolve_tokenizer_file(path: str | os.PathLike) -> Path:
    """``--tokenizer-model`` as a file: the path itself, or ``tokenizer.json`` in a directory."""
    given = Path(path)
    if not given.exists():
        raise DataError(f"--tokenizer-model {path} does not exist")
    if given.is_dir():
        file = given / "tokenizer.json"
        if not file.is_file():
            raise DataError(
                f"--tokenizer-model {path} is a directory without tokenizer.json (name the "
                "file, or train one: megapipe train-tokenizer --output DIR)"
            )
        return file
    return given


class HuggingFaceTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library (see the module)."""

    def __init__(self, path: str | os.PathLike):
        self.path = resolve_tokenizer_file(path)
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise DataError(
                "--tokenizer-type HuggingFaceTokenizer needs Hugging Face's tokenizers library "
                "(pip install -e '.[data]')"
            ) from None
        try:
            self._tokenizer = HFTokenizer.from_file(str(self.path))
            spec = json.loads(self.path.read_text(encoding="utf-8"))
        except Exception as err:  # tokenizers raises its own exception type
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise DataError(
                f"--tokenizer-model {self.path} is not a Hugging Face tokenizer.json ({reason})"
            ) from None
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        added = self._tokenizer.get_added_tokens_decoder()
        self._special = frozenset(i for i, token in added.items() if token.special)
        self._added = {i: token.content for i, token in added.items()}
        decoder = spec.get("decoder") or {}
        self.byte_level: bool = decoder.get("type") == "ByteLevel"
        self.eod: int | None = self._end_of_document()

    def _end_of_document(self) -> int | None:
        config = self.path.parent / "tokenizer_config.json"
        if config.is_file():
            try:
                eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
            except (json.JSONDecodeError, AttributeError):
                raise DataError(f"{config} is not a JSON object") from None
            if isinstance(eos, dict):
                eos = eos.get("content")
            if eos is not None:
                found = self._tokenizer.token_to_id(eos)
                if found is None:
                    raise DataError(
                        f"{config} names eos_token {eos!r}, which the tokenizer "
                        f"{self.path} does not hold"
                    )
                return found
        for name in END_OF_DOCUMENT_NAMES:
            found = self._tokenizer.token_to_id(name)
            if found is not None and found in self._added:
                return found
        return None

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The bytes ``ids`` stand for, special tokens left out; exact per token when
        ``byte_level`` (a token may hold part of a UTF-8 character)."""
        ids = [int(i) for i in ids if int(i) not in self._special]
        if not self.byte_level:
            return self._tokenizer.decode(ids, skip_special_tokens=True).encode("utf-8")
        alphabet = byte_level_alphabet()
        out = bytearray()
        for i in ids:
            if i in self._added:
                out += self._added[i].encode("utf-8")
                continue
            token = self._tokenizer.id_to_token(i)
            if token is None:
                raise DataError(
                    f"token id {i} is outside the tokenizer {self.path} ({self.vocab_size} tokens)"
                )
            out += bytes(alphabet[c] for c in token)
        return bytes(out)

    def describe(self) -> str:
        eod = (
            "none"
            if self.eod is None
            else (f"{self._tokenizer.id_to_token(self.eod)} = {self.eod}")
        )
        return (
            f"HuggingFaceTokenizer {self.path}: {self.vocab_size:,} tokens; end of document {eod}"
        )


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | os.PathLike | None) -> Tokenizer:
    """The tokenizer Megatron's ``--tokenizer-type`` and ``--tokenizer-model`` name."""
    if tokenizer_type == "HuggingFaceTokenizer":
        if tokenizer_model is None:
            raise DataError(
                "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model PATH "
                "(a tokenizer.json or a directory holding one)"
            )
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "ByteTokenizer":
        if tokenizer_model is not None:
            raise DataError(
                f"--tokenizer-type ByteTokenizer takes no --tokenizer-model (got {tokenizer_model})"
            )
        return ByteTokenizer()
    raise DataError(
        f"--tokenizer-type {tokenizer_type} is not supported: megapipe reads "
        "HuggingFaceTokenizer (a tokenizer.json; GPT-2 and SentencePiece vocabularies convert "
        "to one) and ByteTokenizer"
    )


def padded_vocab_size(
    vocab_size: int, make_vocab_size_divisible_by: int = 128, tensor_model_parallel_size: int = 1
) -> int:
    """The vocabulary as Megatron pads it: rounded up to a multiple of
    ``--make-vocab-size-divisible-by`` x the tensor-parallel size."""
    for name, value in (
        ("vocabulary size", vocab_size),
        ("--make-vocab-size-divisible-by", make_vocab_size_divisible_by),
        ("--tensor-model-parallel-size", tensor_model_parallel_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DataError(f"{name}={value!r} must be a positive integer")
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return math.ceil(vocab_size / multiple) * multiple


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """Refuse a tokenizer whose ids do not all fit the model's embedding (DataError)."""
    if tokenizer.vocab_size > model_vocab_size:
        raise DataError(
            f"the tokenizer has {tokenizer.vocab_size:,} tokens, more than the model's "
            f"vocabulary of {model_vocab_size:,} ({tokenizer.describe()})"
        )
