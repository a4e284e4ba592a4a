"""The cost model of the schedule simulator: how long each piece of an action takes.

Durations are in arbitrary time units (the trace writer reads one unit as one millisecond).
``forward``, ``backward`` and ``weight`` are the costs of one stage (model chunk) for one
microbatch: F, B (full backward) and W (weight-gradient backward), so the input-gradient
backward costs I = B - W. Each F and each B (or I) of a stage runs ``moe_layers`` MoE layers;
every layer sends its tokens out (dispatch all-to-all) and back (combine all-to-all) once in the
forward and once in the backward. Communication is free by default, which is the setting of the
closed-form bubble formulas.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..pairing.timing import COMM, COMPUTE, NodeTimes
from ..schedule.ir import Kind
from ..schedule.p2p.early_sends import EACH, SINGLE, WHOLE
from .profile import MOE_ROLES, WAVE_ROLES, NodeProfile

_KIND = {"attn": COMPUTE, "dispatch": COMM, "mlp": COMPUTE, "combine": COMM, "finish": COMPUTE}
# when an OVERLAP's halves hand their outputs on: the executor's rules
# (``schedule.p2p.early_sends``: each when its last node ends; both once both halves are done,
# before the held weight gradients, also the conservative reading of the rule that sends only
# single-send pairs early), or, to compare, at the end of the pair
AT_END = "at the end"
EARLY_RULES = (EACH, SINGLE, WHOLE, AT_END)


def _check_duration(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"cost {name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"cost {name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class NodeCosts:
    """What an action is made of, node by node (the node model of ``programs``' module docstring).

    ``num_stages``: the stages of one pipeline (``Schedule.stages_per_pipeline``; DualPipe's
    second pipeline's stages count from ``num_stages`` on): its first holds the embedding, its
    last the head; ``moe_layers`` MoE layers per stage. ``combined``: the schedule runs node by
    node on the streams (the engine does so in combined schedules): an I keeps attention's
    weight gradient (only the experts' GEMMs defer); in a plain schedule the generic split moves
    every weight gradient to W. ``wgrad_by_time``: the engine's nodes carry their times (as the
    replay benchmark's do), so the order places deferred weight gradients by the time rule;
    without (a training run's nodes carry none) by the count rule. ``early_sends``: when an
    OVERLAP's halves hand their outputs on (``EARLY_RULES``; None: the rule the executor proves
    for the schedule, ``schedule.p2p.early_sends.choose_early_sends``). ``host_cost``: what the
    engine spends per F or B node beyond the node's own time (a property of the machine, measured by
    ``benchmarks/replay_calibration.py``), added to every F and B node (not to W)."""

    profile: NodeProfile
    num_stages: int
    moe_layers: int
    a2a_waves: int = 1
    defer_wgrad: bool = False
    host_runs_compute: bool = False
    combined: bool = True
    early_sends: str | None = None  # None: the executor's rule for the schedule
    wgrad_by_time: bool = False
    host_cost: float = 0.0

    def __post_init__(self) -> None:
        for name in ("num_stages", "a2a_waves"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"NodeCosts {name} must be an integer >= 1, got {value!r}")
        if self.early_sends is not None and self.early_sends not in EARLY_RULES:
            raise ValueError(
                f"NodeCosts early_sends={self.early_sends!r} is not one of {', '.join(EARLY_RULES)}"
            )
        if not self.host_cost >= 0:
            raise ValueError(f"NodeCosts host_cost must be >= 0, got {self.host_cost!r}")
        if (
            isinstance(self.moe_layers, bool)
            or not isinstance(self.moe_layers, int)
            or self.moe_layers < 0
        ):
            raise ValueError(
                f"NodeCosts moe_layers must be an integer >= 0, got {self.moe_layers!r}"
            )

    def stage_class(self, stage: int) -> int:
        """0 a middle stage, 1 the first, 2 the last, 3 both (their actions differ)."""
        position = stage % self.num_stages
        return int(position == 0) + 2 * int(position == self.num_stages - 1)

    def layers(self, stage: int) -> list[tuple[str, ...]]:
        """The node roles of each layer of ``stage``, in forward order."""
        k = self.a2a_waves
        moe = MOE_ROLES if k == 1 else ("attn",) + WAVE_ROLES * k + ("finish",)
        kind = self.stage_class(stage)
        layers: list[tuple[str, ...]] = [("embedding",)] if kind & 1 else []
        layers += [moe] * self.moe_layers
        return layers + ([("head",)] if kind & 2 else [])

    def kinds(self, roles: Sequence[str]) -> list:
        """The pair order's kinds of a layer (a fork of the waves when k > 1)."""
        if len(roles) == 1 or self.a2a_waves == 1:
            return [_KIND.get(role, COMPUTE) for role in roles]
        wave = tuple(_KIND[role] for role in WAVE_ROLES)
        return [COMPUTE, tuple(wave for _ in range(self.a2a_waves)), COMPUTE]

    def node_times(self, roles: Sequence[str]) -> tuple[NodeTimes, ...]:
        """The times of a layer's nodes as the time rule sees them."""
        return tuple(self.profile.node_times(role, self.a2a_waves) for role in roles)

    def backward_time(self, role: str, kind: Kind) -> float:
        """A node's backward: B, plus its W where the action computes it."""
        time = self.profile.time(role, "B", self.a2a_waves)
        weight = self.profile.time(role, "W", self.a2a_waves)
        if role == "attn":
            keeps = kind is Kind.B or self.combined
        else:
            keeps = kind is Kind.B and not self.defer_wgrad
        return time + (weight if keeps else 0.0)

    def weight_time(self) -> float:
        """A W action of one stage: the weight gradients its I left."""
        roles = ("mlp",) if self.combined else ("attn", "mlp")
        return self.moe_layers * sum(self.profile.time(r, "W") for r in roles)


@dataclass(frozen=True)
class Costs:
    """Per-chunk durations, per-stage multipliers, P2P latency and all-to-all segments.

    - ``forward``, ``backward``, ``weight``: F, B and W of one stage and one microbatch (W <= B).
    - ``stage_multipliers``: compute of stage s is scaled by ``stage_multipliers[s]`` (e.g. a
      first stage that also holds the embedding); empty means 1 for every stage.
      Communication is not scaled.
    - ``p2p_latency``: delay between a stage finishing and the next stage (on another rank) being
      able to use its output; a hand-off between two stages of one rank is immediate.
    - ``dispatch``, ``combine``: duration of one dispatch and one combine all-to-all of one MoE
      layer, the same in the forward and (as the transposed exchange) in the backward.
    - ``moe_layers``: MoE layers per stage; the compute of an action is split evenly across them.
      0 means a dense model: no all-to-all at all.
    - ``attention_share``: the part of a layer's compute spent before the dispatch (attention
      and router); the rest is the experts. Backward compute is split the same way. 0.5 by
      default: in large MoE models (DeepSeek-V3) attention and expert compute are comparable.
    - ``nodes``: time every action node by node, in the engine's issue order, from a node-time
      profile (``programs.NodeCosts``); the fields above then serve only ``p2p_latency``.
    """

    forward: float = 1.0
    backward: float = 2.0
    weight: float = 1.0
    stage_multipliers: tuple[float, ...] = ()
    p2p_latency: float = 0.0
    dispatch: float = 0.0
    combine: float = 0.0
    moe_layers: int = 1
    attention_share: float = 0.5
    nodes: NodeCosts | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "stage_multipliers", tuple(self.stage_multipliers))
        except TypeError:
            raise ValueError(
                f"stage_multipliers must be a sequence of numbers, got {self.stage_multipliers!r}"
            ) from None
        for name in ("forward", "backward", "weight", "p2p_latency", "dispatch", "combine"):
            _check_duration(name, getattr(self, name))
        if self.weight > self.backward:
            raise ValueError(
                f"cost weight (W={self.weight}) must not exceed backward (B={self.backward}): "
                "W is the weight-gradient part of the full backward, I = B - W"
            )
        for stage, mult in enumerate(self.stage_multipliers):
            _check_duration(f"stage_multipliers[{stage}]", mult)
            if mult == 0:
                raise ValueError(f"cost stage_multipliers[{stage}] must be > 0, got {mult!r}")
        if isinstance(self.moe_layers, bool) or not isinstance(self.moe_layers, int):
            raise ValueError(f"moe_layers must be an integer, got {self.moe_layers!r}")
        if self.moe_layers < 0:
            raise ValueError(f"moe_layers must be >= 0, got {self.moe_layers}")
        _check_duration("attention_share", self.attention_share)
        if self.attention_share > 1:
            raise ValueError(f"attention_share must lie in [0, 1], got {self.attention_share!r}")

    @property
    def input_grad(self) -> float:
        """I = B - W: the input-gradient backward of one stage."""
        return self.backward - self.weight

    @property
    def has_comm(self) -> bool:
        """Whether any all-to-all takes time."""
        return self.moe_layers > 0 and (self.dispatch > 0 or self.combine > 0)

    def check_stages(self, num_stages: int) -> None:
        """Raise if per-stage multipliers are given but do not cover ``num_stages`` stages."""
        if self.stage_multipliers and len(self.stage_multipliers) != num_stages:
            raise ValueError(
                f"{len(self.stage_multipliers)} stage multipliers given for a schedule of "
                f"{num_stages} stages; give one per stage or none"
            )

    def multiplier(self, stage: int) -> float:
        return self.stage_multipliers[stage] if self.stage_multipliers else 1.0

    def compute(self, kind: Kind, stage: int) -> float:
        """The compute time of a plain F, B, I or W action of ``stage``."""
        base = {
            Kind.F: self.forward,
            Kind.B: self.backward,
            Kind.I: self.input_grad,
            Kind.W: self.weight,
        }.get(kind)
        if base is None:
            raise ValueError(f"no compute cost for a {kind.value} action")
        return base * self.multiplier(stage)

    @classmethod
    def from_text(cls, text: str, **fields) -> Costs:
        """Parse ``"F,B,W"`` or ``"F,B,W,A2A"`` (A2A: every dispatch and combine duration)."""
        parts = [p.strip() for p in text.split(",")]
        if len(parts) not in (3, 4):
            raise ValueError(f"costs must be F,B,W or F,B,W,A2A (numbers), got {text!r}")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            raise ValueError(f"costs must be F,B,W or F,B,W,A2A (numbers), got {text!r}") from None
        forward, backward, weight = values[:3]
        if len(values) == 4:
            fields.setdefault("dispatch", values[3])
            fields.setdefault("combine", values[3])
        return cls(forward=forward, backward=backward, weight=weight, **fields)

    def describe(self) -> str:
        """A one-line summary, e.g. for a picture's title."""
        text = f"F={self.forward:g} B={self.backward:g} W={self.weight:g}"
        if self.has_comm:
            text += (
                f" dispatch={self.dispatch:g} combine={self.combine:g}"
                f" x{self.moe_layers} MoE layers"
            )
        else:
            text += " (free all-to-all)"
        if self.p2p_latency:
            text += f" p2p={self.p2p_latency:g}"
        return text
