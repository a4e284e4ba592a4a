"""``host_cost.py --launches``'s line ``launches per MoE layer outside CUDA graphs``: the
combined step of one MoE layer with a rank capacity and the layer graphed whole, counted on the
live code with the CPU graph stand-in (each replay one launch; deterministic)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from launch_count import demo_layer, moe_layer_launches  # noqa: E402
from outside_graphs import GRAPH_REPLAY, PARTIAL_LAYER, RANK_CAPACITY, launches_outside_graphs  # noqa: E402


def test_the_layer_graphed_whole_leaves_its_replays_and_the_layer_boundary():
    outside, counter = launches_outside_graphs()
    launches = {label: dict(ops) for label, ops in counter.launches.items()}
    # attention, experts and finish replay once each way; between them nothing: each reads
    # the static outputs of the one before in place and writes its input gradients into that
    # one's static gradient buffers inside its backward graph; the parameters' gradients are
    # added into main_grad inside the backward graphs (no accumulation outside them)
    assert sum(ops.get(GRAPH_REPLAY, 0) for ops in launches.values()) == 6
    assert {label: ops for label, ops in launches.items() if set(ops) != {GRAPH_REPLAY}} == {
        "attention F": {GRAPH_REPLAY: 1, "copy_": 1, "clone": 1},  # the layer input; the log
        "finish B": {GRAPH_REPLAY: 1, "copy_": 1},  # the gradient from the next layer
        "engine B": {"copy_": 1},  # the layer input's gradient into its leaf's .grad
    }
    assert outside == 10 <= 12  # docs/cuda-graphs.md; issue 38: at most 12
    # gradients in .grad (fp32 without main_grad): autograd copies each of the 8 parameters'
    # out of the backward graphs' buffers
    in_grad, counter = launches_outside_graphs(main_grads=False)
    assert in_grad == outside + 8 and counter.total(["engine B"]) == 1 + 8
    partial, _ = launches_outside_graphs(modules=PARTIAL_LAYER)
    assert partial == 70  # the attention node alone graphed


def test_the_sync_free_exchange_leaves_only_its_all_to_alls_in_the_comm_nodes():
    stage = demo_layer(moe_expert_rank_capacity_factor=RANK_CAPACITY)
    counter = moe_layer_launches(stage)["combined"]
    # ep 1: no all-to-all, so nothing at all; its index work runs in route, experts, finish
    assert counter.total(["dispatch F", "dispatch B", "combine F", "combine B"]) == 0
    assert counter.total() == 111  # as many as before they moved out of the comm nodes
    assert "_local_scalar_dense" not in {op for ops in counter.launches.values() for op in ops}
