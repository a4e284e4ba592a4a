"""A proof, checked in O(actions), that a lowered schedule finishes under batched p2p.

``check_batches`` (``comm_check``) simulates the batched p2p model; that costs more than lowering a
million-action schedule. Instead, give every event of the model a key and check that each event
comes after everything it waits for:

- a computation c runs at key (start of c, 1), with the start taken from a compute timeline;
- the batch b after computation p is posted at (start of p, 2), or (-inf, 2) with none before it;
- batch b completes at (T_b, 0), T_b the latest send time (end of the computation that made the
  tensor) of its messages.

Waits: a computation waits for the item before it on its rank and for the batch holding the
RECV of what it receives; a batch is posted after the computation before it; it completes after
it is posted, after the batch before it on its rank, and after each op's partner batch is posted
and that batch's predecessor completed. If every wait goes to a strictly smaller key there is no
cycle, so the schedule finishes. ``lower`` places each RECV before the first computation that starts
once its tensor is sent, which makes every such wait hold for the timeline it lowered with
(module docstring of ``lower``). Anything that does not hold (a hand-written schedule, another
placement, a broken one) leaves the answer to the simulation, which also words the error.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..ir import Schedule
from ..table import SEND_B, SEND_F, is_comm
from ..timing.flows import (
    CARRY_LETTER,
    CARRY_PEER,
    CARRY_SOURCE,
    ProductSpace,
    comp_needs,
    neighbours,
    received_messages,
    stage_rank,
)
from ..timing.timeline import Timeline


class _Ops(NamedTuple):
    """The SEND/RECV rows of a lowered table: row, kind, stage, microbatch, rank, and the
    message each carries (letter code, sending stage)."""

    row: np.ndarray
    kind: np.ndarray
    stage: np.ndarray
    mb: np.ndarray
    rank: np.ndarray
    letter: np.ndarray
    source: np.ndarray

    @property
    def sending(self) -> np.ndarray:
        return (self.kind == SEND_F) | (self.kind == SEND_B)


def certified(lowered: Schedule, timed: Timeline, source: Schedule) -> bool:
    """Whether the keys above prove that ``lowered`` finishes. ``source`` is the compute-only
    schedule whose actions are those of ``lowered`` in the same order, ``run`` its timeline."""
    table = lowered.table
    comm = is_comm(table.kind)
    compute_rows = np.flatnonzero(~comm)
    found = timed.graph
    if timed.stuck or not found.unique or found.table is not source.table:
        return False
    if not (_rank_order(source, timed) and _local_needs_made(source, found)):
        return False
    ops = _ops(lowered, comm)
    partner = _channels(lowered, ops)
    if partner is None:
        return False
    sent_at = _message_times(lowered, ops, partner, found, compute_rows, timed)
    if sent_at is None:
        return False
    start = np.full(len(table), -np.inf)
    start[compute_rows] = timed.start_flat
    batches = _Batches(table, comm, start, sent_at)
    return _batches_hold(batches, ops, partner) and _receives_hold(
        source, ops, compute_rows, timed, batches
    )


def _rank_order(source: Schedule, timed: Timeline) -> bool:
    """Computations sit on their stage's rank and start strictly later than the computation
    before them on it."""
    table = source.table
    comps = table.comps()
    if not (stage_rank(source, comps.stage) == comps.rank).all():
        return False
    same_rank = table.rank[1:] == table.rank[:-1]
    start = timed.start_flat
    return bool((start[1:][same_rank] > start[:-1][same_rank]).all())


def _local_needs_made(source: Schedule, found) -> bool:
    """What a computation needs from its own stage's rank is made earlier on that rank."""
    table = source.table
    comps = table.comps()
    maker = found.makers()
    for need in comp_needs(source, comps):
        local = need.exists & (stage_rank(source, need.stage) == comps.rank)
        by = maker[found.space.ids(need.letter[local], need.stage[local], comps.mb[local])]
        earlier = (by >= 0) & (by < comps.action[local])
        if not (earlier & (table.rank[by] == comps.rank[local])).all():
            return False
    return True


def _ops(lowered: Schedule, comm: np.ndarray) -> _Ops:
    table = lowered.table
    row = np.flatnonzero(comm)
    kind, stage = table.kind[row], table.stage[row]
    source, exists = neighbours(stage, CARRY_SOURCE[kind], lowered.stages_per_pipeline)
    return _Ops(
        row,
        kind,
        stage,
        table.mb[row],
        table.rank[row],
        CARRY_LETTER[kind],
        np.where(exists, source, -1),
    )


