"""The fastest schedule under a memory budget: every registry schedule, vpp, in-flight budget
and recompute choice, simulated, and the fastest one whose activations fit.

A choice is a schedule name, its stages per rank (vpp 1 or 2 where the schedule lets it vary), the
overlap pass off or on within an in-flight budget K = 0..pp (``schedule.overlap_pass.budget``), and
recompute none, selective or full. Its memory is the most any rank holds: ``peak_in_flight`` of the
rank's action list (microbatch-stages) times the bytes of one chunk and one microbatch, times
the part recompute keeps. A chunk holds ``pp / stages_per_pipeline`` of the layers of a plain
stage (half at vpp 2; DualPipe's two chunks per rank are each a whole stage, one per
direction). Its time is the simulator's makespan with the costs of one plain stage scaled by
that share (F, B, W and the all-to-alls of a chunk at vpp 2 take half as long); recompute
re-runs a part of the forward inside each backward (selective: the attention core and the
experts' activation; full: every compute node of every layer), so B (and I = B - W) grows by
``cost * F``. What each recompute saves and costs is an assumption the caller gives.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass

from ..schedule.errors import ScheduleError
from ..schedule.ir import Schedule
from ..schedule.overlap_pass.in_flight import peak_in_flight
from ..schedule.registry import SCHEDULES, build_schedule
from .costs import Costs, NodeCosts
from .simulate import simulate

RECOMPUTE_PREFERENCE = ("none", "selective", "full")  # on a tie, the one re-running less wins


@dataclass(frozen=True)
class Recompute:
    """A recompute's trade: ``saves`` of the activation bytes are no longer kept, and each
    backward re-runs ``cost`` times its forward (both fractions in [0, 1]). The defaults are
    selective recompute's; ``FULL_RECOMPUTE`` is full's."""

    saves: float = 0.3
    cost: float = 0.3

    def __post_init__(self) -> None:
        for name in ("saves", "cost"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ValueError(f"recompute {name} must be a fraction in [0, 1], got {value!r}")


FULL_RECOMPUTE = Recompute(saves=0.7, cost=1.0)
"""Full recompute re-runs every compute node's forward (cost 1) and keeps the node inputs only:
0.7 saved is an assumption (the demo model measures 0.57 with held tensors counted,
docs/memory.md); pass your own model's fraction."""


@dataclass(frozen=True)
class Choice:
    """One simulated choice. ``budget`` None: no overlap; K: overlap within K extra in flight."""

    schedule: str
    vpp: int
    budget: int | None
    recompute: str  # "none", "selective" or "full"
    makespan: float
    peak_bytes: float

    def describe(self) -> str:
        """A one-line summary naming every part of the choice."""
        overlap = "off" if self.budget is None else f"on K={self.budget}"
        return (
            f"{self.schedule} vpp={self.vpp} overlap {overlap} recompute {self.recompute}: "
            f"makespan {self.makespan:g}, peak {self.peak_bytes:g} bytes"
        )


def candidate_schedules(
    pp: int, num_microbatches: int
) -> Iterator[tuple[str, int, int | None, Schedule]]:
    """(name, vpp, budget, schedule) for every buildable choice; impossible requests are skipped."""
    for name in SCHEDULES:
        seen_vpp = set()
        for vpp in (1, 2):
            try:
                plain = build_schedule(name, pp, num_microbatches, vpp=vpp)
            except ScheduleError:
                continue
            actual = plain.options.vpp
            assert actual is not None  # build_schedule keeps the vpp it is given
            if actual in seen_vpp:
                continue
            seen_vpp.add(actual)
            yield name, actual, None, plain
            for budget in range(pp + 1):
                combined = build_schedule(
                    name, pp, num_microbatches, vpp=vpp, overlap=True, max_extra_in_flight=budget
                )
                yield name, actual, budget, combined


def chunk_share(schedule: Schedule) -> float:
    """The part of a plain stage's layers one of ``schedule``'s chunks holds."""
    return schedule.pp / schedule.stages_per_pipeline


def peak_bytes(schedule: Schedule, activation_bytes: float, kept: float = 1.0) -> float:
    """The most activation bytes any rank holds: peak microbatch-chunks in flight times one
    chunk's bytes (``activation_bytes`` is one plain stage's, for one microbatch) times ``kept``."""
    peak = max(peak_in_flight(schedule.row(rank)) for rank in range(schedule.pp))
    return peak * activation_bytes * chunk_share(schedule) * kept


