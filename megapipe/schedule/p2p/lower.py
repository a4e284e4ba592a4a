"""Lowering: add SEND_F / RECV_F / SEND_B / RECV_B to a compute-only schedule.

Conventions are torch.distributed.pipelining's, so a lowered schedule also runs there: each
action names the stage on its own rank. ``sSEND_Fi`` follows F(s, i) on its rank and sends its
output to stage s+1; ``sRECV_Fi`` precedes F(s, i) and receives the output of stage s-1;
``sSEND_Bi`` follows the B or I of (s, i) and sends the input gradient to stage s-1; ``sRECV_Bi``
precedes it and receives the gradient of stage s+1. Stages on the same rank hand tensors over
locally, without messages. An OVERLAP needs its forward's input and its backward's output
gradient before it and sends both results after it.

Where things go:

* a SEND right after the computation that makes its tensor (it cannot go earlier);
* a RECV as early as it is useful, and no earlier: the compute schedule is run on a timeline
  (``timeline.timeline``, relative durations F=1, B=2, I=W=1 unless given) and each RECV goes just
  before the receiver's first action that starts at or after the time the matching SEND is
  posted. The transfer then overlaps every computation the receiver runs from there up to the
  consumer, and the batch holding the RECV never delays an action that starts before the data
  exists (a consumer waits for its RECV's whole batch, so posting earlier would stall it).

Both sides order a channel's messages by send time, so for every pair of ranks the RECVs on the
receiver come in the order of the SENDs on the sender (NCCL matches p2p in order). The comm actions
of one gap (between two computations) are one batch; within one, SENDs come first, then RECVs sorted
by send time and sender order. This placement cannot deadlock under the batched model of
``check_batches``, whatever the real durations: the batch before an action holds only messages sent
before that action starts on the timeline, so (by induction on time) every message sent by time t
completes once every rank has run the actions that start before t.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ScheduleError
from ..ir import Derived, Kind, Schedule
from ..table import RECV_B, RECV_F, SEND_B, SEND_F, ActionTable, Comps, is_comm
from ..timing.flows import MESSAGE_LETTERS, ProductSpace, received_messages, sent_messages
from ..timing.timeline import DurationKey, Timeline, duration_key, timeline


@dataclass(frozen=True)
class LoweredFrom:
    """A lowered schedule's compute-only schedule and the timeline that placed its receives."""

    schedule: Schedule
    timeline: Timeline


LOWERED: Derived[dict[DurationKey, Schedule]] = Derived(dict)  # durations -> lowered schedule
LOWERED_FROM: Derived[LoweredFrom | None] = Derived(lambda: None)  # on what ``lower`` made


def lower(schedule: Schedule, durations: dict[Kind, float] | None = None) -> Schedule:
    """``schedule`` with SEND/RECV actions added (see the module docstring for where).

    ``durations`` (F, B, I, W and optionally OVERLAP to positive numbers) only moves RECVs
    earlier or later for overlap; any choice gives a deadlock-free, order-matched schedule.
    The result is kept with the schedule (``LOWERED``): lowering it again costs nothing.
    """
    key, kept = duration_key(durations), LOWERED.of(schedule)
    if key in kept:
        return kept[key]
    table = schedule.table
    comm = np.flatnonzero(is_comm(table.kind))
    if len(comm):
        raise ScheduleError(
            "the schedule is lowered already", int(table.rank[comm[0]]), schedule.action_at(comm[0])
        )
    try:
        run = timeline(schedule, durations)
    except ValueError as err:
        raise ScheduleError(str(err)) from None
    if run.stuck:
        stuck = sorted(run.stuck.items())
        waits = "; ".join(f"rank {r} at {schedule.row(r)[k]}" for r, k in stuck)
        rank, index = stuck[0]
        raise ScheduleError(
            f"cannot lower: the ranks wait on each other before any communication ({waits})",
            rank,
            schedule.row(rank)[index],
        )
    lowered = schedule.replace_actions(_lowered_table(schedule, run))
    LOWERED_FROM.keep(lowered, LoweredFrom(schedule, run))
    kept[key] = lowered
    return lowered


class _Messages:
    """The SENDs of a schedule, one per computation whose product leaves its rank, in rank order:
    message id, time sent (when the computation ends), sender rank, and ``priority``: its place in
    the order (time, sender rank, order on that rank) in which receivers take messages."""

    def __init__(self, schedule: Schedule, comps: Comps, run: Timeline) -> None:
        letter, stage = sent_messages(schedule, comps)
        self.comp = np.flatnonzero(letter >= 0)
        self.letter, self.stage = letter[self.comp], stage[self.comp]
        self.mb = comps.mb[self.comp]
        self.rank = comps.rank[self.comp]
        self.time = run.end_flat[comps.action[self.comp]]
        self.space = ProductSpace.covering(self.stage, self.mb)
        self.id = self.space.ids(self.letter, self.stage, self.mb)
        # The send each message resolves to: the last one made, as a dict keyed by it would keep.
        self.last = self.space.last_of(self.id, np.arange(len(self.id)))
        by_time = np.argsort(self.time, kind="stable")  # ties: sender rank, then its order
        self.priority = np.empty(len(self.comp), dtype=np.int64)
        self.priority[by_time] = np.arange(len(self.comp))


