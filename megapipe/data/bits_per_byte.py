"""Bits per byte: a validation loss that compares across tokenizers.

Loss per token depends on how much text a token holds; loss per byte of text does not. For each
token id, ``token_byte_counts`` gives the UTF-8 bytes it stands for: its ``decode_bytes`` length
for a byte-level tokenizer (a byte-level BPE: each merge's bytes; the byte tokenizer: 1), 0 for
special tokens such as the end of document (they are no text, so every tokenizer counts the same
bytes for the same documents) and for Megatron's padding ids. ``bits_per_byte`` is the summed
loss over the summed bytes of the target tokens: ``total nats / ln 2 / total bytes``. A
tokenizer whose tokens' bytes depend on their neighbours (e.g. SentencePiece's leading-space
marker) has no such table and is refused.
"""

from __future__ import annotations

import math

import torch

from megapipe.data.errors import DataError
from megapipe.data.tokenizer import Tokenizer


def token_byte_counts(tokenizer: Tokenizer, padded_vocab_size: int | None = None) -> torch.Tensor:
    """int64 [padded_vocab_size]: the UTF-8 bytes each id stands for (0 for special tokens and
    padding ids)."""
    if not tokenizer.byte_level:
        raise DataError(
            f"bits per byte needs a byte-level tokenizer, whose every token stands "
            f"for fixed bytes ({tokenizer.describe()})"
        )
    size = tokenizer.vocab_size if padded_vocab_size is None else padded_vocab_size
    if size < tokenizer.vocab_size:
        raise DataError(
            f"the padded vocabulary {size:,} is smaller than the tokenizer's "
            f"{tokenizer.vocab_size:,}"
        )
    counts = [len(tokenizer.decode_bytes([token])) for token in range(tokenizer.vocab_size)]
    if tokenizer.eod is not None:
        counts[tokenizer.eod] = 0
    return torch.tensor(counts + [0] * (size - len(counts)), dtype=torch.int64)


def target_bytes(labels: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The bytes of text the target tokens ``labels`` stand for, summed (a 0-d int64 tensor on
    ``labels``' device; no host read). Keep ``counts`` on that device (else it is copied)."""
    return counts.to(labels.device)[labels].sum()


def bits_per_byte(total_nats: float, total_bytes: int) -> float:
    """``total_nats / ln 2 / total_bytes``: the loss in bits per byte of target text."""
    if total_bytes <= 0:
        raise DataError(f"bits per byte over {total_bytes} bytes: the targets hold no text")
    return total_nats / math.log(2) / total_bytes
