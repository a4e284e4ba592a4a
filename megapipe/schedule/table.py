"""A schedule's action lists as integer columns: what build, lower, validate and simulate run on.

One row per action, the ranks one after another (rank r's actions are rows
``offsets[r]:offsets[r + 1]``). Columns: ``kind`` (a code below), ``stage`` and ``mb``; an
OVERLAP keeps its forward half in those and its backward half in ``back_kind``, ``back_stage``
and ``back_mb`` (-1 on every other row; a table without OVERLAP rows stores none). Stage and
microbatch columns are 32-bit, so a million-row table is little memory traffic; arithmetic that
multiplies them widens first. Action objects are made only when asked for (``actions_of``):
making a million of them would cost more than building, lowering, checking and simulating the
schedule they belong to.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .actions import Action, Kind, plain_key

F, B, I, W, OVERLAP, SEND_F, RECV_F, SEND_B, RECV_B = range(9)  # noqa: E741
KINDS = (
    Kind.F,
    Kind.B,
    Kind.I,
    Kind.W,
    Kind.OVERLAP,
    Kind.SEND_F,
    Kind.RECV_F,
    Kind.SEND_B,
    Kind.RECV_B,
)
CODE = {kind: code for code, kind in enumerate(KINDS)}
COMM_CODES = (SEND_F, RECV_F, SEND_B, RECV_B)
NONE = -1

Rows = Sequence[Iterable[Action]]


def is_comm(kind: np.ndarray) -> np.ndarray:
    """Which codes are SEND/RECV."""
    return kind >= SEND_F


def is_backward(kind: np.ndarray) -> np.ndarray:
    """Which codes are B or I."""
    return (kind == B) | (kind == I)


class Comps(NamedTuple):
    """The table's computations, one row each: an OVERLAP gives two (forward half first), any
    other action one (SEND/RECV included). ``action`` is the row of the action in the table."""

    action: np.ndarray
    half: np.ndarray
    kind: np.ndarray
    stage: np.ndarray
    mb: np.ndarray
    rank: np.ndarray


_INT32 = np.iinfo(np.int32)


def _frozen(array: np.ndarray, dtype) -> np.ndarray:
    array = np.asarray(array)
    if (
        dtype == np.int32
        and array.dtype != np.int32
        and array.size
        and (array.min() < _INT32.min or array.max() > _INT32.max)
    ):
        raise ValueError("stage and microbatch numbers must fit in 32 bits")
    array = np.ascontiguousarray(array, dtype=dtype)
    array.setflags(write=False)
    return array


@dataclass(frozen=True, eq=False)
class ActionTable:
    """Per-rank action lists as integer columns (module docstring)."""

    offsets: np.ndarray
    kind: np.ndarray
    stage: np.ndarray
    mb: np.ndarray
    _back: tuple | None = None  # (back_kind, back_stage, back_mb); None: no OVERLAP rows
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_columns(
        cls, offsets, kind, stage, mb, back_kind=None, back_stage=None, back_mb=None
    ) -> ActionTable:
        kind = _frozen(kind, np.int8)
        back = None
        if back_kind is not None and (kind == OVERLAP).any():
            back = (
                _frozen(back_kind, np.int8),
                _frozen(back_stage, np.int32),
                _frozen(back_mb, np.int32),
            )
        return cls(
            _frozen(offsets, np.int64), kind, _frozen(stage, np.int32), _frozen(mb, np.int32), back
        )

    def _back_column(self, i: int) -> np.ndarray:
        if self._back is not None:
            return self._back[i]
        return self._cached("no_back", lambda: _frozen(np.full(len(self), NONE), np.int32))

    @property
    def back_kind(self) -> np.ndarray:
        """Code of an OVERLAP's backward half (B or I); -1 on other rows."""
        return self._back_column(0)

    @property
    def back_stage(self) -> np.ndarray:
        return self._back_column(1)

    @property
    def back_mb(self) -> np.ndarray:
        return self._back_column(2)

    @classmethod
    def from_rows(cls, rows: Rows) -> ActionTable:
        """Encode per-rank lists of ``Action`` objects."""
        columns: list[list[int]] = [[], [], [], [], [], []]
        offsets = [0]
        for row in rows:
            for action in row:
                code = CODE[action.kind]
                if code == OVERLAP:
                    forward, backward = action.sub_actions
                    values = (code, *plain_key(forward), CODE[backward.kind], *plain_key(backward))
                else:
                    values = (code, *plain_key(action), NONE, NONE, NONE)
                for column, value in zip(columns, values):
                    column.append(value)
            offsets.append(len(columns[0]))
        return cls.from_columns(offsets, *columns)

    @classmethod
    def from_blocks(cls, blocks: Sequence[Sequence[np.ndarray]]) -> ActionTable:
        """One block of columns (kind, stage, mb[, back_kind, back_stage, back_mb]) per rank."""
        offsets = np.concatenate([[0], np.cumsum([len(b[0]) for b in blocks])])
        width = max((len(b) for b in blocks), default=3)
        columns = []
        for c in range(width):
            parts = [b[c] if c < len(b) else np.full(len(b[0]), NONE) for b in blocks]
            columns.append(np.concatenate(parts) if parts else np.zeros(0, np.int64))
        return cls.from_columns(offsets, *columns)

    @property
    def pp(self) -> int:
        return len(self.offsets) - 1

    def __len__(self) -> int:
        return len(self.kind)

    def _cached(self, key: Hashable, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    @property
    def rank(self) -> np.ndarray:
        """The rank of each row."""
        return self._cached(
            "rank", lambda: np.repeat(np.arange(self.pp, dtype=np.int64), np.diff(self.offsets))
        )

    @property
    def local_index(self) -> np.ndarray:
        """Each row's index in its rank's list."""
        return self._cached("local", lambda: np.arange(len(self)) - self.offsets[self.rank])

    @property
    def compute_only(self) -> bool:
        return self._cached("compute_only", lambda: not bool(is_comm(self.kind).any()))

    @property
    def has_overlap(self) -> bool:
        return self._cached("has_overlap", lambda: bool((self.kind == OVERLAP).any()))

    def comps(self) -> Comps:
        """The computations of every action (``Comps``)."""
        return self._cached("comps", self._make_comps)

    def _make_comps(self) -> Comps:
        if self._back is None:
            zeros = np.zeros(len(self), dtype=np.int8)
            return Comps(np.arange(len(self)), zeros, self.kind, self.stage, self.mb, self.rank)
        second = self.kind == OVERLAP
        action = np.repeat(np.arange(len(self)), 1 + second)
        half = np.zeros(len(action), dtype=np.int8)
        first_of = np.cumsum(1 + second) - (1 + second)
        half[first_of[second] + 1] = 1
        back = half == 1
        kind = self.kind[action].copy()
        kind[(kind == OVERLAP) & ~back] = F
        kind[back] = self.back_kind[action[back]]
        stage = np.where(back, self.back_stage[action], self.stage[action])
        mb = np.where(back, self.back_mb[action], self.mb[action])
        return Comps(action, half, kind, stage, mb, self.rank[action])

    def select(self, keep: np.ndarray) -> ActionTable:
        """The rows where ``keep`` is true, ranks kept apart."""
        counts = np.concatenate([[0], np.cumsum(keep, dtype=np.int64)])
        back = [] if self._back is None else [column[keep] for column in self._back]
        return ActionTable.from_columns(
            counts[self.offsets], self.kind[keep], self.stage[keep], self.mb[keep], *back
        )

    def actions_of(self, rank: int) -> tuple[Action, ...]:
        """Rank ``rank``'s list as ``Action`` objects."""
        lo, hi = int(self.offsets[rank]), int(self.offsets[rank + 1])
        columns = [
            c[lo:hi].tolist()
            for c in (self.kind, self.stage, self.mb, self.back_kind, self.back_stage, self.back_mb)
        ]
        out = []
        make = Action.trusted
        for code, stage, mb, back, back_stage, back_mb in zip(*columns):
            if code == OVERLAP:
                halves = (make(stage, Kind.F, mb), make(back_stage, KINDS[back], back_mb))
                out.append(make(None, Kind.OVERLAP, None, halves))
            else:
                out.append(make(stage, KINDS[code], mb))
        return tuple(out)

    def texts_of(self, rank: int) -> list[str]:
        """Rank ``rank``'s list as action texts (``str(action)``), without making actions."""
        lo, hi = int(self.offsets[rank]), int(self.offsets[rank + 1])
        columns = [
            c[lo:hi].tolist()
            for c in (self.kind, self.stage, self.mb, self.back_kind, self.back_stage, self.back_mb)
        ]
        names = [k.value for k in KINDS]
        return [
            f"({stage}F{mb};{back_stage}{names[back]}{back_mb})OVERLAP_F_B"
            if code == OVERLAP
            else f"{stage}{names[code]}{mb}"
            for code, stage, mb, back, back_stage, back_mb in zip(*columns)
        ]

    def same_as(self, other: ActionTable) -> bool:
        columns = ("offsets", "kind", "stage", "mb", "back_kind", "back_stage", "back_mb")
        if (self._back is None) != (other._back is None):
            return False
        return all(np.array_equal(getattr(self, c), getattr(other, c)) for c in columns)

    def digest(self) -> bytes:
        """A content hash of the columns (equal tables, equal digests)."""

        def make() -> bytes:
            h = hashlib.blake2b(digest_size=16)
            for column in (self.offsets, self.kind, self.stage, self.mb, *(self._back or ())):
                h.update(column.tobytes())
            return h.digest()

        return self._cached("digest", make)
