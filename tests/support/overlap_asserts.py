"""Bitwise comparison shared by the overlap engine's tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def assert_same_tensors(a: Sequence[torch.Tensor | None], b: Sequence[torch.Tensor | None]) -> None:
    """``a`` and ``b`` hold the same bits, position by position (None only where the other is)."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(x, y)
