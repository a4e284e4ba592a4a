"""How many microbatch activations a rank holds at once: the one count behind the overlap pass's
memory bound, the executor's stash limit and the simulator's ``peak_in_flight``.

An F takes one activation (of its stage and microbatch) and a later computation of the same
stage and microbatch gives it back. Which one depends on what is counted: the activation the
forward saved is freed by the backward that uses it (B or I, ``ACTIVATION_RELEASE``), while the
executor's stash keeps what W still needs after an I, so there B or W releases
(``STASH_RELEASE``). An OVERLAP takes its forward half before its backward half releases
anything, the worst case inside the pair.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from .ir import Action, Kind

ACTIVATION_RELEASE = frozenset({Kind.B, Kind.I})
STASH_RELEASE = frozenset({Kind.B, Kind.W})


def peak_held(changes: Iterable[int]) -> int:
    """The most held at once, given +1 (take) and -1 (give back) in the order they happen."""
    held = peak = 0
    for change in changes:
        held += change
        peak = max(peak, held)
    return peak


def holding_change(comp: Action, release: frozenset = ACTIVATION_RELEASE) -> int:
    """+1 for a forward, -1 for a computation that releases, 0 for anything else."""
    if comp.kind is Kind.F:
        return 1
    return -1 if comp.kind in release else 0


def peak_in_flight(row: Sequence[Action], release: frozenset = ACTIVATION_RELEASE) -> int:
    """Most activations a rank's action list holds at once, in list order."""
    return peak_held(
        holding_change(comp, release) for action in row for comp in action.computations()
    )
