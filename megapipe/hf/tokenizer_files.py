"""The tokenizer files of an export: ``tokenizer.json`` and ``tokenizer_config.json``, which
``transformers.AutoTokenizer.from_pretrained`` reads.

- ``HuggingFaceTokenizer`` (Megatron's ``--tokenizer-type``): its ``tokenizer.json`` (a file,
  or a directory holding one, with its ``tokenizer_config.json`` and
  ``special_tokens_map.json`` when present) is copied; its vocabulary must fit the model's.
- ``ByteTokenizer`` (megapipe's byte level: one token per UTF-8 byte, id = byte value, NUL ends
  a document): written as a byte-level BPE with the 256 byte symbols and no merges, which gives
  the same ids for every text.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BYTE_LEVEL = "ByteTokenizer"  # megapipe's byte level tokenizer (--tokenizer-type ByteTokenizer)
HUGGING_FACE = "HuggingFaceTokenizer"
_COPIED = ("tokenizer_config.json", "special_tokens_map.json")


def tokenizer_file(model: str | Path) -> Path:
    """The ``tokenizer.json`` that ``--tokenizer-model`` names (the file or its directory)."""
    path = Path(model)
    found = path / "tokenizer.json" if path.is_dir() else path
    if not found.is_file():
        raise ValueError(f"--tokenizer-model {model}: no tokenizer.json there")
    return found


def _byte_level_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # the GPT-2 byte -> printable-character map the ByteLevel pre-tokenizer applies
    symbols = {b: ch for b, ch in zip(range(256), _bytes_to_unicode())}
    assert set(symbols.values()) == set(alphabet)
    tokenizer = Tokenizer(models.BPE(vocab={ch: b for b, ch in symbols.items()}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _bytes_to_unicode() -> list[str]:
    """Byte b -> the printable character GPT-2's byte-level BPE writes for it (printable
    Latin-1 bytes stand for themselves, the others for 256 + n, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    extra, chars = 0, []
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


@dataclass(frozen=True)
class TokenizerFiles:
    """A checked tokenizer, ready to write: its type, its ``tokenizer.json`` (Hugging Face),
    its size and its end-of-document id (None when it names none)."""

    kind: str
    source: Path | None
    size: int
    eos_token_id: int | None

    def describe(self) -> str:
        if self.source is None:
            return "byte level (256 byte tokens, id = byte)"
        return f"{self.source} ({self.size} tokens)"


def _eos_id(source: Path, tokenizer: Any) -> int | None:
    """The id of ``eos_token`` in the ``tokenizer_config.json`` beside ``source``, if any."""
    config_file = source.parent / "tokenizer_config.json"
    if not config_file.is_file():
        return None
    eos = json.loads(config_file.read_text()).get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    return tokenizer.token_to_id(eos) if isinstance(eos, str) else None


def check_tokenizer(spec: Mapping[str, Any], vocab_size: int) -> TokenizerFiles:
    """The tokenizer ``spec`` names (the descriptor's ``model.tokenizer``), checked: a
    ValueError for an unknown type, a missing file or a vocabulary larger than the model's."""
    kind = spec.get("tokenizer_type")
    if kind == BYTE_LEVEL:
        if vocab_size < 256:
            raise ValueError(
                f"a byte-level tokenizer needs vocab_size >= 256, the model has {vocab_size}"
            )
        return TokenizerFiles(kind, None, 256, 0)  # NUL (id 0) ends a document
    if kind != HUGGING_FACE:
        raise ValueError(
            f"tokenizer_type={kind!r}: the export writes {BYTE_LEVEL} or {HUGGING_FACE} tokenizers"
        )
    if not spec.get("tokenizer_model"):
        raise ValueError(f"a {HUGGING_FACE} needs its tokenizer_model (--tokenizer-model PATH)")
    source = tokenizer_file(spec["tokenizer_model"])
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(source))
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise ValueError(
            f"tokenizer {source} has {size} tokens, more than the model's vocab_size={vocab_size}"
        )
    return TokenizerFiles(kind, source, size, _eos_id(source, tokenizer))


def write_tokenizer(out: Path, files: TokenizerFiles) -> None:
    """Write the checked tokenizer's files into ``out``."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": None,
    }
    if files.source is None:
        _byte_level_tokenizer().save(str(out / "tokenizer.json"))
        config["eos_token"] = _bytes_to_unicode()[0]  # the symbol of byte 0
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return
    shutil.copyfile(files.source, out / "tokenizer.json")
    copied = [name for name in _COPIED if (files.source.parent / name).is_file()]
    for name in copied:
        shutil.copyfile(files.source.parent / name, out / name)
    if "tokenizer_config.json" not in copied:
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
