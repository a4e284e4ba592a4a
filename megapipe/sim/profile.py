"""A node-time profile: how long each node of a MoE layer takes, forward and backward.

The replay benchmark (``benchmarks/overlap.py --replay``) makes every node of the real engine
last its profile time, and the simulator (``programs``) predicts the same run from the same
times. Format (a JSON object; milliseconds per MoE layer; other top-level keys are ignored)::

    {"compute": {"attn_F": 4.1, "attn_B": 9.5, "attn_W": 2.4,
                 "mlp_F": 4.6, "mlp_B": 5.3, "mlp_W": 6.4},
     "comm": {"dispatch_F": 6.7, "dispatch_B": 7.5, "combine_F": 8.7, "combine_B": 5.8},
     "embedding": {"F": 0.5, "B": 0.5}, "head": {"F": 1, "B": 2}, "dense_layer": {"F": 3, "B": 6}}

``attn`` is the attention (and router) node, ``mlp`` the experts node; ``_W`` is the weight
gradient, which runs where the schedule runs weight gradients (deferred, or inside B: attention's
always inside B, as the engine defers only the experts' GEMMs). ``embedding``, ``head`` and
``dense_layer`` are optional (0 when absent). A layer split into k waves gives each wave 1/k
of the dispatch, experts and combine times. Nodes the profile does not name (a MoE layer's
``finish``) take no time beyond their real work.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..pairing.timing import NodeTimes

COMPUTE_KEYS = ("attn_F", "attn_B", "attn_W", "mlp_F", "mlp_B", "mlp_W")
COMM_KEYS = ("dispatch_F", "dispatch_B", "combine_F", "combine_B")
OPTIONAL = ("embedding", "head", "dense_layer")
# a MoE layer's nodes in the engine's order; the three middle ones are split by waves
MOE_ROLES = ("attn", "dispatch", "mlp", "combine", "finish")
WAVE_ROLES = ("dispatch", "mlp", "combine")
WGRAD_ITEMS = 3  # the weight-gradient GEMMs an experts node defers (gate, up, down)


def _number(where: str, value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"profile {where} must be a finite number of ms >= 0, got {value!r}")
    return float(value)


def _section(data: Mapping[str, Any], name: str, keys: tuple[str, ...]) -> dict[str, float]:
    section = data.get(name)
    if not isinstance(section, Mapping):
        raise ValueError(f"profile needs a {name!r} object with {', '.join(keys)}")
    missing = [k for k in keys if k not in section]
    if missing:
        raise ValueError(f"profile {name!r} lacks {', '.join(missing)}")
    return {k: _number(f"{name}.{k}", section[k]) for k in keys}


@dataclass(frozen=True)
class NodeProfile:
    """Node times in ms: ``times[(role, direction)]``, role one of ``attn``, ``dispatch``,
    ``mlp``, ``combine``, ``embedding``, ``head``, ``dense_layer``; direction F, B or W."""

    times: Mapping[tuple[str, str], float] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NodeProfile:
        """Read the JSON object of the module docstring (one clear line per bad value)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a profile is a JSON object, got {type(data).__name__}")
        times: dict[tuple[str, str], float] = {}
        for section, keys in (("compute", COMPUTE_KEYS), ("comm", COMM_KEYS)):
            for key, value in _section(data, section, keys).items():
                role, direction = key.split("_")
                times[(role, direction)] = value
        for role in OPTIONAL:
            if role in data:
                for direction, value in _section(data, role, ("F", "B")).items():
                    times[(role, direction)] = value
        return cls(times)

    @classmethod
    def load(cls, path: str | Path) -> NodeProfile:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"profile {path}: not JSON ({error})") from None
        return cls.from_dict(data)

    def scaled(self, factor: float) -> NodeProfile:
        """Every time multiplied by ``factor``."""
        _number("time scale", factor)
        return NodeProfile({key: value * factor for key, value in self.times.items()})

    def time(self, role: str, direction: str, waves: int = 1) -> float:
        """ms of one node of ``role`` in ``direction`` (a wave's share in a k-wave layer)."""
        value = self.times.get((role, direction), 0.0)
        return value / waves if role in WAVE_ROLES else value

    def node_times(self, role: str, waves: int = 1) -> NodeTimes:
        """A node's times for the pair order's time rule: attention's W inside its backward
        (the engine never defers it), the experts' W as ``WGRAD_ITEMS`` deferrable items."""
        forward, backward = self.time(role, "F", waves), self.time(role, "B", waves)
        weight = self.time(role, "W", waves)
        if role == "mlp":
            return NodeTimes(forward, backward, (weight / WGRAD_ITEMS,) * WGRAD_ITEMS)
        return NodeTimes(forward, backward + weight)

    def layer_time(self, direction: str) -> float:
        """ms of one MoE layer's nodes in ``direction``, one after the other."""
        return sum(self.time(role, direction) for role in MOE_ROLES)


def role_of(node_name: str) -> str:
    """The profile role of an engine node name (``layer3.experts1`` -> ``mlp``, ``layer0`` (a
    dense layer) -> ``dense_layer``, ``embedding``, ``head``; anything else: its last part)."""
    last = node_name.rsplit(".", 1)[-1].rstrip("0123456789")
    if "." not in node_name and last == "layer":
        return "dense_layer"
    return {"attention": "attn", "experts": "mlp"}.get(last, last)