def chunk_costs(costs: Costs, share: float) -> Costs:
    """``costs`` of one plain stage scaled to a chunk holding ``share`` of its layers."""
    if share == 1:
        return costs
    return dataclasses.replace(
        costs,
        **{
            name: getattr(costs, name) * share
            for name in ("forward", "backward", "weight", "dispatch", "combine")
        },
    )


def with_recompute(costs: Costs, recompute: Recompute) -> Costs:
    """``costs`` with each backward also re-running ``recompute.cost`` of its forward."""
    return dataclasses.replace(costs, backward=costs.backward + recompute.cost * costs.forward)


def all_choices(
    pp: int,
    num_microbatches: int,
    costs: Costs,
    activation_bytes: float,
    recompute: Recompute = Recompute(),
    full: Recompute = FULL_RECOMPUTE,
) -> list[Choice]:
    """Every choice simulated, fastest first (then the one holding less, then fewer parts).
    ``recompute``: selective recompute's trade; ``full``: full recompute's."""
    if not (math.isfinite(activation_bytes) and activation_bytes > 0):
        raise ValueError(f"activation bytes must be a finite number > 0, got {activation_bytes!r}")
    choices = []
    for name, vpp, budget, schedule in candidate_schedules(pp, num_microbatches):
        plain_costs = chunk_costs(costs, chunk_share(schedule))
        options = [("none", plain_costs, 1.0)] + [
            (kind, with_recompute(plain_costs, trade), 1.0 - trade.saves)
            for kind, trade in (("selective", recompute), ("full", full))
        ]
        for recomputed, action_costs, kept in options:
            makespan = simulate(schedule, action_costs).makespan
            choices.append(
                Choice(
                    name,
                    vpp,
                    budget,
                    recomputed,
                    makespan,
                    peak_bytes(schedule, activation_bytes, kept),
                )
            )
    return sorted(choices, key=_rank_key)


def _rank_key(choice: Choice) -> tuple:
    return (
        choice.makespan,
        choice.peak_bytes,
        RECOMPUTE_PREFERENCE.index(choice.recompute),
        -1 if choice.budget is None else choice.budget,
    )


def pick(choices: list[Choice], memory_budget: float) -> list[Choice]:
    """The choices that fit ``memory_budget`` bytes, fastest first; a choice equal in time and
    bytes to an earlier one of the same schedule, vpp and recompute (a larger K that changed
    nothing) is dropped."""
    if not (isinstance(memory_budget, (int, float)) and memory_budget >= 0):
        raise ValueError(f"memory budget must be a number of bytes >= 0, got {memory_budget!r}")
    fitting, seen = [], set()
    for choice in choices:
        key = (choice.schedule, choice.vpp, choice.recompute, choice.makespan, choice.peak_bytes)
        if choice.peak_bytes <= memory_budget and key not in seen:
            seen.add(key)
            fitting.append(choice)
    return fitting


def format_pick(choices: list[Choice], memory_budget: float, top: int = 5) -> str:
    """The best choice in one line and a table of the best ``top``; or, if nothing fits, one
    line naming the smallest memory any choice needs."""
    fitting = pick(choices, memory_budget)
    if not fitting:
        smallest = min(choice.peak_bytes for choice in choices)
        return (
            f"no choice fits the memory budget of {memory_budget:g} bytes: the smallest "
            f"needs {smallest:g} bytes"
        )
    lines = [
        f"best: {fitting[0].describe()}",
        "",
        "schedule          vpp  overlap  recompute   makespan  peak bytes",
    ]
    for choice in fitting[:top]:
        overlap = "off" if choice.budget is None else f"K={choice.budget}"
        lines.append(
            f"{choice.schedule:<17} {choice.vpp:>3}  {overlap:<7}  {choice.recompute:<9} "
            f"{choice.makespan:>10g}  {choice.peak_bytes:>10g}"
        )
    return "\n".join(lines)


def choose_a2a_waves(
    schedule: Schedule, nodes: NodeCosts, max_waves: int = 4, tolerance: float = 0.01
) -> int:
    """The default of ``--moe-a2a-waves``: the smallest k in 1..``max_waves`` whose simulated
    step is within ``tolerance`` of the fastest (waves that gain nothing are not worth their
    extra latency and smaller GEMMs, which the profile does not price)."""
    spans = {}
    for k in range(1, max_waves + 1):
        costs = Costs(nodes=dataclasses.replace(nodes, a2a_waves=k))
        spans[k] = simulate(schedule, costs).makespan
    best = min(spans.values())
    return min(k for k, span in spans.items() if span <= best * (1 + tolerance))
