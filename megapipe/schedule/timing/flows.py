"""The dependency rules of ``deps`` applied to every computation of a schedule at once.

``deps`` states the rules as data (``NEEDS``, ``MAKES``, ``SENDS``, ``CARRIES``); here they become
code-indexed arrays, so a whole table's needs, products and messages are a few array operations.
Products get dense integer ids (``ProductSpace``) for the in-order run (``engine``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..ir import Schedule
from ..table import KINDS, Comps
from .deps import AFTER, BEFORE, CARRIES, MAKES, NEEDS, SELF, SENDS

assert (BEFORE, SELF, AFTER) == (-1, 0, 1), "neighbours() adds the offset to the stage"

LETTERS = ("F", "G", "W")  # product letters, coded 0, 1, 2
MESSAGE_LETTERS = ("F", "B")  # message letters, coded 0, 1


def _by_code(rule: dict, pick, missing) -> np.ndarray:
    return np.array([pick(rule[k]) if k in rule else missing for k in KINDS], dtype=np.int64)


# Per kind code: the letter and offset of need j (-1 letter: no such need), the product letter made,
# the message letter and direction of what it sends, what a SEND/RECV carries.
NEED_LETTER = [
    _by_code(NEEDS, lambda r, j=j: LETTERS.index(r[j][0]) if j < len(r) else -1, -1)
    for j in range(2)
]
NEED_STEP = [_by_code(NEEDS, lambda r, j=j: r[j][1] if j < len(r) else 0, 0) for j in range(2)]
MAKE_LETTER = _by_code(MAKES, LETTERS.index, -1)
SEND_LETTER = _by_code(SENDS, lambda r: MESSAGE_LETTERS.index(r[0]), -1)
SEND_STEP = _by_code(SENDS, lambda r: r[1], 0)
CARRY_LETTER = _by_code(CARRIES, lambda r: MESSAGE_LETTERS.index(r[0]), -1)
CARRY_SOURCE = _by_code(CARRIES, lambda r: r[1], 0)
CARRY_PEER = _by_code(CARRIES, lambda r: r[2], 0)


def neighbours(stage: np.ndarray, offset, per_pipeline: int) -> tuple[np.ndarray, np.ndarray]:
    """The stage ``offset`` away (``SELF``, ``BEFORE``, ``AFTER``; scalar or per element) and
    whether it exists (the ends of a pipeline have no stage before or after them)."""
    moved = stage % per_pipeline + offset  # offsets are -1, 0, 1: in the pipeline or just off it
    return stage + offset, (moved >= 0) & (moved < per_pipeline)


def stage_rank(schedule: Schedule, stage: np.ndarray) -> np.ndarray:
    """``stage_to_rank`` of each stage (-1 outside 0..S-1)."""
    padded = schedule.padded_placement  # -1 on both sides: one clipped lookup
    return padded[np.clip(np.asarray(stage) + 1, 0, len(padded) - 1)]


class Needs(NamedTuple):
    """Need j of each computation: its product letter code, stage, and whether it exists."""

    letter: np.ndarray
    stage: np.ndarray
    exists: np.ndarray


def _per_table(schedule: Schedule, comps: Comps, name: str, make):
    """``make()``, kept on the table when ``comps`` are the table's own computations (the
    lowering, the timeline and the checks all ask for the same ones)."""
    table = schedule.table
    if comps is not table.comps():
        return make()
    return table._cached((name, schedule.stages_per_pipeline, schedule.stage_to_rank), make)


def comp_needs(schedule: Schedule, comps: Comps) -> list[Needs]:
    """The (at most two) needs of every computation, in ``deps.needs_of`` order."""
    return _per_table(schedule, comps, "needs", lambda: _comp_needs(schedule, comps))


def _comp_needs(schedule: Schedule, comps: Comps) -> list[Needs]:
    out = []
    for j in range(2):
        letter = NEED_LETTER[j][comps.kind]
        stage, exists = neighbours(
            comps.stage, NEED_STEP[j][comps.kind], schedule.stages_per_pipeline
        )
        out.append(Needs(letter, stage, exists & (letter >= 0)))
    return out


@dataclass(frozen=True)
class ProductSpace:
    """Dense ids for the products a schedule makes: ``(letter, stage, mb)`` in the box
    ``[stage_lo, stage_lo + stages) x [mb_lo, mb_lo + mbs)``; anything outside is ``never``."""

    stage_lo: int
    stages: int
    mb_lo: int
    mbs: int

    @classmethod
    def covering(cls, stage: np.ndarray, mb: np.ndarray) -> ProductSpace:
        if len(stage) == 0:
            return cls(0, 1, 0, 1)
        lo_s, lo_m = int(stage.min()), int(mb.min())
        return cls(lo_s, int(stage.max()) - lo_s + 1, lo_m, int(mb.max()) - lo_m + 1)

    @property
    def size(self) -> int:
        return len(LETTERS) * self.stages * self.mbs

    @property
    def never(self) -> int:
        """The id of a product nobody makes (what the engine's unfilled entries hold)."""
        return 2 * self.size

    def ids(self, letter: np.ndarray, stage: np.ndarray, mb: np.ndarray) -> np.ndarray:
        wide: type[np.integer] = np.int32 if self.never < np.iinfo(np.int32).max else np.int64
        letter, stage, mb = (np.asarray(a).astype(wide, copy=False) for a in (letter, stage, mb))
        s, m = stage - self.stage_lo, mb - self.mb_lo
        inside = (s >= 0) & (s < self.stages) & (m >= 0) & (m < self.mbs) & (letter >= 0)
        return np.where(inside, (letter * self.stages + s) * self.mbs + m, self.never)

    def last_of(self, ids: np.ndarray, values: np.ndarray) -> np.ndarray:
        """A lookup (read it with ``lookup``) from each id to the value at its last place in
        ``ids`` (``values`` increasing), -1 for ids not there: one entry per id below ``size``
        and one for ``never``, in int32 where the values fit."""
        dense = np.minimum(ids, self.size)
        small = not len(values) or int(values[-1]) < np.iinfo(np.int32).max
        values = values.astype(np.int32 if small else np.int64, copy=False)
        out = np.full(self.size + 1, -1, dtype=values.dtype)
        out[dense] = values
        if not (out[dense] == values).all():  # an id repeats: keep its last (largest) value
            np.maximum.at(out, dense, values)
        return out

    def lookup(self, table: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """``table`` (from ``last_of``) at each of ``ids``."""
        return table[np.minimum(ids, self.size)]

    def id_of(self, product) -> int | None:
        """The id of one product ``(letter, stage, mb)``, or None outside the space."""
        try:
            letter, stage, mb = product
            code = LETTERS.index(letter)
        except (TypeError, ValueError):
            return None
        s, m = stage - self.stage_lo, mb - self.mb_lo
        if not (0 <= s < self.stages and 0 <= m < self.mbs):
            return None
        return (code * self.stages + s) * self.mbs + m

    def product(self, pid: int) -> tuple[str, int, int]:
        rest, m = divmod(pid, self.mbs)
        letter, s = divmod(rest, self.stages)
        return (LETTERS[letter], s + self.stage_lo, m + self.mb_lo)

    def decode(self, pids: np.ndarray) -> list[tuple[str, int, int]]:
        return [self.product(p) for p in pids.tolist()]


def sent_messages(schedule: Schedule, comps: Comps) -> tuple[np.ndarray, np.ndarray]:
    """Per computation: the letter code of the message its product becomes (-1: none, i.e. the
    consumer is on the same rank or there is none) and the sending stage (``deps.sent_message``)."""
    return _per_table(schedule, comps, "sent", lambda: _sent_messages(schedule, comps))


def _sent_messages(schedule: Schedule, comps: Comps) -> tuple[np.ndarray, np.ndarray]:
    letter = SEND_LETTER[comps.kind]
    target, exists = neighbours(comps.stage, SEND_STEP[comps.kind], schedule.stages_per_pipeline)
    remote = exists & (stage_rank(schedule, target) != stage_rank(schedule, comps.stage))
    return np.where((letter >= 0) & remote, letter, -1), comps.stage


def received_messages(schedule: Schedule, comps: Comps) -> tuple[np.ndarray, np.ndarray]:
    """Per computation: the letter code and sending stage of the message it must receive
    (-1: none), i.e. its first need made on another rank (``deps.received_message``)."""
    return _per_table(schedule, comps, "received", lambda: _received_messages(schedule, comps))


def _received_messages(schedule: Schedule, comps: Comps) -> tuple[np.ndarray, np.ndarray]:
    here = stage_rank(schedule, comps.stage)
    letter = np.full(len(comps.kind), -1, dtype=np.int64)
    stage = np.full(len(comps.kind), -1, dtype=np.int64)
    for need in reversed(comp_needs(schedule, comps)):  # the first remote need wins
        remote = need.exists & (stage_rank(schedule, need.stage) != here)
        letter = np.where(remote, np.where(need.letter == 0, 0, 1), letter)
        stage = np.where(remote, need.stage, stage)
    letter[SEND_LETTER[comps.kind] < 0] = -1
    return letter, stage