def _lowered_table(schedule: Schedule, run: Timeline) -> ActionTable:
    """SENDs after their computation, RECVs before the first action that starts once the data
    is sent, sorted by send time and sender (module docstring)."""
    table = schedule.table
    comps = table.comps()
    sends = _Messages(schedule, comps, run)
    r_letter, r_stage = received_messages(schedule, comps)
    receiving = np.flatnonzero(r_letter >= 0)
    wanted = sends.space.ids(r_letter[receiving], r_stage[receiving], comps.mb[receiving])
    source = sends.space.lookup(sends.last, wanted)
    if (source < 0).any():
        first = receiving[np.argmax(source < 0)]
        rank = int(comps.rank[first])
        letter, stage = MESSAGE_LETTERS[r_letter[first]], r_stage[first]
        raise ScheduleError(
            f"needs {stage}{letter}{comps.mb[first]}'s result, which no rank computes",
            rank,
            schedule.action_at(comps.action[first]),
        )
    # rank r's gaps (before each of its n_r actions and after the last): first_gap[r] + 0..n_r
    first_gap = table.offsets[:-1] + np.arange(table.pp)
    send_gap = first_gap[sends.rank] + table.local_index[comps.action[sends.comp]] + 1
    recv_gap = np.empty(len(receiving), dtype=np.int64)
    sent_at = sends.time[source]
    bounds = np.searchsorted(comps.rank[receiving], np.arange(table.pp + 1))
    for r in range(table.pp):  # receivers come in rank order
        mine = slice(bounds[r], bounds[r + 1])
        starts = run.start_flat[table.offsets[r] : table.offsets[r + 1]]
        recv_gap[mine] = first_gap[r] + np.searchsorted(starts, sent_at[mine], "left")
    return _place(
        table, comps, sends, send_gap, receiving, recv_gap, source, first_gap, r_letter, r_stage
    )


def _place(
    table, comps, sends, send_gap, receiving, recv_gap, source, first_gap, r_letter, r_stage
) -> ActionTable:
    """Lay out per gap: its SENDs (computation order), its RECVs (send time, sender, sender
    order), then the action."""
    gaps = len(table) + table.pp
    n_send = np.bincount(send_gap, minlength=gaps)
    n_recv = np.bincount(recv_gap, minlength=gaps)
    action_gap = first_gap[table.rank] + table.local_index
    has_action = np.bincount(action_gap, minlength=gaps)
    gap_start = np.concatenate([[0], np.cumsum(n_send + n_recv + has_action)])
    out_len = int(gap_start[-1])
    kind = np.empty(out_len, dtype=np.int8)
    # The table's own dtypes (int8 kinds, int32 numbers): from_columns keeps them without a copy.
    stage, mb = np.empty(out_len, dtype=np.int32), np.empty(out_len, dtype=np.int32)
    back = (
        [np.full(out_len, -1, dtype=dtype) for dtype in (np.int8, np.int32, np.int32)]
        if table.has_overlap
        else []
    )
    # SENDs: in computation order, which is gap order.
    at = gap_start[send_gap] + _rank_among_equals(send_gap)
    kind[at] = np.where(sends.letter == 0, SEND_F, SEND_B)
    stage[at], mb[at] = sends.stage, sends.mb
    # RECVs: by gap, then by the send they match (time, sender rank, sender order).
    order = np.argsort(recv_gap * (len(sends.comp) + 1) + sends.priority[source], kind="stable")
    ranked = recv_gap[order]
    at = np.empty(len(order), dtype=np.int64)
    at[order] = gap_start[ranked] + n_send[ranked] + _rank_among_equals(ranked)
    letter = r_letter[receiving]
    kind[at] = np.where(letter == 0, RECV_F, RECV_B)
    stage[at] = r_stage[receiving] + np.where(letter == 0, 1, -1)  # the receiving stage
    mb[at] = comps.mb[receiving]
    # The actions themselves.
    at = gap_start[action_gap] + n_send[action_gap] + n_recv[action_gap]
    kind[at], stage[at], mb[at] = table.kind, table.stage, table.mb
    for column, values in zip(back, (table.back_kind, table.back_stage, table.back_mb)):
        column[at] = values
    offsets = gap_start[first_gap.tolist() + [gaps]]
    return ActionTable.from_columns(offsets, kind, stage, mb, *back)


def _rank_among_equals(sorted_values: np.ndarray) -> np.ndarray:
    """For a sorted array, each element's index among the equal elements before it."""
    index = np.arange(len(sorted_values))
    new = np.ones(len(sorted_values), dtype=bool)
    new[1:] = sorted_values[1:] != sorted_values[:-1]
    return index - np.maximum.accumulate(np.where(new, index, 0))
