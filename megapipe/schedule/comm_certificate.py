"""A proof, checked in O(actions), that a lowered schedule finishes under batched p2p.

``check_runs`` (``comm_check``) simulates the batched p2p model; that costs more than lowering a
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
cycle, so the run finishes. ``lower`` places each RECV before the first computation that starts
once its tensor is sent, which makes every such wait hold for the timeline it lowered with
(module docstring of ``lower``). Anything that does not hold (a hand-written schedule, another
placement, a broken one) leaves the answer to the simulation, which also words the error.
"""

from __future__ import annotations

import numpy as np

from .flows import (
    MAKE_LETTER,
    ProductSpace,
    carried_messages,
    comp_needs,
    peers,
    received_messages,
    stage_rank,
)
from .ir import Schedule
from .table import SEND_B, SEND_F, Comps, is_comm
from .timeline import Timeline


def certified(lowered: Schedule, run: Timeline) -> bool:
    """Whether the keys above prove that ``lowered`` finishes, with compute times from ``run``
    (a timeline of its computations in the same order)."""
    table = lowered.table
    comm = is_comm(table.kind)
    compute_rows = np.flatnonzero(~comm)
    if run.stuck or len(run.start_list) != len(compute_rows):
        return False
    start = np.full(len(table), -np.inf)
    end = np.full(len(table), -np.inf)
    start[compute_rows], end[compute_rows] = run.start_flat, run.end_flat
    if not _rank_order(table, comm, start):
        return False
    comps = table.comps()
    made, maker = _makers(comps, comm)
    if made is None:
        return False
    channel = _channels(lowered, comps, comm)
    if channel is None:
        return False
    sent_at = _message_times(lowered, comps, comm, made, maker, end, channel)
    if sent_at is None:
        return False
    batches = _Batches(table, comm, start, sent_at)
    return _batches_hold(batches, comm, channel) and _receives_hold(
        lowered, comps, comm, made, maker, start, batches)


def _rank_order(table, comm: np.ndarray, start: np.ndarray) -> bool:
    """Computations start strictly later than the computation before them on their rank."""
    rows = np.flatnonzero(~comm)
    same_rank = table.rank[rows[1:]] == table.rank[rows[:-1]]
    return bool((start[rows[1:]][same_rank] > start[rows[:-1]][same_rank]).all())


def _makers(comps, comm: np.ndarray):
    """The product space of the computations and the row making each product (None if some
    product has two makers: the model then depends on which runs first)."""
    plain = ~comm[comps.action]
    space = ProductSpace.covering(comps.stage[plain], comps.mb[plain])
    made = space.ids(MAKE_LETTER[comps.kind], comps.stage, comps.mb)
    made = np.where(plain, made, space.never)
    ids = made[plain]
    if len(ids) and np.bincount(ids).max() > 1:
        return None, None
    maker = np.full(space.never + 1, -1, dtype=np.int64)
    maker[ids] = comps.action[plain]
    return space, maker


def _only(comps: Comps, pick: np.ndarray) -> Comps:
    return Comps(*(column[pick] for column in comps))


