"""The time budget of one GPU check: how long each section may run.

Sections run one after another in priority order. Each declares a cap (the most it may use)
and a minimum (below which running it is pointless). A section gets at most its cap, and leaves
the later sections their minimums when it can; when that would leave it less than its own
minimum it takes from the later sections' share instead (it comes first, it matters more); it
is skipped only when less than its minimum is left of the whole budget.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence


@dataclass(frozen=True)
class Allowance:
    """What a section may use: ``seconds`` to run, or None with ``reason`` (skipped)."""

    seconds: float | None
    reason: str = ""


def allowance(left: float, cap: float, minimum: float, later_minimums: float) -> Allowance:
    """The time a section gets with ``left`` seconds of budget remaining."""
    if cap < minimum:
        raise ValueError(f"a section's cap {cap} s is below its minimum {minimum} s")
    if left < minimum:
        return Allowance(
            None, f"budget spent: {max(left, 0):.0f} s left, the section needs at least {minimum:.0f} s"
        )
    polite = min(cap, left - later_minimums)
    if polite >= minimum:
        return Allowance(polite)
    return Allowance(min(cap, left))


@dataclass
class Budget:
    """A total of ``seconds`` from the moment it is made (``clock``: monotonic seconds)."""

    seconds: float
    clock: Callable[[], float] = time.monotonic
    started: float = field(default=0.0)

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise ValueError(f"--budget must be > 0 seconds, got {self.seconds}")
        self.started = self.clock()

    def left(self) -> float:
        return self.seconds - (self.clock() - self.started)

    def for_section(self, index: int, caps: Sequence[float], minimums: Sequence[float]) -> Allowance:
        """The allowance of section ``index`` of the sections with these caps and minimums."""
        return allowance(self.left(), caps[index], minimums[index], sum(minimums[index + 1 :]))
