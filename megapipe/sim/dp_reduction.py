"""The data-parallel gradient reduction term of the cost model: how much of it a schedule hides.

After the backward, each stage's gradients are reduced over data parallelism (all-reduce, or
reduce-scatter with the distributed optimizer). ``DPCosts.reduce`` is the time of one stage's
whole reduction, cut into ``buckets`` equal buckets; the reductions of a rank run one after
another on its data-parallel communication stream, beside its computation. Two ways to place
them in a simulated step (``dp_reduction``):

- *after the step*: every reduction starts when the rank's last action has ended; all of it is
  exposed, the rank's step grows by its whole reduction;
- *overlapped* (``--overlap-grad-reduce``): a stage's buckets become final during the stage's
  last gradient-producing computation of the step (its last B or I, or its last W when the
  schedule defers weight gradients; an OVERLAP counts its backward half), bucket k of n at
  (k + 1) / n of it, as the backward finishes the parameters; each starts as soon as it is
  final and the stream is free. DualPipe sums its mirrored stages after the last action, so
  there every bucket is final only then. The exposed part is what runs past the rank's last
  action.

The step of a rank is its last action's end plus its exposed reduction; the step's makespan is
the largest over the ranks. The model keeps the simulated actions where they are (the stream
takes no compute time), and it does not model the all-gather of the distributed optimizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..schedule.ir import Kind, Schedule, plain_key
from .result import SimResult, TimedAction

_GRAD_KINDS = (Kind.B, Kind.I, Kind.W)


@dataclass(frozen=True)
class DPCosts:
    """``reduce``: one stage's whole gradient reduction; ``buckets``: how many buckets it is
    cut into (each a part of the stage's last gradient-producing computation, see above)."""

    reduce: float
    buckets: int = 1

    def __post_init__(self) -> None:
        if not (
            isinstance(self.reduce, (int, float))
            and math.isfinite(self.reduce)
            and self.reduce >= 0
        ):
            raise ValueError(f"dp reduce cost {self.reduce!r} must be a finite number >= 0")
        if isinstance(self.buckets, bool) or not isinstance(self.buckets, int) or self.buckets < 1:
            raise ValueError(f"dp buckets {self.buckets!r} must be an integer >= 1")


@dataclass(frozen=True)
class DPReduction:
    """Per rank: ``total`` reduction time, ``last_action`` end, ``exposed_after`` (the whole
    reduction, after the step) and ``exposed_overlapped``; and the two makespans."""

    costs: DPCosts
    total: tuple[float, ...]
    last_action: tuple[float, ...]
    exposed_overlapped: tuple[float, ...]
    makespan_plain: float  # the schedule alone
    makespan_after: float
    makespan_overlapped: float

    @property
    def exposed_after(self) -> tuple[float, ...]:
        return self.total

    @property
    def hidden_fraction(self) -> float:
        """Share of all ranks' reduction time hidden behind computation when overlapped."""
        total = sum(self.total)
        return 1.0 - sum(self.exposed_overlapped) / total if total else 1.0

    def summary(self) -> str:
        c = self.costs
        exposed = max(self.exposed_overlapped, default=0.0)
        return (
            f"data-parallel reduction ({c.reduce:g} per stage in {c.buckets} bucket(s)): "
            f"after the step {max(self.exposed_after, default=0.0):g} exposed, step "
            f"{self.makespan_plain:g} -> {self.makespan_after:g}; overlapped with the backward "
            f"{exposed:g} exposed ({self.hidden_fraction:.0%} hidden), step "
            f"{self.makespan_overlapped:g}"
        )


def _grad_spans(schedule: Schedule, actions: list[TimedAction]) -> dict[int, tuple[float, float]]:
    """Per stage: the span of its last gradient-producing computation on this rank."""
    spans: dict[int, tuple[float, float]] = {}
    for timed in actions:
        parts = timed.halves if timed.action.kind is Kind.OVERLAP else (timed,)
        for part in parts:
            if part.action.kind in _GRAD_KINDS:
                spans[plain_key(part.action)[0]] = (part.start, part.end)
    return spans


def dp_reduction(schedule: Schedule, result: SimResult, costs: DPCosts) -> DPReduction:
    """Place the data-parallel reductions of every stage in ``result``'s simulated step (module
    docstring); ``result`` is ``simulate(schedule, ...)``."""
    per_bucket = costs.reduce / costs.buckets
    totals, ends, exposed = [], [], []
    for rank in range(schedule.pp):
        actions = sorted((t for t in result.timeline if t.rank == rank), key=lambda t: t.start)
        last = max((t.end for t in actions), default=0.0)
        spans = _grad_spans(schedule, actions)
        ready = []
        for start, end in spans.values():
            for k in range(costs.buckets):
                share = (k + 1) / costs.buckets
                ready.append(last if schedule.bidirectional else start + share * (end - start))
        free = 0.0
        for at in sorted(ready):
            free = max(free, at) + per_bucket
        totals.append(per_bucket * len(ready))
        ends.append(last)
        exposed.append(max(0.0, free - last) if ready else 0.0)
    plain = result.makespan
    return DPReduction(
        costs,
        tuple(totals),
        tuple(ends),
        tuple(exposed),
        plain,
        max((e + t for e, t in zip(ends, totals)), default=plain),
        max((e + x for e, x in zip(ends, exposed)), default=plain),
    )
