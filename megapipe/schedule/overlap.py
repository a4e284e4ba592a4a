"""The overlap pass: turn an F/B (or F/I/W) schedule into a combined one of OVERLAP pairs.

An OVERLAP ``(sF i; s'B j)`` runs the forward of microbatch i beside the backward of microbatch j
so that each one's all-to-all hides behind the other's compute (DESIGN.md, "Combined step").

The pass is one mechanism applied to each rank's list, whatever schedule made it: rank r runs
``e_r`` extra warmup forwards. With ``n(b)`` the forwards that precede backward b (B or I) in the
original list, the forwards with index below ``n(b) + e_r - 1`` run before b, and if b was
followed by a forward (W actions aside), forward number ``n(b) + e_r - 1`` is fused with b into
one pair placed where b was. Forwards keep their order, backwards and W's keep theirs. A pair's
halves are independent: a backward of microbatch j follows every forward of j, so its partner (a
later forward) is another microbatch (``pair_is_independent``).

Why one extra forward is not always enough. A pair hands both outputs on only when it ends, so a
hop between two ranks now costs a whole pair. In plain 1F1B with ``e_r = 1`` rank r's pairs are
``(F_{j+w_r+1}; B_j)`` (``w_r = pp-r-1``): the pair holding B_i on rank r waits for rank r+1's
pair holding B_i, which waits for rank r's F output that lies in rank r's *previous* pair, so
adjacent ranks take turns and every step costs two pairs (at pp=8, M=16, F=1, B=2 the bubble
grows from 21 to 63). With ``e_r`` extras, rank r+1's pair holding B_i needs rank r's pair
holding ``B_{i-1+e_{r+1}-e_r}``; the steady state runs one pair per step only if
``e_r >= e_{r+1} + 1``. The smallest such choice is the *chain* ``e_r = pp - r`` (warmup
``2(pp-r-1) + 1``: Megatron's interleaved warmup formula plus one). Interleaved 1F1B already
has that factor 2 in its warmup, and the chunks give slack, so Megatron's ``e_r = 1`` suffices
there; it also keeps pp=1 at Megatron's exact order ``F0 (F1;B0) ... B(M-1)``.

Candidates, least memory first (``pairing_candidates``): *megatron* (``e_r = 1``, every pair),
*cross-stage* (``e_r = 1``, only pairs of two different stages, offered when a rank holds stages
that send to different neighbours, as in V placement: there such a pair takes both inputs from
one neighbour and feeds the other, so it does not ping-pong like a same-stage pair) and the
*chain*. Each runs on the dependency timeline
(``deps.timeline``: F=1, B=2, I=W=1, a pair the sum of its halves, i.e. free communication,
where pairing gains nothing). The target is the original's makespan plus one pair (F + B, or
F + I). The first candidate that has pairs and ends by the target is taken (interleaved 1F1B:
megatron; 1F1B and ZB1P with M >= 2 pp: the chain, which ends exactly with the original; with
fewer microbatches megatron may already end in time). If none does (ZBV:
its last microbatches' forwards climb the V through pairs), the fastest is refined: each round
splits, on each rank, the latest pair on the timeline's critical path (the forward going back
behind its backward) until it ends in time.

Guarantee (free communication, the timeline above): the result ends at most one pair after the
original. Proof for the refinement of an ``e_r = 1`` pairing: splitting every pair gives the
original order back, and once no pair lies on the critical path that path is a chain of waits
the original has too (unpaired actions keep their order), so it is no longer than the
original's makespan; rounds stop at the latest there. If every candidate would lose all its
pairs, the original schedule is returned unpaired (pairing cannot help then; no registered
schedule with M >= 2 comes to that).
With real all-to-all the pairs hide it and the step gets shorter (tests/sim/test_overlap_gain).

Memory (``peak_in_flight``): a rank holds at most ``e_r`` more microbatch activations than in
the original schedule: +1 with megatron and cross-stage, ``pp - r`` more with the chain, so
plain 1F1B's peak doubles from ``pp - r`` to ``2(pp - r)`` stage activations. For comparison,
Megatron's interleaved 1F1B with vpp=2 holds ``3pp - 1`` half-stage chunks (about ``1.5 pp``
stage activations) on rank 0. That is the honest price of pairing a one-chunk pipeline.

Fusing can make ranks wait on each other in a cycle (a pair needing, through another rank, the
output of its own other half). While a paired schedule is stuck, the stuck pairs whose backward
could run alone (or, if none could, every stuck pair) are split the same way; with
``e_r = 1`` that ends at the original order, which runs; a chain candidate that is stuck is
dropped. Schedules that already hold OVERLAP actions (DualPipe, DualPipeV) pass unchanged;
schedules with no forward after a backward (GPipe, looped BFS) get no pairs.

Cost: two to four timeline runs (original, candidates) plus one per refinement round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .deps import (
    DEFAULT_DURATIONS,
    Timeline,
    missing_needs,
    needs_of,
    product_of,
    timeline,
)
from .errors import ScheduleError
from .in_flight import peak_in_flight  # noqa: F401 - the memory bound of the docstring
from .ir import BACKWARD_KINDS, Action, Kind, Schedule

# A pair on one rank: (index of the backward, index of the forward) in the rank's original list.
Pair = tuple[int, int]


def pair_is_independent(forward: Action, backward: Action) -> bool:
    """Whether a forward and a backward may run as one OVERLAP pair.

    A backward of microbatch j needs the loss of j, hence every forward of j, while a forward
    needs no backward; so the two are independent exactly when their microbatches differ.
    """
    if forward.kind is not Kind.F or backward.kind not in BACKWARD_KINDS:
        raise ValueError(f"a pair is (forward; B or I), got ({forward}; {backward})")
    return forward.microbatch != backward.microbatch


@dataclass(frozen=True)
class Pairing:
    """One way to pair a schedule: per-rank extra warmup forwards, and which pairs are allowed."""

    name: str
    extra: tuple[int, ...]
    cross_stage_only: bool = False


def pairing_candidates(schedule: Schedule) -> list[Pairing]:
    """The pairings the pass tries, least memory first (module docstring)."""
    pp = schedule.pp
    candidates = [Pairing("megatron", (1,) * pp)]
    if _opposite_flows(schedule):
        candidates.append(Pairing("cross-stage", (1,) * pp, cross_stage_only=True))
    chain = tuple(pp - rank for rank in range(pp))
    if chain != candidates[0].extra:
        candidates.append(Pairing("chain", chain))
    return candidates


def _opposite_flows(schedule: Schedule) -> bool:
    """Whether some rank holds two stages whose outputs go to different ranks (V placement,
    DualPipe): only there can a pair of two stages take both inputs from one side."""
    for rank in range(schedule.pp):
        targets = {
            schedule.stage_to_rank[after]
            for stage in schedule.stages_of_rank(rank)
            if (after := schedule.next_stage(stage)) is not None
            and schedule.stage_to_rank[after] != rank
        }
        if len(targets) > 1:
            return True
    return False


def find_pairs(
    row: tuple[Action, ...], extra: int = 1, cross_stage_only: bool = False
) -> list[Pair]:
    """Pair each backward that a forward follows (W's aside) with forward ``n(b) + extra - 1``."""
    forwards = [i for i, a in enumerate(row) if a.kind is Kind.F]
    pairs = []
    seen = 0
    for index, action in enumerate(row):
        if action.kind is Kind.F:
            seen += 1
            continue
        if action.kind not in BACKWARD_KINDS:
            continue
        after = index + 1
        while after < len(row) and row[after].kind is Kind.W:
            after += 1
        partner = seen + extra - 1
        if after < len(row) and row[after].kind is Kind.F and partner < len(forwards):
            forward = row[forwards[partner]]
            if cross_stage_only and forward.stage == action.stage:
                continue
            if pair_is_independent(forward, action):
                pairs.append((index, forwards[partner]))
    return pairs


def assemble(
    row: tuple[Action, ...], pairs: list[Pair], extra: int = 1
) -> tuple[list[Action], dict[int, Pair]]:
    """The rank's list with ``extra`` more forwards ahead and ``pairs`` fused (module docstring);
    also which pair each new index holds."""
    forwards = [i for i, a in enumerate(row) if a.kind is Kind.F]
    partner_of = dict(pairs)
    out: list[Action] = []
    pair_at: dict[int, Pair] = {}
    ran = seen = 0  # forwards placed in ``out``; forwards before the current action originally
    for index, action in enumerate(row):
        if action.kind is Kind.F:
            seen += 1
            continue
        if action.kind in BACKWARD_KINDS:
            lead = min(seen + extra - 1, len(forwards))
            while ran < lead:
                out.append(row[forwards[ran]])
                ran += 1
            partner = partner_of.get(index)
            if partner is not None and ran < len(forwards) and forwards[ran] == partner:
                pair_at[len(out)] = (index, partner)
                out.append(Action.overlap(row[partner], action))
                ran += 1
                continue
        out.append(action)
    out += [row[i] for i in forwards[ran:]]
    return out, pair_at


def makespan(run: Timeline) -> float:
    """When the last action of a timeline ends."""
    return max((end for row in run.end for end in row), default=0.0)


def critical_path(schedule: Schedule, run: Timeline) -> list[tuple[int, int]]:
    """(rank, index) of the actions on a longest chain of waits ending at the last action.

    Walking back from the action that ends last, each step goes to whatever made the action
    start when it did: a product from another rank, or else the previous action of its rank.
    """
    maker: dict = {}
    for rank, row in enumerate(schedule.actions):
        for index, action in enumerate(row):
            for comp in action.computations():
                maker[product_of(comp)] = (rank, index)
    ends = [(row[-1], rank) for rank, row in enumerate(run.end) if row]
    if not ends:
        return []
    rank = max(ends)[1]
    index = len(schedule.actions[rank]) - 1
    path = [(rank, index)]
    while True:
        start = run.start[rank][index]
        step = None
        for comp in schedule.actions[rank][index].computations():
            for need in needs_of(schedule, comp):
                other = maker[need]
                if other[0] != rank and run.end[other[0]][other[1]] == start:
                    step = other
        if step is None and index > 0 and run.end[rank][index - 1] == start:
            step = (rank, index - 1)
        if step is None:
            return path[::-1]
        rank, index = step
        path.append(step)


@dataclass
class _Attempt:
    """A pairing being built: the pairs still fused on each rank, and the latest run."""

    pairing: Pairing
    pairs: list[list[Pair]]
    combined: Schedule | None = None
    run: Timeline | None = None

    @property
    def paired(self) -> int:
        return sum(map(len, self.pairs))


def _settle(schedule: Schedule, attempt: _Attempt, target: float) -> bool:
    """Split pairs of ``attempt`` until its schedule runs and ends by ``target``; False if no
    split is left that could get there.

    A stuck schedule loses its stuck pairs whose backward could run alone (those wait only for
    their forward's input, so splitting lets the backward go first as before pairing), or, if
    none could, every stuck pair. A late one loses, on each rank, the latest pair on the
    critical path. A split puts the forward back behind its backward.
    """
    rows, extra = schedule.actions, attempt.pairing.extra
    while True:
        assembled = [assemble(row, p, e) for row, p, e in zip(rows, attempt.pairs, extra)]
        attempt.combined = schedule.replace_actions([out for out, _ in assembled])
        attempt.run = run = timeline(attempt.combined)
        pair_at = [at for _, at in assembled]
        if run.stuck and max(extra) > 1:
            return False  # splits would not lead back to the original order
        if run.stuck:
            stuck = {r: pair_at[r][i] for r, i in run.stuck.items() if i in pair_at[r]}
            blocking = {
                r: pair for r, pair in stuck.items()
                if not missing_needs(schedule, rows[r][pair[0]], run.made)
            }
            split = list((blocking or stuck).items())
        elif makespan(run) <= target:
            return True
        else:
            path = critical_path(attempt.combined, run)
            latest = {r: i for r, i in path if i in pair_at[r]}  # the last one per rank
            split = [(r, pair_at[r][i]) for r, i in latest.items()]
        if not split:
            return False
        for rank, pair in split:
            attempt.pairs[rank].remove(pair)


def apply_overlap(schedule: Schedule) -> Schedule:
    """The combined version of ``schedule`` (see the module docstring for the rule).

    Raises ``ScheduleError`` if ``schedule`` itself cannot run to the end (its ranks wait on each
    other), since no pairing can repair that.
    """
    rows = schedule.actions
    if any(a.kind is Kind.OVERLAP for row in rows for a in row):
        return schedule
    if any(not a.is_compute for row in rows for a in row):
        raise ScheduleError(
            "the overlap pass takes a compute-only schedule; pair before lowering (SEND/RECV)"
        )
    original = timeline(schedule)
    if original.stuck:
        rank, index = next(iter(original.stuck.items()))
        raise ScheduleError(
            "cannot pair a schedule whose ranks wait on each other before pairing "
            f"(stuck ranks: {sorted(original.stuck)})",
            rank, rows[rank][index],
        )
    target = makespan(original) + _longest_pair(schedule)
    settled = []
    for pairing in pairing_candidates(schedule):
        pairs = [
            find_pairs(row, e, pairing.cross_stage_only) for row, e in zip(rows, pairing.extra)
        ]
        attempt = _Attempt(pairing, pairs)
        if not _settle(schedule, attempt, math.inf) or not attempt.paired:
            continue
        if makespan(attempt.run) <= target:
            return _finish(schedule, attempt.combined)
        settled.append(attempt)
    # None ends in time as paired: refine the fastest first (most pairs on a tie). Splitting
    # every pair of an ``e_r = 1`` pairing gives back the original order, so the refinement
    # always ends in time, in the worst case with no pair left (pairing cannot help then).
    settled.sort(key=lambda a: (makespan(a.run), -a.paired))
    for attempt in settled:
        if _settle(schedule, attempt, target) and attempt.paired:
            return _finish(schedule, attempt.combined)
    return _finish(schedule, schedule)


def _longest_pair(schedule: Schedule) -> float:
    """The longest a pair can take on the timeline: F plus the longest backward present."""
    kinds = {c.kind for row in schedule.actions for a in row for c in a.computations()}
    backward = max((DEFAULT_DURATIONS[k] for k in kinds & BACKWARD_KINDS), default=0.0)
    return DEFAULT_DURATIONS[Kind.F] + backward


def _finish(schedule: Schedule, combined: Schedule) -> Schedule:
    options = dict(schedule.options)
    options["overlap"] = True
    return combined.replace_actions(combined.actions, options=options)
