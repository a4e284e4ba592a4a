"""The early-send rule: which sends of an OVERLAP action go out as soon as their half is made.

The lowering puts the sends of an OVERLAP (and the receives the rank needs next) in the batch
right after it, so both halves' outputs would wait for the whole pair, deferred weight
gradients included. The executor posts from inside the pair instead (``pipeline.p2p.
PairSends``), on its own thread: the forward half's output once the forward's last layer has
run, the backward half's input gradient once the backward's last node has run. The simulator
models the same rule (``sim.programs.half_ends``). Pure Python, no torch.

What may go early is decided once per schedule and proven deadlock-free under the lowering's
batched p2p model (``check_batches``: a rank's batches complete in the order posted; a send and its
receive complete together once both of their batches are active), checked on the schedule with
its gaps posted as they will be (``early_posting``):

- *each half alone* (``EACH``): an OVERLAP's own sends (the leading SENDs of the gap after it, kept
  in their lowered order, so per-peer matching is unchanged) each go in a batch of their own as soon
  as ready, the gap's receives with the first; the rest of the gap after the pair. In the model
  these batches are posted one after the other right after the OVERLAP. While the OVERLAP runs,
  a send goes once it and every send before it are ready, so the real batches are these or
  coarser, which in the model are active, and complete, no later. Tried for every OVERLAP first,
  then (``SINGLE``) for OVERLAPs with one own send only;
- *the whole batch* for every other OVERLAP: the gap after it is posted as it stands, as soon as
  both halves are done, i.e. before the held weight gradients and the end of the OVERLAP. The model
  cannot tell this from "after the OVERLAP", so it is always safe.

For two neighbours that both send early in the same OVERLAP, splitting the batch forms a cycle
(each early send waits for a receive the peer posts only after its own early send completes).
So 1F1B, ZB1P and interleaved 1F1B at vpp = 1 and ZBV send each half early; interleaved 1F1B and
ZB1P at vpp > 1 only the pairs with one remote send (the others post their whole batch once both
halves are done); DualPipe and DualPipeV (every pair sends twice) their whole batches
(``tests/pipeline/test_early_sends.py`` lists the cases).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import ScheduleError
from ..ir import COMM_KINDS, Action, Kind, Schedule
from .comm_check import Posting, check_batches
from .lower import lower

EarlySends = dict[tuple[int, int], tuple[Action, ...]]
"""(rank, index of an OVERLAP in the rank's lowered list) -> its sends that go out one by one."""

EACH, SINGLE, WHOLE = "each half", "single-send pairs", "whole batch"
RECEIVES = (Kind.RECV_F, Kind.RECV_B)


def comm_batch(row: Sequence[Action], index: int) -> list[Action]:
    """The comm actions of the gap right after ``row[index]``."""
    end = index + 1
    while end < len(row) and row[end].kind in COMM_KINDS:
        end += 1
    return list(row[index + 1 : end])


def own_sends(overlap: Action, gap: Sequence[Action]) -> tuple[Action, ...]:
    """The leading SENDs of ``gap`` that carry ``overlap``'s own results."""
    f, b = overlap.forward, overlap.backward
    own = {(Kind.SEND_F, f.stage, f.microbatch), (Kind.SEND_B, b.stage, b.microbatch)}
    sends = []
    for action in gap:
        if (action.kind, action.stage, action.microbatch) not in own:
            break
        sends.append(action)
    return tuple(sends)


def candidates(lowered: Schedule) -> EarlySends:
    """Every OVERLAP's sends that could go out one by one (before the proof)."""
    found: EarlySends = {}
    for rank, row in enumerate(lowered.actions):
        for index, action in enumerate(row):
            if action.kind is Kind.OVERLAP:
                sends = own_sends(action, comm_batch(row, index))
                if sends:
                    found[(rank, index)] = sends
    return found


def early_batches(gap: Sequence[Action], early: Sequence[Action]) -> list[list[Action]]:
    """How the gap after an OVERLAP is posted when ``early`` (a prefix of its sends) go out one
    by one: the first with every receive of the gap, each further one alone, then the rest."""
    if not early:
        return [list(gap)]
    receives = [a for a in gap if a.kind in RECEIVES]
    rest = [a for a in gap if a not in early and a.kind not in RECEIVES]
    batches = [[early[0]] + receives] + [[send] for send in early[1:]]
    return batches + ([rest] if rest else [])


def early_posting(lowered: Schedule, early: EarlySends) -> Posting:
    """How the gaps after the OVERLAPs in ``early`` are posted (``early_batches``), as the
    batched p2p model's posting (``comm_check.check_batches``)."""
    posting: Posting = {}
    for (rank, index), sends in early.items():
        row = lowered.row(rank)
        gap = comm_batch(row, index)
        position = {action: index + 1 + n for n, action in enumerate(gap)}
        posting[(rank, index + 1)] = [
            [position[a] for a in batch] for batch in early_batches(gap, sends)
        ]
    return posting


def _holds(lowered: Schedule, early: EarlySends) -> bool:
    try:
        check_batches(lowered, early_posting(lowered, early))
    except ScheduleError:
        return False
    return True


def choose_early_sends(lowered: Schedule) -> tuple[EarlySends, str]:
    """The OVERLAP sends that go out one by one, and which rule gave them (module docstring);
    every other OVERLAP posts its whole batch once both halves are done."""
    found = candidates(lowered)
    if found and _holds(lowered, found):
        return found, EACH
    single: EarlySends = {key: sends for key, sends in found.items() if len(sends) == 1}
    if single and _holds(lowered, single):
        return single, SINGLE
    return {}, WHOLE


def executor_rule(schedule: Schedule) -> str:
    """The rule ``choose_early_sends`` proves for ``schedule`` once lowered (the simulator's
    default); ``WHOLE`` for a schedule that does not lower (the executor refuses it anyway)."""
    try:
        return choose_early_sends(lower(schedule))[1]
    except ScheduleError:
        return WHOLE
