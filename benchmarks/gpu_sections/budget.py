"""The time budget of one GPU check: how long each section may run.

Sections run one after another in the order of what their figures are worth (``registry.py``).
A section gets its cap, or what is left of the budget when that is less, and is stopped there
(the runner kills its process group); it is skipped when less than its minimum is left. No
section can take more than its cap, so none eats the time of a section after it beyond that;
and the caps of the sections that matter most add up to less than the default check
(``registry.GUARANTEED``, tested), so those always get their caps, whatever the sections before
them do. ``device_plan`` states each section's time on the device (what a dry run prints).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Allowance:
    """What a section may use: ``seconds`` to run, or None with ``reason`` (skipped)."""

    seconds: float | None
    reason: str = ""


def allowance(left: float, cap: float, minimum: float) -> Allowance:
    """The time a section gets with ``left`` seconds of budget remaining."""
    if cap < minimum:
        raise ValueError(f"a section's cap {cap} s is below its minimum {minimum} s")
    if left < minimum:
        return Allowance(
            None,
            f"budget spent: {max(left, 0):.0f} s left, the section needs at least {minimum:.0f} s",
        )
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

    def for_section(self, cap: float, minimum: float) -> Allowance:
        """The allowance of a section with this cap and minimum, now."""
        return allowance(self.left(), cap, minimum)


def device_plan(caps: Sequence[float], minimums: Sequence[float],
                seconds: float) -> list[float | None]:
    """Each section's allowance on the device at worst, when every section before it used its
    whole allowance (None: it may be skipped, when they do)."""
    plan: list[float | None] = []
    left = seconds
    for cap, minimum in zip(caps, minimums):
        got = allowance(left, cap, minimum).seconds
        plan.append(got)
        left -= got or 0.0
    return plan
