"""``--data-path`` and ``--split`` as Megatron takes them, checked before any process group.

``--data-path`` is either prefixes (``A B``: blended in proportion to their sizes) or weights
and prefixes alternating (``0.3 A 0.7 B``: weights normalized by Megatron), each prefix naming
``PREFIX.bin`` and ``PREFIX.idx``. ``--split 969,30,1`` gives the train, validation and test
shares of every dataset's documents (``,`` or ``/`` between; missing shares are 0; normalized).
Megatron accepts some malformed values silently (its split parser skips what is not a number,
and an odd-length list whose items are numbers becomes prefixes named like numbers); megapipe
refuses them in one line instead.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megapipe.data.errors import DataError

INDEX_MAGIC = b"MMIDIDX\x00\x00"  # the first bytes of every Megatron .idx file


@dataclass(frozen=True)
class Blend:
    """The datasets of ``--data-path``: prefixes and, if given, their weights (as typed)."""

    prefixes: tuple[str, ...]
    weights: tuple[float, ...] | None

    def megatron(self) -> tuple[list[str], list[float] | None]:
        """The blend as ``BlendedMegatronDatasetConfig.blend`` takes it."""
        return list(self.prefixes), None if self.weights is None else list(self.weights)


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_data_path(values: Sequence[str]) -> Blend:
    """``--data-path``'s values as a Blend; DataError for weights that do not parse.

    Weighted when any value is a number: then values must alternate WEIGHT PREFIX, every weight
    a finite number > 0 and no prefix a number."""
    values = [v.strip() for v in values]
    if not values:
        raise DataError("--data-path needs at least one dataset prefix")
    numbers = [_number(v) for v in values]
    if all(n is None for n in numbers):
        return Blend(tuple(values), None)
    shown = " ".join(values)
    if len(values) % 2:
        raise DataError(
            f"--data-path {shown}: weights and prefixes must alternate "
            f"(WEIGHT PREFIX WEIGHT PREFIX ...), got {len(values)} values"
        )
    weights = []
    for i in range(0, len(values), 2):
        weight, prefix = numbers[i], values[i + 1]
        if weight is None:
            raise DataError(
                f"--data-path {shown}: weight {values[i]!r} is not a number (WEIGHT PREFIX pairs)"
            )
        if not math.isfinite(weight) or weight <= 0:
            raise DataError(f"--data-path {shown}: weight {values[i]} must be a finite number > 0")
        if numbers[i + 1] is not None:
            raise DataError(
                f"--data-path {shown}: {prefix!r} stands where a prefix should "
                "(WEIGHT PREFIX pairs)"
            )
        weights.append(weight)
    return Blend(tuple(values[1::2]), tuple(weights))


def parse_split(split: str) -> tuple[float, float, float]:
    """``--split`` (e.g. ``969,30,1`` or ``98/2``) as normalized train, valid, test shares."""
    parts = [p.strip() for p in re.split("[,/]", split)]
    if len(parts) > 3:
        raise DataError(f"--split {split}: at most 3 shares (train, validation, test)")
    shares = []
    for part in parts:
        value = _number(part)
        if value is None or not math.isfinite(value) or value < 0:
            raise DataError(
                f"--split {split}: {part!r} is not a number >= 0 (e.g. --split 969,30,1)"
            )
        shares.append(value)
    shares += [0.0] * (3 - len(shares))
    total = sum(shares)
    if total <= 0:
        raise DataError(f"--split {split}: the shares sum to 0")
    return shares[0] / total, shares[1] / total, shares[2] / total


def check_prefix(prefix: str) -> None:
    """``PREFIX.idx`` (a Megatron index) and ``PREFIX.bin`` exist; DataError naming the one
    that does not."""
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix) and not os.path.exists(prefix + suffix):
            raise DataError(
                f"--data-path {prefix}: name the prefix without {suffix} "
                f"(--data-path {prefix[: -len(suffix)]})"
            )
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    if not idx.is_file():
        hint = (
            " (megapipe preprocess-data writes PREFIX.bin and PREFIX.idx)"
            if not bin_.exists()
            else ""
        )
        raise DataError(f"--data-path {prefix}: {idx} does not exist{hint}")
    if not bin_.is_file():
        raise DataError(f"--data-path {prefix}: {idx} has no {bin_} beside it")
    with open(idx, "rb") as file:
        if file.read(len(INDEX_MAGIC)) != INDEX_MAGIC:
            raise DataError(f"--data-path {prefix}: {idx} is not a Megatron index file")


def is_indexed_prefix(path: str) -> bool:
    """Whether ``path`` names an indexed dataset (``path.idx`` or ``path.bin`` exists) rather
    than raw text files."""
    return os.path.exists(path + ".idx") or os.path.exists(path + ".bin")


def check_data_path(values: Sequence[str]) -> Blend:
    """``--data-path`` parsed and each prefix's files checked (before any process group)."""
    blend = parse_data_path(values)
    for prefix in blend.prefixes:
        check_prefix(prefix)
    return blend
