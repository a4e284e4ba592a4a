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

from collections.abc import Sequence

import numpy as np

from ..ir import Action, Kind

ACTIVATION_RELEASE = frozenset({Kind.B, Kind.I})
STASH_RELEASE = frozenset({Kind.B, Kind.W})


def peak_of_events(takes: np.ndarray, releases: np.ndarray) -> int:
    """The most held at once, given when each activation is taken and when each is given back
    (both in time order; a release at the time of a take comes first)."""
    if not len(takes):
        return 0
    held = np.arange(1, len(takes) + 1) - np.searchsorted(releases, takes, "right")
    return max(0, int(held.max()))


def peak_in_flight(row: Sequence[Action], release: frozenset = ACTIVATION_RELEASE) -> int:
    """Most activations a rank's action list holds at once, in list order."""
    kinds = [comp.kind for action in row for comp in action.computations()]
    order = np.arange(len(kinds))
    takes = order[[kind is Kind.F for kind in kinds]]
    gives = order[[kind in release for kind in kinds]]
    return peak_of_events(takes, gives)
