"""The overlap pass: turn an F/B (or F/I/W) schedule into a combined one of OVERLAP pairs.

An OVERLAP ``(sF i; s'B j)`` runs the forward of microbatch i beside the backward of microbatch j
so that each one's all-to-all hides behind the other's compute (DESIGN.md, "Combined step").

The pass is one rule applied to each rank's list, whatever schedule made it:

    every backward (B or I) is paired with the forward that comes next on its rank, provided
    nothing but W actions lie between them; the pair takes the backward's place, so that
    forward moves one slot earlier (before the backward and those W's).

A forward that follows a backward is always of another microbatch (a backward of microbatch j
needs the loss of j, so every forward of j precedes it), and a forward never needs a backward,
so each pair's halves are independent (``pair_is_independent``). Moving each forward one slot
earlier is Megatron's "+1 warmup": 1F1B's steady state ``F B F B`` becomes ``F (F;B) (F;B)``
with one more forward in flight, never two more (each forward moves past its own backward only),
and the last backward of the steady state, followed by no forward, stays alone. With pp=1 this
gives Megatron's no-pipelining order ``F0 (F1;B0) (F2;B1) ... B(M-1)``; for interleaved 1F1B, its
combined order with warmup + 1. It works the same for plain 1F1B, ZB1P and ZBV (pairing F with I;
W actions stay where they were). Schedules with no forward after a backward (GPipe, looped BFS)
get no pairs.

Fusing two actions into one can make ranks wait on each other in a cycle (a pair needing, through
another rank, the output of its own other half). The pass therefore runs the paired schedule
(``deps.timeline``) and, while ranks are stuck, splits the stuck pairs whose backward
could run alone (or, if none could, every stuck pair) until it runs through; each split restores
that rank's original order there, and the original order ran. Schedules that already hold
OVERLAP actions (DualPipe, DualPipeV) pass unchanged.
"""

from __future__ import annotations

from .deps import missing_needs, timeline
from .errors import ScheduleError
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


def find_pairs(row: tuple[Action, ...]) -> list[Pair]:
    """Pair each backward with the next forward when only W actions lie between them."""
    pairs = []
    for index, action in enumerate(row):
        if action.kind not in BACKWARD_KINDS:
            continue
        after = index + 1
        while after < len(row) and row[after].kind is Kind.W:
            after += 1
        if after < len(row) and row[after].kind is Kind.F:
            if pair_is_independent(row[after], action):
                pairs.append((index, after))
    return pairs


def assemble(row: tuple[Action, ...], pairs: list[Pair]) -> tuple[list[Action], dict[int, Pair]]:
    """The rank's list with ``pairs`` fused; also which pair each new index holds."""
    forward_of = {b: f for b, f in pairs}
    moved = set(forward_of.values())
    out: list[Action] = []
    pair_at: dict[int, Pair] = {}
    for index, action in enumerate(row):
        if index in moved:
            continue
        if index in forward_of:
            pair_at[len(out)] = (index, forward_of[index])
            out.append(Action.overlap(row[forward_of[index]], action))
        else:
            out.append(action)
    return out, pair_at


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
    pairs = [find_pairs(row) for row in rows]
    while True:
        assembled = [assemble(row, rank_pairs) for row, rank_pairs in zip(rows, pairs)]
        combined = schedule.replace_actions([out for out, _ in assembled])
        run = timeline(combined)
        if not run.stuck:
            break
        stuck_pairs = {
            rank: assembled[rank][1][index]
            for rank, index in run.stuck.items()
            if index in assembled[rank][1]
        }
        if not stuck_pairs:
            # Only reachable if an unpaired action blocks; the original ran, so report it plainly.
            rank, index = next(iter(run.stuck.items()))
            raise ScheduleError(
                "the paired schedule cannot run and no pair is to blame (overlap pass bug)",
                rank, combined.actions[rank][index],
            )
        # A pair whose backward could run alone is one that waits only for its forward's input:
        # splitting it lets the backward go first, as it did before pairing, and the cycle opens.
        # If no pair is like that, split every stuck pair (the original order runs).
        blocking = {
            rank: pair for rank, pair in stuck_pairs.items()
            if not missing_needs(schedule, rows[rank][pair[0]], run.made)
        }
        for rank, pair in (blocking or stuck_pairs).items():
            pairs[rank].remove(pair)
    options = dict(schedule.options)
    options["overlap"] = True
    return combined.replace_actions(combined.actions, options=options)


def peak_in_flight(row: tuple[Action, ...]) -> int:
    """Most microbatch activations a rank holds at once: forwards run minus backwards run.

    The forward half of an OVERLAP counts before its backward half frees anything, which is
    the worst case inside the pair.
    """
    held = peak = 0
    for action in row:
        for comp in action.computations():
            if comp.kind is Kind.F:
                held += 1
                peak = max(peak, held)
            elif comp.kind in BACKWARD_KINDS:
                held -= 1
    return peak
