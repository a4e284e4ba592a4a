"""``host_cost.py --launches``'s line ``launches per MoE layer outside CUDA graphs``: the
combined step of one MoE layer with a rank capacity and the layer graphed whole, counted on the
live code with the CPU graph stand-in (each replay one launch; deterministic)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from launch_count import demo_layer, moe_layer_launches  # noqa: E402
from outside_graphs import GRAPH_REPLAY, PARTIAL_LAYER, RANK_CAPACITY, launches_outside_graphs  # noqa: E402


def test_the_layer_graphed_whole_leaves_replays_copies_and_gradient_accumulation():
    outside, counter = launches_outside_graphs()
    ops = {op for launches in counter.launches.values() for op in launches}
    # attention, experts and finish replay once each way; at ep 1 the all-to-all nodes issue
    # nothing; what is left: copies into static buffers (inputs, state tensors, output
    # gradients), the aux-loss log's copy, the parameters' gradients handed to autograd
    assert sum(launches[GRAPH_REPLAY] for launches in counter.launches.values()) == 6
    assert ops == {GRAPH_REPLAY, "copy_", "clone"}
    assert counter.total(["engine B"]) == 13  # one per parameter: autograd's accumulation
    assert outside == 34  # docs/combined-step.md
    partial, _ = launches_outside_graphs(modules=PARTIAL_LAYER)
    assert partial == 72  # the attention node alone graphed


def test_the_sync_free_exchange_leaves_only_its_all_to_alls_in_the_comm_nodes():
    stage = demo_layer(moe_expert_rank_capacity_factor=RANK_CAPACITY)
    counter = moe_layer_launches(stage)["combined"]
    # ep 1: no all-to-all, so nothing at all; its index work runs in route, experts, finish
    assert counter.total(["dispatch F", "dispatch B", "combine F", "combine B"]) == 0
    assert counter.total() == 111  # as many as before they moved out of the comm nodes
    assert "_local_scalar_dense" not in {op for ops in counter.launches.values() for op in ops}
