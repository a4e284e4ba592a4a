"""Checks of a lowered schedule: channel order, and a simulation under batched p2p (NCCL).

The model is how the executor issues point-to-point communication, read the strict way NCCL
needs:

* each rank runs its list in order; the SEND/RECV actions of a *gap* (those between two
  computations of its list) are posted as one batch (``batch_isend_irecv``) without waiting;
* a rank's batches complete one after another, in the order posted (one p2p stream), so a batch
  is *active* once posted and all earlier batches of its rank completed;
* a SEND and its RECV complete together once both of their batches are active; a batch
  completes when all of its ops have;
* a computation that needs a received tensor waits for the batch holding its RECV; one that
  needs a tensor made on its own rank needs that computation earlier in the list; a SEND needs
  the computation that makes its tensor earlier in the list.

SENDs and RECVs match per ordered pair of ranks in the order posted, so the k-th SEND from rank
a to rank b pairs with the k-th RECV on b from a; ``check_channel_matching`` checks that these are
the same tensor. ``check_batches`` then simulates and names the stuck ranks if the schedule
cannot end.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ..actions import plain_key
from ..errors import ScheduleError
from ..ir import COMM_KINDS, Derived, Kind, Schedule
from ..table import is_comm
from ..timing.deps import (
    Product,
    describe_product,
    message_of_comm,
    needs_of,
    peer_rank,
    product_of,
    rank_of_product,
    received_message,
)
from ..timing.timeline import Timeline, timeline
from .comm_certificate import certified
from .lower import LOWERED_FROM

# (rank, index in the rank's list) of a comm action.
ListPosition = tuple[int, int]
# each comm action's position mapped to its partner's
Matching = dict[ListPosition, ListPosition]

# the lowered schedule's batches are proven to finish (``check_batches``)
BATCHES_FINISH: Derived[bool] = Derived(bool)


def _comm_positions(lowered: Schedule) -> tuple[dict, dict]:
    """SEND and RECV positions per (sender, receiver), in list order; an error for one on the wrong
    rank, without a peer, or between stages of one rank."""
    sends: dict[tuple[int, int], list[ListPosition]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[ListPosition]] = defaultdict(list)
    for rank, row in enumerate(lowered.actions):
        for index, action in enumerate(row):
            if action.kind not in COMM_KINDS:
                continue
            stage, _ = plain_key(action)
            if not 0 <= stage < lowered.num_stages:
                raise ScheduleError(f"stage {stage} does not exist", rank, action)
            if lowered.stage_to_rank[stage] != rank:
                raise ScheduleError(
                    f"stage {stage} is placed on rank {lowered.stage_to_rank[stage]}",
                    rank,
                    action,
                )
            try:
                peer = peer_rank(lowered, action)
            except ValueError as err:
                raise ScheduleError(str(err), rank, action) from None
            if peer == rank:
                raise ScheduleError(
                    "both stages are on this rank: the tensor is handed over locally, not sent",
                    rank,
                    action,
                )
            if action.kind in (Kind.SEND_F, Kind.SEND_B):
                sends[(rank, peer)].append((rank, index))
            else:
                recvs[(peer, rank)].append((rank, index))
    return sends, recvs


def check_channel_matching(lowered: Schedule) -> Matching:
    """Check that, per (sender, receiver), SENDs and RECVs carry the same tensors in one order.

    Returns the matching: each comm action's position mapped to its partner's. Raises
    ``ScheduleError`` naming the rank and action for a SEND or RECV on the wrong rank or without
    a peer, a message sent within one rank, a missing partner, or two orders that disagree.
    """
    sends, recvs = _comm_positions(lowered)

    def at(position: ListPosition):
        return lowered.actions[position[0]][position[1]]

    matching: Matching = {}
    for src, dst in sorted(set(sends) | set(recvs)):
        out, into = sends[(src, dst)], recvs[(src, dst)]
        for k in range(max(len(out), len(into))):
            if k >= len(out):
                raise ScheduleError(
                    f"receives from rank {src}, but rank {src} sends only {len(out)} tensors to "
                    f"rank {dst}: a SEND is missing",
                    dst,
                    at(into[k]),
                )
            if k >= len(into):
                raise ScheduleError(
                    f"sends to rank {dst}, but rank {dst} receives only {len(into)} tensors from "
                    f"rank {src}: a RECV is missing",
                    src,
                    at(out[k]),
                )
            send, recv = at(out[k]), at(into[k])
            if message_of_comm(lowered, send) != message_of_comm(lowered, recv):
                raise ScheduleError(
                    f"is message {k} from rank {src} to rank {dst}, but rank {src} sends {send} "
                    f"there: RECVs must come in the order of the SENDs (NCCL matches p2p in order)",
                    dst,
                    recv,
                )
            matching[out[k]] = into[k]
            matching[into[k]] = out[k]
    return matching


@dataclass
class _RankState:
    """Where one rank is in the simulated run."""

    items: list  # ("compute", index) or ("batch", [indices])
    batch_of: dict[int, int] = field(default_factory=dict)  # comm index -> batch number
    batches: list[list[int]] = field(default_factory=list)
    cursor: int = 0
    posted: int = 0
    completed: int = 0
    made: set = field(default_factory=set)
    received: set = field(default_factory=set)

    def active(self, batch: int) -> bool:
        return batch == self.completed and batch < self.posted

    @property
    def finished(self) -> bool:
        return self.cursor == len(self.items) and self.completed == len(self.batches)


Posting = dict[ListPosition, list[list[int]]]
"""(rank, index of the first comm action of a gap) -> the batches that gap is posted as, one after
the other (indices in the rank's list; every index of the gap once)."""


def _split_batches(row, posting: dict[int, list[list[int]]]) -> _RankState:
    """The rank's items: computations, and its gaps' comm actions as batches (one per gap, or
    as ``posting`` gives them for a gap that starts at one of its keys)."""
    state = _RankState(items=[])
    taken: set[int] = set()
    for index, action in enumerate(row):
        if index in taken:
            continue
        if action.kind not in COMM_KINDS:
            state.items.append(("compute", index))
            continue
        if index in posting:
            for batch in posting[index]:
                state.items.append(("batch", list(batch)))
                state.batches.append(state.items[-1][1])
                for member in batch:
                    state.batch_of[member] = len(state.batches) - 1
                    taken.add(member)
            continue
        if not state.items or state.items[-1][0] != "batch" or index - 1 in taken:
            state.items.append(("batch", []))
            state.batches.append(state.items[-1][1])
        state.items[-1][1].append(index)
        state.batch_of[index] = len(state.batches) - 1
    return state


def _sent_product(lowered: Schedule, action) -> Product:
    kind, stage, mb = message_of_comm(lowered, action)
    return ("F" if kind == "F" else "G", stage, mb)


def _ready(lowered: Schedule, rank: int, state: _RankState, action) -> bool:
    for comp in action.computations():
        for need in needs_of(lowered, comp):
            if rank_of_product(lowered, need) == rank:
                if need not in state.made:
                    return False
            elif received_message(lowered, comp) not in state.received:
                return False
    return True


def check_batches(lowered: Schedule, posting: Posting | None = None) -> None:
    """Check that ``lowered`` finishes under the batched p2p model; raise ``ScheduleError``
    naming every stuck rank, the action it waits at and what that action waits for.

    ``posting`` posts some gaps as several batches, one after the other (the
    executor's early sends, ``pipeline.early_sends``); by default each gap is one batch. Checked
    once per schedule (with the default posting). A schedule ``lower`` made (or whose SEND/RECV
    placement is as ``lower`` would make it) is proved to finish in O(actions) by
    ``comm_certificate``; any other, and any other posting, is simulated.
    """
    if posting:
        _simulate_batches(lowered, posting)
        return
    if BATCHES_FINISH.of(lowered):
        return
    source, timed = _computations(lowered)
    if timed is None or not certified(lowered, timed, source):
        _simulate_batches(lowered)
    BATCHES_FINISH.keep(lowered, True)


def _computations(lowered: Schedule) -> tuple[Schedule, Timeline | None]:
    """The compute-only schedule of ``lowered``'s computations (the one it was lowered from,
    if any) and its timeline (None if it cannot be run)."""
    found = LOWERED_FROM.of(lowered)
    if found is not None:
        return found.schedule, found.timeline
    table = lowered.table
    source = lowered.replace_actions(table.select(~is_comm(table.kind)))
    try:
        return source, timeline(source)
    except ValueError:
        return source, None


def _simulate_batches(lowered: Schedule, posting: Posting | None = None) -> None:
    """Simulate ``lowered`` under the batched p2p model (module docstring), its gaps posted
    as ``posting`` says; raise ``ScheduleError`` if it deadlocks."""
    matching = check_channel_matching(lowered)
    per_rank: list[dict[int, list[list[int]]]] = [{} for _ in lowered.actions]
    for (rank, index), batches in (posting or {}).items():
        per_rank[rank][index] = batches
    states = [_split_batches(row, per_rank[r]) for r, row in enumerate(lowered.actions)]
    done: set[ListPosition] = set()
    progressed = True
    while progressed:
        progressed = False
        for rank, state in enumerate(states):
            progressed |= _advance(lowered, rank, state)
        for rank in range(len(states)):
            progressed |= _complete(lowered, rank, states, matching, done)
    stuck = [rank for rank, state in enumerate(states) if not state.finished]
    if stuck:
        waits = "; ".join(_describe_wait(lowered, states, matching, rank) for rank in stuck)
        raise ScheduleError(f"the lowered schedule deadlocks, stuck ranks {stuck}: {waits}")


def _advance(lowered: Schedule, rank: int, state: _RankState) -> bool:
    """Run the rank's list as far as it can: post batches, run ready computations."""
    row = lowered.actions[rank]
    moved = False
    while state.cursor < len(state.items):
        kind, what = state.items[state.cursor]
        if kind == "batch":
            for index in what:
                action = row[index]
                if action.kind in (Kind.SEND_F, Kind.SEND_B):
                    product = _sent_product(lowered, action)
                    if product not in state.made:
                        raise ScheduleError(
                            f"sends the result of {describe_product(lowered, product)} "
                            "before this rank computes it",
                            rank,
                            action,
                        )
            state.posted += 1
        elif _ready(lowered, rank, state, row[what]):
            state.made.update(product_of(c) for c in row[what].computations())
        else:
            break
        state.cursor += 1
        moved = True
    return moved


def _complete(
    lowered: Schedule, rank: int, states: list[_RankState], matching: dict, done: set
) -> bool:
    """Complete the rank's active batches, in order, whose ops all have active partners."""
    state = states[rank]
    moved = False
    while state.active(state.completed):
        batch = state.batches[state.completed]
        for index in batch:
            if (rank, index) in done:
                continue
            peer, peer_index = matching[(rank, index)]
            if states[peer].active(states[peer].batch_of[peer_index]):
                done.add((rank, index))
                done.add((peer, peer_index))
        if not all((rank, index) in done for index in batch):
            break
        for index in batch:
            action = lowered.actions[rank][index]
            if action.kind in (Kind.RECV_F, Kind.RECV_B):
                state.received.add(message_of_comm(lowered, action))
        state.completed += 1
        moved = True
    return moved


def _describe_wait(
    lowered: Schedule, states: list[_RankState], matching: Matching, rank: int
) -> str:
    """What a stuck rank waits for, in words."""
    state = states[rank]
    row = lowered.actions[rank]
    head = _describe_head_batch(lowered, states, matching, rank)
    if state.cursor == len(state.items):
        return f"rank {rank} ran its list but its batch {head}"
    action = row[state.items[state.cursor][1]]
    reasons = []
    for comp in action.computations():
        for need in needs_of(lowered, comp):
            if rank_of_product(lowered, need) == rank:
                if need not in state.made:
                    reasons.append(
                        f"{describe_product(lowered, need)}, which comes later on this rank"
                    )
                continue
            message = received_message(lowered, comp)
            if message in state.received:
                continue
            recv_index = next(
                (
                    i
                    for i, a in enumerate(row)
                    if a.kind in (Kind.RECV_F, Kind.RECV_B)
                    and message_of_comm(lowered, a) == message
                ),
                None,
            )
            if recv_index is None:
                reasons.append(f"a RECV of {describe_product(lowered, need)} that is never posted")
            elif state.batch_of[recv_index] >= state.posted:
                reasons.append(f"{row[recv_index]}, which is posted only after it")
            else:
                reasons.append(f"{row[recv_index]}, whose batch waits: {head}")
    return f"rank {rank} at {action} waits for " + ", ".join(reasons)


def _describe_head_batch(
    lowered: Schedule, states: list[_RankState], matching: Matching, rank: int
) -> str:
    state = states[rank]
    if state.completed >= len(state.batches):
        return "(none pending)"
    batch = state.batches[state.completed]
    row = lowered.actions[rank]
    ops = " ".join(str(row[i]) for i in batch)
    if state.completed >= state.posted:
        return f"[{ops}] is not posted yet"
    pending = []
    for index in batch:
        partner = _partner_text(lowered, states, matching[(rank, index)])
        if partner:
            pending.append(partner)
    return f"[{ops}] waits for " + ", ".join(pending)


def _partner_text(lowered: Schedule, states: list[_RankState], partner_at: ListPosition) -> str:
    """Why the partner of a pending op is not active yet ("" if it is)."""
    peer, peer_index = partner_at
    peer_state = states[peer]
    peer_batch = peer_state.batch_of[peer_index]
    if peer_state.active(peer_batch) or peer_batch < peer_state.completed:
        return ""
    partner = lowered.actions[peer][peer_index]
    if peer_batch >= peer_state.posted:
        return f"rank {peer} to post {partner}"
    return f"rank {peer}'s earlier batches to complete before its {partner}"