def _channels(lowered: Schedule, comps: Comps, comm: np.ndarray) -> np.ndarray | None:
    """Each SEND/RECV row -> its partner row (k-th SEND from a to b with the k-th RECV on b from
    a), or None if placement or order is off."""
    table = lowered.table
    ops = _only(comps, comm[comps.action])
    peer, has_peer = peers(lowered, ops)
    placed = stage_rank(lowered, ops.stage) == ops.rank
    if not (has_peer.all() and placed.all() and (peer != ops.rank).all()):
        return None
    letter, source = carried_messages(lowered, ops)
    sending = (ops.kind == SEND_F) | (ops.kind == SEND_B)
    src, dst = np.where(sending, ops.rank, peer), np.where(sending, peer, ops.rank)
    key = (src * table.pp + dst) * 2 + sending
    order = np.argsort(key, kind="stable")
    sends, recvs = order[sending[order]], order[~sending[order]]
    if len(sends) != len(recvs) or not np.array_equal(key[sends] // 2, key[recvs] // 2):
        return None
    same = (letter[sends] == letter[recvs]) & (source[sends] == source[recvs])
    if not (same & (ops.mb[sends] == ops.mb[recvs])).all():
        return None
    partner = np.full(len(table), -1, dtype=np.int64)
    partner[ops.action[sends]], partner[ops.action[recvs]] = ops.action[recvs], ops.action[sends]
    return partner


def _message_times(lowered: Schedule, comps: Comps, comm: np.ndarray, space: ProductSpace,
                   maker: np.ndarray, end: np.ndarray, partner: np.ndarray) -> np.ndarray | None:
    """Per SEND/RECV row, when its tensor was made: the end of the computation that made it,
    which must be earlier on the SEND's rank (None otherwise)."""
    table = lowered.table
    ops = _only(comps, comm[comps.action])
    sending = (ops.kind == SEND_F) | (ops.kind == SEND_B)
    letter, source = carried_messages(lowered, ops)
    rows = ops.action[sending]
    made_by = maker[space.ids(letter[sending], source[sending], ops.mb[sending])]
    if not ((made_by >= 0) & (made_by < rows)).all():
        return None
    if not (table.rank[made_by] == table.rank[rows]).all():
        return None
    sent_at = np.full(len(table), -np.inf)
    sent_at[rows] = end[made_by]
    sent_at[partner[rows]] = end[made_by]
    return sent_at


class _Batches:
    """Maximal runs of SEND/RECV rows on a rank: per batch its completion time T (latest send
    time of its messages), its posting time (start of the computation before it, or -inf) and
    the T of the batch before it on its rank (-inf if none); ``of`` maps rows to batches."""

    def __init__(self, table, comm: np.ndarray, start: np.ndarray, sent_at: np.ndarray) -> None:
        rows = np.flatnonzero(comm)
        before = rows - 1
        joined = (before >= 0) & comm[np.maximum(before, 0)]
        joined &= table.rank[np.maximum(before, 0)] == table.rank[rows]
        first = rows[~joined]
        self.of = np.full(len(table), -1, dtype=np.int64)
        self.of[rows] = np.cumsum(~joined) - 1
        self.done = np.maximum.reduceat(sent_at[rows], np.flatnonzero(~joined)) if len(
            rows) else np.zeros(0)
        has_before = (first > table.offsets[table.rank[first]])
        self.posted = np.where(has_before, start[np.maximum(first - 1, 0)], -np.inf)
        previous_same = np.concatenate([[False], table.rank[first[1:]] == table.rank[first[:-1]]])
        self.previous = np.where(previous_same, np.concatenate([[-np.inf], self.done[:-1]]),
                                 -np.inf)


def _batches_hold(batches: _Batches, comm: np.ndarray, partner: np.ndarray) -> bool:
    """Each batch completes after it is posted, after the batch before it, and after each op's
    partner batch is posted and that batch's predecessor completed."""
    if not ((batches.done > batches.posted) & (batches.done > batches.previous)).all():
        return False
    rows = np.flatnonzero(comm)
    mine, theirs = batches.of[rows], batches.of[partner[rows]]
    after_post = batches.done[mine] > batches.posted[theirs]
    return bool((after_post & (batches.done[mine] > batches.previous[theirs])).all())


def _receives_hold(lowered: Schedule, comps: Comps, comm: np.ndarray, space: ProductSpace,
                   maker: np.ndarray, start: np.ndarray, batches: _Batches) -> bool:
    """Each computation sits on its stage's rank; what it needs from its own rank is made
    earlier there; what it receives is in a batch earlier on its rank that completes no later
    than it starts."""
    table = lowered.table
    work = _only(comps, ~comm[comps.action])
    if not (stage_rank(lowered, work.stage) == work.rank).all():
        return False
    for need in comp_needs(lowered, work):
        local = need.exists & (stage_rank(lowered, need.stage) == work.rank)
        by = maker[space.ids(need.letter[local], need.stage[local], work.mb[local])]
        earlier = (by >= 0) & (by < work.action[local]) & (table.rank[by] == work.rank[local])
        if not earlier.all():
            return False
    letter, source = received_messages(lowered, work)
    wants = letter >= 0
    ops = _only(comps, comm[comps.action])
    taking = (ops.kind != SEND_F) & (ops.kind != SEND_B)
    t_letter, t_source = carried_messages(lowered, ops)
    messages = ProductSpace.covering(t_source[taking], ops.mb[taking])
    key = messages.ids(t_letter[taking], t_source[taking], ops.mb[taking]) * table.pp
    key += ops.rank[taking]
    order = np.argsort(key, kind="stable")
    key, recv_rows = key[order], ops.action[taking][order]
    if len(key) > 1 and (key[1:] == key[:-1]).any():
        return False  # a tensor received twice on one rank
    wanted = messages.ids(letter[wants], source[wants], work.mb[wants]) * table.pp
    wanted += work.rank[wants]
    at = np.minimum(np.searchsorted(key, wanted), max(len(key) - 1, 0))
    if not len(key):
        return not wants.any()
    found = key[at] == wanted
    recv = recv_rows[at]
    row = work.action[wants]
    in_time = start[row] >= batches.done[batches.of[recv]]
    return bool((found & (recv < row) & in_time).all())
