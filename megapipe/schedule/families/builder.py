"""Building one rank's action list as table columns: the generators' shared tools.

``RowBuilder`` numbers each (stage, kind) on its own counter, as the generators describe their
orders ("the next forward of stage s"), and emits either one action at a time (the short warmup
and cooldown phases) or a pattern repeated many times at once (the steady state, which is what
grows with the number of microbatches). ``warmup_then_alternate`` is the 1F1B shape.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..table import NONE, OVERLAP, F

# A pattern item: (stage, kind code) for a plain action, or (forward stage, backward stage,
# backward kind code) for a pair (an OVERLAP, or its forward then its backward).
Item = tuple


@dataclass
class RowBuilder:
    """One rank's list: per-(stage, kind) microbatch counters, and the FIFO of deferred W's.

    ``first_microbatch`` offsets a stage's counters (DualPipe's second direction starts at M/2);
    ``counts`` are keyed by (stage, kind code). ``overlap`` says whether a pair is one OVERLAP.
    """

    first_microbatch: dict[int, int] = field(default_factory=dict)
    overlap: bool = False
    counts: dict[tuple[int, int], int] = field(default_factory=dict)
    pending_w: deque = field(default_factory=deque)
    _blocks: list = field(default_factory=list)
    _loose: list = field(default_factory=list)

    def count(self, stage: int, kind: int) -> int:
        return self.counts.get((stage, kind), 0)

    def take(self, stage: int, kind: int) -> int:
        """The next microbatch of (stage, kind), counted."""
        n = self.count(stage, kind)
        self.counts[(stage, kind)] = n + 1
        return self.first_microbatch.get(stage, 0) + n

    def add(self, kind: int, stage: int, mb: int, back=(NONE, NONE, NONE)) -> None:
        """Append one action (for an OVERLAP, ``back`` is its backward half)."""
        self._loose.append((kind, stage, mb, *back))

    def run(self, stage: int, kind: int) -> None:
        """Append the next action of (stage, kind)."""
        self.add(kind, stage, self.take(stage, kind))

    def pair(self, forward_stage: int, backward_stage: int, backward_kind: int) -> None:
        """The next forward of one stage with the next backward of another: one OVERLAP, or
        the two one after the other without overlap."""
        f = self.take(forward_stage, F)
        b = self.take(backward_stage, backward_kind)
        if self.overlap:
            self.add(OVERLAP, forward_stage, f, (backward_kind, backward_stage, b))
        else:
            self.add(F, forward_stage, f)
            self.add(backward_kind, backward_stage, b)

    def _flush(self) -> None:
        if self._loose:
            self._blocks.append(np.array(self._loose, dtype=np.int64).reshape(-1, 6))
            self._loose = []

    def repeat(self, pattern: list[Item], times: int) -> None:
        """Append ``pattern`` ``times`` times, every item taking its next microbatch."""
        if times <= 0:
            return
        self._flush()
        per_item = []
        seen: dict[tuple[int, int], int] = {}
        for item in pattern:
            keys = [(item[0], F), (item[1], item[2])] if len(item) == 3 else [item]
            per_item.append([(key, seen.setdefault(key, 0)) for key in keys])
            for key in keys:
                seen[key] += 1
        columns = []
        for item, keyed in zip(pattern, per_item):
            mbs = [
                self.count(*key)
                + self.first_microbatch.get(key[0], 0)
                + offset
                + seen[key] * np.arange(times)
                for key, offset in keyed
            ]
            columns += self._item_columns(item, mbs, times)
        for key, uses in seen.items():
            self.counts[key] = self.count(*key) + uses * times
        block = np.stack([np.stack(c, axis=1) for c in columns], axis=1)
        self._blocks.append(block.reshape(-1, 6))

    def _item_columns(self, item: Item, mbs: list, times: int) -> list:
        ones, none = np.ones(times, dtype=np.int64), np.full(times, NONE, dtype=np.int64)
        if len(item) == 2:
            stage, kind = item
            return [[kind * ones, stage * ones, mbs[0], none, none, none]]
        f_stage, b_stage, b_kind = item
        if self.overlap:
            return [[OVERLAP * ones, f_stage * ones, mbs[0], b_kind * ones, b_stage * ones, mbs[1]]]
        return [
            [F * ones, f_stage * ones, mbs[0], none, none, none],
            [b_kind * ones, b_stage * ones, mbs[1], none, none, none],
        ]

    def columns(self) -> list[np.ndarray]:
        """The list so far as (kind, stage, mb, back_kind, back_stage, back_mb) columns."""
        self._flush()
        rows = np.concatenate(self._blocks) if self._blocks else np.zeros((0, 6), np.int64)
        return [rows[:, c] for c in range(6)]


def warmup_then_alternate(
    forwards: tuple[np.ndarray, np.ndarray],
    backwards: tuple[np.ndarray, np.ndarray],
    warmup: int,
    backward_kind: int,
) -> list[np.ndarray]:
    """The 1F1B shape as (kind, stage, mb) columns: ``warmup`` forwards, then one forward and
    one backward in turn, then the remaining backwards. ``forwards`` and ``backwards`` are
    (stage, mb) columns in the order they run."""
    total = len(forwards[0])
    steady = total - warmup
    kind = np.full(2 * total, backward_kind, dtype=np.int64)
    kind[:warmup] = F
    kind[warmup : warmup + 2 * steady : 2] = F
    columns = [kind]
    for f, b in zip(forwards, backwards):
        out = np.empty(2 * total, dtype=np.int64)
        out[:warmup] = f[:warmup]
        out[warmup : warmup + 2 * steady : 2] = f[warmup:]
        out[warmup + 1 : warmup + 2 * steady : 2] = b[:steady]
        out[warmup + 2 * steady :] = b[steady:]
        columns.append(out)
    return columns
