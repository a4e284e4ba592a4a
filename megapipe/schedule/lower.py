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
  (``deps.timeline``, relative durations F=1, B=2, I=W=1 unless given) and each RECV goes just
  before the receiver's first action that starts at or after the time the matching SEND is
  posted. The transfer then overlaps every computation the receiver runs from there up to the
  consumer, and the batch holding the RECV never delays an action that starts before the data
  exists (a consumer waits for its RECV's whole batch, so posting earlier would stall it).

Both sides order a channel's messages by send time, so for every pair of ranks the RECVs on the
receiver come in the order of the SENDs on the sender (NCCL matches p2p in order). A run of
consecutive comm actions is one batch; within one, SENDs come first, then RECVs sorted by send
time and sender order. This placement cannot deadlock under the batched model of
``check_runs``, whatever the real durations: the batch before an action holds only messages
sent before that action starts on the timeline, so (by induction on time) every message sent by
time t completes once every rank has run the actions that start before t.
"""

from __future__ import annotations

from bisect import bisect_left

from .comm_check import check_channel_order, check_runs
from .deps import Message, received_message, recv_action, send_action, sent_message, timeline
from .errors import ScheduleError
from .ir import Action, Kind, Schedule

__all__ = ["lower", "check_runs", "check_channel_order"]


def lower(schedule: Schedule, durations: dict[Kind, float] | None = None) -> Schedule:
    """``schedule`` with SEND/RECV actions added (see the module docstring for where).

    ``durations`` (F, B, I, W and optionally OVERLAP to positive numbers) only moves RECVs
    earlier or later for overlap; any choice gives a deadlock-free, order-matched schedule.
    """
    rows = schedule.actions
    for rank, row in enumerate(rows):
        for action in row:
            if not action.is_compute:
                raise ScheduleError("the schedule is lowered already", rank, action)
    try:
        run = timeline(schedule, durations)
    except ValueError as err:
        raise ScheduleError(str(err)) from None
    if run.stuck:
        waits = "; ".join(f"rank {r} at {rows[r][k]}" for r, k in sorted(run.stuck.items()))
        rank, index = next(iter(sorted(run.stuck.items())))
        raise ScheduleError(
            f"cannot lower: the ranks wait on each other before any communication ({waits})",
            rank, rows[rank][index],
        )

    sends: list[list[list[Action]]] = [[[] for _ in range(len(row) + 1)] for row in rows]
    # The send time and the sender's (rank, order) of every message, to place and sort its RECV.
    sent: dict[Message, tuple[float, int, int]] = {}
    for rank, row in enumerate(rows):
        order = 0
        for index, action in enumerate(row):
            for comp in action.computations():
                message = sent_message(schedule, comp)
                if message is None:
                    continue
                sends[rank][index + 1].append(send_action(message))
                sent[message] = (run.end[rank][index], rank, order)
                order += 1

    recvs: list[list[list[tuple[tuple[float, int, int], Action]]]] = [
        [[] for _ in range(len(row) + 1)] for row in rows
    ]
    for rank, row in enumerate(rows):
        for index, action in enumerate(row):
            for comp in action.computations():
                message = received_message(schedule, comp)
                if message is None:
                    continue
                if message not in sent:
                    raise ScheduleError(
                        f"needs {message[1]}{message[0]}{message[2]}'s result, which no rank "
                        "computes", rank, action,
                    )
                key = sent[message]
                slot = bisect_left(run.start[rank], key[0])
                recvs[rank][slot].append((key, recv_action(schedule, message)))

    lowered = []
    for rank, row in enumerate(rows):
        out: list[Action] = []
        for slot in range(len(row) + 1):
            out.extend(sends[rank][slot])
            out.extend(action for _, action in sorted(recvs[rank][slot], key=lambda kv: kv[0]))
            if slot < len(row):
                out.append(row[slot])
        lowered.append(out)
    return schedule.replace_actions(lowered)
