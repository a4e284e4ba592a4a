"""Which backward pairs with which forward, and the lists with those pairs fused: the mechanics
of the overlap pass (``megapipe.schedule.overlap_pass.apply`` says why), for every rank at once.

Rank r runs ``e_r`` extra warmup forwards. With ``n(b)`` the forwards that precede backward b
(B or I) in the original list, the forwards with index below ``n(b) + e_r - 1`` run before b, and
if b was followed by a forward (W actions aside), forward number ``n(b) + e_r - 1`` may be fused
with b into one pair placed where b was. Forwards keep their order, backwards and W's keep theirs.

Only the last backward of consecutive backwards (W's aside) can have a partner, and its partner's
number is one more than any earlier pair's, so every candidate pair can be fused whatever other
pairs are split: the fused lists are a merge of the forwards and the other actions, each of the
latter placed after the forwards its backward must follow.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..actions import Action, Kind
from ..table import OVERLAP, ActionTable, F, W, is_backward


def pair_is_independent(forward: Action, backward: Action) -> bool:
    """Whether a forward and a backward may run as one OVERLAP pair.

    A backward of microbatch j needs the loss of j, hence every forward of j, while a forward
    needs no backward; so the two are independent exactly when their microbatches differ.
    """
    if forward.kind is not Kind.F or backward.kind not in (Kind.B, Kind.I):
        raise ValueError(f"a pair is (forward; B or I), got ({forward}; {backward})")
    return forward.microbatch != backward.microbatch


def _within_rank(table: ActionTable, counted: np.ndarray) -> np.ndarray:
    """How many rows before each row, on its own rank, are ``counted``."""
    running = np.concatenate([[0], np.cumsum(counted, dtype=np.int64)])
    return running[:-1] - running[table.offsets[table.rank]]


@dataclass(frozen=True)
class Candidates:
    """Every pair a pairing may fuse: row of the backward, row of its forward (table rows)."""

    backward: np.ndarray
    forward: np.ndarray


def find_pairs(table: ActionTable, extra: np.ndarray, cross_stage_only: bool) -> Candidates:
    """Pair each backward that a forward follows (W's aside) with forward ``n(b) + e_r - 1`` of
    its rank, if that forward exists, is another microbatch, and (``cross_stage_only``) runs
    another stage. ``extra`` is ``e_r`` per rank."""
    kind = table.kind
    forward = kind == F
    forwards = np.flatnonzero(forward)
    seen = _within_rank(table, forward)
    per_rank = np.diff(np.concatenate([[0], np.cumsum(forward)])[table.offsets])
    not_w = np.flatnonzero(kind != W)
    backward = np.flatnonzero(is_backward(kind))
    after = not_w[np.minimum(np.searchsorted(not_w, backward, "right"), len(not_w) - 1)]
    rank = table.rank[backward]
    partner = seen[backward] + extra[rank] - 1
    ok = (after > backward) & (after < table.offsets[rank + 1]) & (kind[after] == F)
    ok &= partner < per_rank[rank]
    before_rank = np.concatenate([[0], np.cumsum(per_rank)])[rank]
    mate = (
        forwards[np.minimum(before_rank + partner, max(len(forwards) - 1, 0))]
        if len(forwards)
        else np.zeros(len(backward), dtype=np.int64)
    )
    ok &= table.mb[mate] != table.mb[backward]
    if cross_stage_only:
        ok &= table.stage[mate] != table.stage[backward]
    return Candidates(backward[ok], mate[ok])


def assemble(
    table: ActionTable, pairs: Candidates, fused: np.ndarray, extra: np.ndarray
) -> tuple[ActionTable, np.ndarray, np.ndarray]:
    """The lists with ``e_r`` more forwards ahead and the pairs where ``fused`` fused; also,
    per row of the result, which pair it holds (-1: none) and the row of ``table`` it comes
    from (a pair's: its backward's)."""
    kind = table.kind
    forward = kind == F
    rank = table.rank
    seen = _within_rank(table, forward)
    per_rank = np.diff(np.concatenate([[0], np.cumsum(forward)])[table.offsets])
    paired = np.zeros(len(table), dtype=bool)
    paired[pairs.backward[fused]] = True
    partner_of = np.full(len(table), -1, dtype=np.int64)
    partner_of[pairs.backward] = np.arange(len(pairs.backward))
    lead = np.where(is_backward(kind), np.minimum(seen + extra[rank] - 1, per_rank[rank]), 0)
    # Forwards placed before each other row: at least its own lead, and every forward the rows
    # before it (on its rank) placed or took into a pair.
    base = rank * (int(per_rank.max(initial=0)) + 2)
    placed = np.where(forward, -1, lead + paired) + base
    before = np.concatenate([[-1], np.maximum.accumulate(placed)[:-1]])
    cut = np.maximum(np.maximum(before, lead + base), base) - base
    taken = np.zeros(len(table), dtype=bool)
    taken[pairs.forward[fused]] = True
    keep = ~taken
    ordinal = seen  # a forward's number among its rank's forwards
    primary = np.where(forward, ordinal + 1, cut)
    key = (rank * (int(per_rank.max(initial=0)) + 2) + primary) * 2 + np.where(forward, 0, 1)
    rows = np.flatnonzero(keep)
    order = rows[np.argsort(key[rows], kind="stable")]
    pair_of = np.where(paired[order], partner_of[order], -1)
    mate = pairs.forward[np.maximum(pair_of, 0)] if len(pairs.forward) else order
    is_pair = pair_of >= 0
    counts = np.concatenate([[0], np.cumsum(keep)])[table.offsets]
    out = ActionTable.from_columns(
        counts,
        np.where(is_pair, OVERLAP, kind[order]),
        np.where(is_pair, table.stage[mate], table.stage[order]),
        np.where(is_pair, table.mb[mate], table.mb[order]),
        np.where(is_pair, kind[order], table.back_kind[order]),
        np.where(is_pair, table.stage[order], table.back_stage[order]),
        np.where(is_pair, table.mb[order], table.back_mb[order]),
    )
    return out, pair_of, order
