"""Deterministic parameter initialisation keyed by global indices, so any EP size or stage
split builds exactly the same weights as the single-process model."""

from __future__ import annotations

import hashlib

import torch


def derive_seed(seed: int, *keys: int | str) -> int:
    """A 63-bit seed that depends only on ``seed`` and ``keys`` (e.g. layer index, expert index)."""
    text = "/".join(str(part) for part in (seed, *keys))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def seeded_normal(shape: tuple[int, ...], std: float, seed: int, *keys: int | str) -> torch.Tensor:
    """A float32 CPU tensor drawn from N(0, std^2) with a generator seeded by ``derive_seed``."""
    generator = torch.Generator().manual_seed(derive_seed(seed, *keys))
    return torch.randn(shape, generator=generator, dtype=torch.float32) * std
