"""``benchmarks/launch_count.py``: its counting rule on hand-checkable functions, and the launches
of one MoE layer forward + backward on the live code against issue 30's targets (counts are
deterministic: no timing here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from launch_count import LaunchCounter, count_launches, moe_layer_launches  # noqa: E402
from megapipe.kernels import sum_choices_op  # noqa: E402


def test_views_metadata_and_allocations_count_zero():
    x = torch.randn(4, 6)

    def free():
        x.view(6, 4)
        x.t()
        x[1:3]
        x.detach()
        x.unsqueeze(0).expand(2, 4, 6)
        x.split(2)
        torch.empty(3)
        x.new_empty((2, 2))
        torch.promote_types(torch.float32, torch.bfloat16)
        x.contiguous()  # already contiguous: no op at all

    launches, counter = count_launches(free)
    assert launches == 0, counter.launches
    assert sum(counter.free["engine"].values()) >= 8


def test_kernels_count_one_each():
    a, b = torch.randn(4, 5), torch.randn(5, 3)

    def work():
        a @ b  # mm
        torch.zeros(3)  # a constructor that writes
        a.clone()
        a.to(torch.float64)  # a cast
        a.add_(1)  # in place
        a.t().contiguous()  # a copy

    launches, counter = count_launches(work)
    assert launches == 6, counter.launches


def test_a_megapipe_operator_counts_one_whatever_its_reference_runs():
    rows = torch.randn(6, 4)
    choice_rows = torch.tensor([[0, 3], [1, -1], [5, 2]])
    # on CPU the reference runs about a dozen torch ops inside; on CUDA it is one Triton kernel
    launches, counter = count_launches(sum_choices_op, rows, None, choice_rows)
    assert launches == 1 and counter.launches["engine"] == {"sum_choices": 1}


def test_labels_follow_autograd_nodes_into_backward():
    w = torch.randn(3, requires_grad=True)
    counter = LaunchCounter()
    with counter:
        with counter.label("node F"):
            y = (w * 2).sum()
        counter.adopt((y,), "node B")
        y.backward()
    assert counter.launches["node F"] == {"mul": 1, "sum": 1}
    assert counter.total(["node B"]) >= 1  # the backward of mul (sum's expands: a view)


def test_moe_layer_launches_meet_the_targets():
    counters = moe_layer_launches()
    naive, plain, combined = (counters[w].total() for w in ("naive", "plain", "combined"))
    assert combined <= 50, counters["combined"].launches
    assert combined <= 1.1 * plain, (plain, combined)
    assert naive <= plain  # the tape adds work, never removes model ops
    # every fused operator of the route node is one launch, forward and backward
    fused = counters["plain"].launches
    assert fused["attention F"]["router"] == fused["attention F"]["routing_rows"] == 1
    backward = fused["attention B"]
    assert backward["router_backward"] == 1 and backward["rms_norm_backward"] == 2


def test_each_way_of_the_host_time_runs_and_a_wrong_way_is_named():
    """``host_time`` (what ``host_cost.py --launches`` runs in a process per way): every way
    runs the layer's forward and backward; no time is asserted."""
    from launch_count import HOST_WAYS, host_time

    for way in HOST_WAYS:
        assert host_time(way, rounds=1) > 0
    with pytest.raises(ValueError, match="got 'eager'"):
        host_time("eager")
