"""Helpers the schedule tests share for reading one rank's action list."""

from __future__ import annotations

from megapipe.schedule.ir import Action, Kind


def leading_forwards(row: tuple[Action, ...] | list[Action]) -> int:
    """How many plain forwards a rank runs before its first other action (its warmup)."""
    count = 0
    for action in row:
        if action.kind is not Kind.F:
            break
        count += 1
    return count
