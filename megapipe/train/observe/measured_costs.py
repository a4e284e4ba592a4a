"""What the nodes of a profiled run cost on average, and the simulator's cost model made of it.

The spans are those of ``run_trace.Span``: every node, compute action and pipeline wait of every
traced rank and step, each node already given its stage. From them:

- ``node_times``: per direction (F, B, W) and node (``attention``, ``dispatch``, ..., the layer
  prefix dropped), how often it ran and its mean and total milliseconds;
- ``measured_costs``: a ``megapipe.sim.Costs`` in milliseconds for the schedule that ran. Each
  stage's forward is the mean compute of one microbatch's forward on it (its compute nodes; an
  action without nodes, as in a plain schedule, counts whole, less its pipeline waits), its
  backward likewise (B and deferred W nodes, plus a separate W action's time); the stages differ
  by ``stage_multipliers``. ``dispatch`` and ``combine`` are the mean all-to-all time of one
  layer (all waves together), ``moe_layers`` the most common count of MoE layers per forward,
  ``attention_share`` the forward compute before the dispatch (attention nodes) over all
  forward compute. The model is coarser than the run (uniform layers, no p2p latency), which is
  why the trace shows both: where they differ, the run lost time the model does not know of.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from statistics import mean

from megapipe.sim.costs import Costs

MS = 1e3


def short_node(node: str) -> str:
    """``layer3.dispatch1`` -> ``dispatch1``; ``embedding`` stays."""
    return node.rsplit(".", 1)[-1]


def node_times(spans: Iterable) -> list[dict]:
    """Per (direction, node, kind): count, mean and total milliseconds, in a stable order."""
    groups: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for span in spans:
        if span.kind in ("compute", "comm"):
            groups[(span.direction, short_node(span.node), span.kind)].append(span.end - span.start)
    return [
        {
            "direction": d,
            "node": n,
            "kind": k,
            "count": len(v),
            "mean_ms": mean(v) * MS,
            "total_ms": sum(v) * MS,
        }
        for (d, n, k), v in sorted(groups.items())
    ]


def _per_step(spans: Sequence) -> dict[tuple, dict[str, float]]:
    """Per (rank, step, stage, microbatch, half F/B): compute seconds and their attention part."""
    out: dict[tuple, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for span in spans:
        if span.kind != "compute" or span.stage is None:
            continue
        half = "F" if span.direction == "F" else "B"
        key = (span.rank, span.step, span.stage, span.microbatch, half)
        out[key]["compute"] += span.end - span.start
        if short_node(span.node) in ("attention", "route"):
            out[key]["attention"] += span.end - span.start
    return out


def _plain_actions(spans: Sequence) -> dict[tuple, float]:
    """Actions without nodes inside (plain schedules, W actions): seconds less their waits."""
    from megapipe.schedule.actions import parse_action

    waits: dict[tuple, float] = defaultdict(float)
    for span in spans:
        if span.kind == "wait":
            waits[(span.rank, span.step, span.stage, span.microbatch, span.direction)] += (
                span.end - span.start
            )
    out: dict[tuple, float] = {}
    for span in spans:
        if span.kind != "action" or span.has_nodes:
            continue
        action = parse_action(span.node)
        half = "W" if span.direction == "W" else "F" if span.direction == "F" else "B"
        key = (span.rank, span.step, action.stage, action.microbatch, half)
        out[key] = (span.end - span.start) - waits.get(key, 0.0)
    return out


def _comm_per_layer(spans: Sequence, name: str) -> float:
    """Mean seconds of one layer's ``name`` all-to-all (its waves summed)."""
    groups: dict[tuple, float] = defaultdict(float)
    for span in spans:
        if span.kind == "comm" and short_node(span.node).startswith(name):
            key = (span.rank, span.step, span.stage, span.microbatch, span.direction, span.layer)
            groups[key] += span.end - span.start
    return mean(groups.values()) if groups else 0.0


def _moe_layers(spans: Sequence) -> int:
    """The most common number of layers with a dispatch in one forward of one stage."""
    layers: dict[tuple, set[int]] = defaultdict(set)
    for span in spans:
        if span.kind == "comm" and span.direction == "F":
            layers[(span.rank, span.step, span.stage, span.microbatch)].add(span.layer)
    if not layers:
        return 0
    return Counter(len(v) for v in layers.values()).most_common(1)[0][0]


def measured_costs(spans: Sequence, num_stages: int) -> Costs:
    """The simulator's cost model of the measured spans, in milliseconds (module docstring)."""
    steps = _per_step(spans)
    plain = _plain_actions(spans)
    forward: dict[int, list[float]] = defaultdict(list)
    backward: dict[int, list[float]] = defaultdict(list)
    weight: dict[int, list[float]] = defaultdict(list)
    for key, seconds in plain.items():
        {"F": forward, "B": backward, "W": weight}[key[4]][key[2]].append(seconds)
    attention = total_forward = 0.0
    for key, parts in steps.items():
        (forward if key[4] == "F" else backward)[key[2]].append(parts["compute"])
        if key[4] == "F":
            attention += parts["attention"]
            total_forward += parts["compute"]
    stage_f = [mean(forward[s]) if forward[s] else 0.0 for s in range(num_stages)]
    stage_w = [mean(weight[s]) if weight[s] else 0.0 for s in range(num_stages)]
    stage_b = [(mean(backward[s]) if backward[s] else 0.0) + stage_w[s] for s in range(num_stages)]
    per_stage = [f + b for f, b in zip(stage_f, stage_b)]
    average = mean(per_stage) if per_stage else 0.0
    multipliers = tuple(p / average if p > 0 and average > 0 else 1.0 for p in per_stage)
    return Costs(
        forward=mean(stage_f) * MS,
        backward=mean(stage_b) * MS,
        weight=min(mean(stage_w), mean(stage_b)) * MS,
        stage_multipliers=multipliers,
        dispatch=_comm_per_layer(spans, "dispatch") * MS,
        combine=_comm_per_layer(spans, "combine") * MS,
        moe_layers=_moe_layers(spans),
        attention_share=attention / total_forward if total_forward > 0 else 0.5,
    )
