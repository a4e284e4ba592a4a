"""``host_cost.py --launches``'s line ``launches per MoE layer outside CUDA graphs``: the
combined step of one MoE layer with a rank capacity, counted on the live code (deterministic)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from launch_count import (  # noqa: E402
    RANK_CAPACITY,
    demo_layer,
    launches_outside_graphs,
    moe_layer_launches,
)


def test_graphable_nodes_count_one_replay_each_way_and_the_rest_every_launch():
    stage = demo_layer(moe_expert_rank_capacity_factor=RANK_CAPACITY)
    outside, graphed = launches_outside_graphs(stage)
    assert graphed == ("attention",)  # attn, moe_router, moe_preprocess: the static node
    counter = moe_layer_launches(stage)["combined"]
    captured = counter.total(["attention F", "attention B"])
    assert captured > 2 and outside == counter.total() - captured + 2
    assert outside == 89 and counter.total(["dispatch F"]) == 55  # docs/performance.md
    # the sync-free dispatch builds its gathers on the device: more launches than dropless's
    # host read, none of them a host sync
    assert counter.total(["dispatch F"]) > moe_layer_launches(demo_layer())["combined"].total(
        ["dispatch F"])
    assert "_local_scalar_dense" not in {op for ops in counter.launches.values() for op in ops}
