"""The speed/memory trade of the overlap pass: one simulation per in-flight budget.

``budget_sweep`` builds the combined schedule at every budget K = 0..pp (the most extra
microbatch-stages any pairing adds is pp, the chain's ``e_0``) and unbounded, simulates each
with the given costs, and returns per budget the makespan, the peak in flight per rank and the
number of pairs, beside the plain schedule's. ``megapipe schedule --overlap`` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..schedule.ir import Kind, Schedule
from ..schedule.registry import build_schedule
from .costs import Costs
from .simulate import simulate


@dataclass(frozen=True)
class BudgetPoint:
    """One budget's simulated run: ``budget`` None is the unbounded pass."""

    budget: int | None
    makespan: float
    peak_in_flight: tuple[int, ...]
    pairs: int


def count_pairs(schedule: Schedule) -> int:
    """How many OVERLAP actions ``schedule`` holds."""
    return sum(action.kind is Kind.OVERLAP for row in schedule.actions for action in row)


def budget_sweep(
    name: str, pp: int, num_microbatches: int, costs: Costs, **options: Any
) -> tuple[BudgetPoint, list[BudgetPoint]]:
    """(the plain schedule's point, the combined schedule's point at K = 0..pp and unbounded).
    ``options`` go to ``build_schedule`` (vpp, microbatch group size)."""
    plain = build_schedule(name, pp, num_microbatches, **options)
    plain_point = _point(None, plain, costs)
    points = [
        _point(
            budget,
            build_schedule(
                name, pp, num_microbatches, overlap=True, max_extra_in_flight=budget, **options
            ),
            costs,
        )
        for budget in [*range(pp + 1), None]
    ]
    return plain_point, points


def _point(budget: int | None, schedule: Schedule, costs: Costs) -> BudgetPoint:
    result = simulate(schedule, costs)
    return BudgetPoint(budget, result.makespan, result.peak_in_flight, count_pairs(schedule))


def format_sweep(plain: BudgetPoint, points: list[BudgetPoint]) -> str:
    """The sweep as a table: budget, makespan and its ratio to plain, peak in flight, pairs."""
    lines = [
        "budget K  makespan  vs plain  peak in flight (per rank)  pairs",
        _row("plain", plain, plain),
    ]
    lines += [_row("unbounded" if p.budget is None else str(p.budget), p, plain) for p in points]
    return "\n".join(lines)


def _row(label: str, point: BudgetPoint, plain: BudgetPoint) -> str:
    ratio = point.makespan / plain.makespan if plain.makespan else 1.0
    peaks = " ".join(str(p) for p in point.peak_in_flight)
    return f"{label:<9} {point.makespan:>9g} {ratio:>8.3f}  {peaks:<26} {point.pairs:>5}"