def _channels(lowered: Schedule, ops: _Ops) -> np.ndarray | None:
    """Per op, the index of its partner op (k-th SEND from a to b with the k-th RECV on b from
    a), or None if placement or order is off."""
    pp = lowered.pp
    other, has_peer = neighbours(ops.stage, CARRY_PEER[ops.kind], lowered.stages_per_pipeline)
    peer = stage_rank(lowered, other)
    placed = stage_rank(lowered, ops.stage) == ops.rank
    if not (has_peer.all() and placed.all() and (peer != ops.rank).all()):
        return None
    sending = ops.sending
    key = (np.where(sending, ops.rank, peer) * pp + np.where(sending, peer, ops.rank)) * 2
    key += sending
    key = key.astype(np.int16 if 2 * pp * pp < 2**15 else np.int64)  # int16: a radix sort
    order = np.argsort(key, kind="stable")
    sends, recvs = order[sending[order]], order[~sending[order]]
    if len(sends) != len(recvs) or not np.array_equal(key[sends] // 2, key[recvs] // 2):
        return None
    same = (ops.letter[sends] == ops.letter[recvs]) & (ops.source[sends] == ops.source[recvs])
    if not (same & (ops.mb[sends] == ops.mb[recvs])).all():
        return None
    partner = np.empty(len(ops.row), dtype=np.int64)
    partner[sends], partner[recvs] = recvs, sends
    return partner


def _message_times(
    lowered: Schedule,
    ops: _Ops,
    partner: np.ndarray,
    found,
    compute_rows: np.ndarray,
    timed: Timeline,
) -> np.ndarray | None:
    """Per op, when its tensor was made: the end of the computation that made it, which must
    run earlier on the SEND's rank (None otherwise)."""
    sending = np.flatnonzero(ops.sending)
    product_letter = ops.letter[sending]  # "F" messages carry F products, "B" ones G
    made_by = found.makers()[found.space.ids(product_letter, ops.source[sending], ops.mb[sending])]
    rows = ops.row[sending]
    if not (made_by >= 0).all():
        return None
    maker_rows = compute_rows[made_by]
    if not ((maker_rows < rows) & (lowered.table.rank[maker_rows] == ops.rank[sending])).all():
        return None
    sent_at = np.empty(len(ops.row))
    sent_at[sending] = timed.end_flat[made_by]
    sent_at[partner[sending]] = sent_at[sending]
    return sent_at


class _Batches:
    """The gaps' SEND/RECV rows on a rank, one batch each: per batch its completion time T (latest
    send time of its messages), its posting time (start of the computation before it, or -inf) and
    the T of the batch before it on its rank (-inf if none); ``of`` maps ops to batches."""

    def __init__(self, table, comm: np.ndarray, start: np.ndarray, sent_at: np.ndarray) -> None:
        rows = np.flatnonzero(comm)
        rank_first = np.zeros(len(table) + 1, dtype=bool)  # the first row of each rank
        rank_first[table.offsets[:-1]] = True
        # A comm row joins the batch before it when the row before is comm on the same rank.
        joins = comm & ~rank_first[:-1]
        joins[1:] &= comm[:-1]
        joins[:1] = False
        opens = ~joins[rows]
        first = rows[opens]
        self.of = np.cumsum(opens) - 1
        starts = np.flatnonzero(opens)
        self.done = np.maximum.reduceat(sent_at, starts) if len(rows) else np.zeros(0)
        has_before = ~rank_first[first]
        self.posted = np.where(has_before, start[np.maximum(first - 1, 0)], -np.inf)
        same = np.concatenate([[False], table.rank[first[1:]] == table.rank[first[:-1]]])
        self.previous = np.where(same, np.concatenate([[-np.inf], self.done[:-1]]), -np.inf)


def _batches_hold(batches: _Batches, ops: _Ops, partner: np.ndarray) -> bool:
    """Each batch completes after it is posted, after the batch before it, and after each op's
    partner batch is posted and that batch's predecessor completed."""
    # Later than both is later than their maximum (a NaN compares false either way).
    ready = np.maximum(batches.posted, batches.previous)
    if not (batches.done > ready).all():
        return False
    return bool((batches.done[batches.of] > ready[batches.of[partner]]).all())


def _receives_hold(
    source: Schedule, ops: _Ops, compute_rows: np.ndarray, timed: Timeline, batches: _Batches
) -> bool:
    """What a computation receives is in a batch earlier on its rank, completing no later than
    the computation starts (and no tensor is received twice)."""
    comps = source.table.comps()
    letter, sender = received_messages(source, comps)
    wants = np.flatnonzero(letter >= 0)
    taking = np.flatnonzero(~ops.sending)
    if not len(taking):
        return not len(wants)
    space = ProductSpace.covering(ops.source[taking], ops.mb[taking])
    message = space.ids(ops.letter[taking], ops.source[taking], ops.mb[taking])
    received = space.last_of(message, taking)
    if not np.array_equal(space.lookup(received, message), taking):  # a tensor received twice
        return False
    recv = space.lookup(received, space.ids(letter[wants], sender[wants], comps.mb[wants]))
    if (recv < 0).any():
        return False
    row = compute_rows[comps.action[wants]]
    in_time = timed.start_flat[comps.action[wants]] >= batches.done[batches.of[recv]]
    same_rank = ops.rank[recv] == comps.rank[wants]
    return bool((same_rank & (ops.row[recv] < row) & in_time).all())
