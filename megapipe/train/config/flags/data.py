"""The data's flags: the tokenizer and Megatron's indexed datasets (``--help`` group "data and
tokenizer"; ``--data-path`` itself is with the run's inputs and outputs, ``inputs_outputs``).
"""

from __future__ import annotations

from dataclasses import dataclass

from megapipe.data.tokenizer import TOKENIZER_TYPES
from megapipe.train.config.declare import flag, one_of

DATA = "data and tokenizer"  # its --help group


@dataclass(frozen=True)
class DataFlags:
    """Which tokenizer reads the data; the splits and caches of indexed data."""

    tokenizer_type: str | None = flag(
        None,
        "HuggingFaceTokenizer (--tokenizer-model) or ByteTokenizer (256 byte ids; the "
        "default for raw text; indexed data needs the type preprocess-data used)",
        one_of(*TOKENIZER_TYPES),
        group=DATA,
    )
    tokenizer_model: str | None = flag(
        None,
        "a Hugging Face tokenizer.json or its directory (megapipe train-tokenizer's output)",
        group=DATA,
        metavar="PATH",
    )
    split: str | None = flag(
        None,
        "with indexed data: train,validation,test shares of each dataset (default "
        "Megatron's 969,30,1)",
        group=DATA,
    )
    data_cache_path: str | None = flag(
        None,
        "with indexed data: where Megatron's index caches go (default PREFIX's folder's cache/)",
        group=DATA,
        metavar="DIR",
    )
