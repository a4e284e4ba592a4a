"""What a simulation returns: the metrics of one simulated schedule, and its timeline."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from ..schedule.ir import Action
from .costs import Costs
from .programs import Segment


@dataclass(frozen=True)
class TimedAction:
    """One action of the timeline. An OVERLAP's ``halves`` are its F and its B/I, each timed
    from its first to its last piece; ``segments`` are the pieces on the two streams."""

    rank: int
    action: Action
    start: float
    end: float
    halves: tuple[TimedAction, ...] = ()
    segments: tuple[Segment, ...] = ()


@dataclass(frozen=True)
class SimResult:
    """Timeline and metrics of one simulated run of a schedule (one training step).

    Per rank: ``busy`` is compute time; ``comm`` the all-to-all time; ``exposed_comm`` the
    all-to-all time with no compute beside it (the rank waits on its own communication);
    ``idle`` = makespan - busy; ``bubble`` = idle - exposed_comm, the time spent waiting for
    other ranks. With free communication bubble = idle = makespan - busy.
    ``peak_in_flight``: the most microbatch activations held at once, counted per stage (an F
    holds one from its start until its B or I ends; for one stage per rank that is microbatches).
    """

    name: str
    costs: Costs
    makespan: float
    busy: tuple[float, ...]
    comm: tuple[float, ...]
    exposed_comm: tuple[float, ...]
    peak_in_flight: tuple[int, ...]
    make_timeline: Callable[[], tuple[TimedAction, ...]] = field(
        default=tuple, repr=False, compare=False
    )

    @functools.cached_property
    def timeline(self) -> tuple[TimedAction, ...]:
        """Every action with its times and pieces, in the order the simulation ran them (made
        on first use: a million-action run's metrics do not need it)."""
        return self.make_timeline()

    @property
    def pp(self) -> int:
        return len(self.busy)

    @property
    def idle(self) -> tuple[float, ...]:
        return tuple(self.makespan - b for b in self.busy)

    @property
    def bubble(self) -> tuple[float, ...]:
        return tuple(i - e for i, e in zip(self.idle, self.exposed_comm))

    @property
    def bubble_fraction(self) -> float:
        """Share of all rank-time spent waiting for other ranks."""
        total = self.makespan * self.pp
        return sum(self.bubble) / total if total else 0.0

    @property
    def exposed_comm_fraction(self) -> float:
        """Share of all-to-all time not hidden behind compute (0 when communication is free)."""
        total = sum(self.comm)
        return sum(self.exposed_comm) / total if total else 0.0

    def actions_of(self, rank: int) -> list[TimedAction]:
        return self._by_rank.get(rank, [])

    @functools.cached_property
    def _by_rank(self) -> dict[int, list[TimedAction]]:
        by_rank: dict[int, list[TimedAction]] = {}
        for timed in self.timeline:
            by_rank.setdefault(timed.rank, []).append(timed)
        return by_rank

    def summary(self) -> str:
        """The metrics as a few readable lines."""

        def row(values) -> str:
            return " ".join(f"{v:g}" for v in values)

        lines = [
            f"makespan          {self.makespan:g}",
            f"bubble per rank   {row(round(b, 6) for b in self.bubble)}",
            f"bubble fraction   {self.bubble_fraction:.1%}",
            f"busy per rank     {row(round(b, 6) for b in self.busy)}",
        ]
        if sum(self.comm):
            lines.append(f"exposed a2a       {row(round(e, 6) for e in self.exposed_comm)}")
            lines.append(
                f"exposed a2a frac  {self.exposed_comm_fraction:.1%} "
                f"of {sum(self.comm):g} all-to-all time"
            )
        else:
            lines.append("exposed a2a frac  - (free all-to-all; set costs F,B,W,A2A)")
        lines.append(f"peak in flight    {row(self.peak_in_flight)} (microbatch-stages per rank)")
        return "\n".join(lines)
