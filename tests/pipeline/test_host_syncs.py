"""No host sync in the hot path apart from the one documented read (docs/precision.md and
``moe/dispatcher.py``): the split sizes of a dropless MoE layer's all-to-all, read once per MoE
layer forward inside the dispatch comm node by ``HostCounts.wait``; none at all with capacity
padding. Counted on CPU by ``support.host_syncs.HostSyncs`` (item, tolist, cpu, nonzero,
bincount, boolean indexing, ...), per node and on both streams' threads."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megapipe.models.gpt import gpt_loss
from megapipe.models.split import build_stage
from megapipe.overlap import combined_step, make_streams, record_forward
from megapipe.train.optim.mixed_precision import cast_to_bf16
from support.combined_cases import host_sync_run
from support.host_syncs import HostSyncs, the_one_point
from support.pipeline_cases import CONFIG, Case, microbatch


@pytest.mark.parametrize("capacity", [None, 1.0], ids=["dropless", "capacity"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_combined_step_syncs_only_at_the_one_point(capacity, bf16):
    stage = build_stage(dataclasses.replace(CONFIG, moe_capacity_factor=capacity), 0, 1)
    if bf16:
        cast_to_bf16([stage], list(stage.parameters()))
    (tokens_i, _), (tokens_j, labels_j) = microbatch(0, 0, 0), microbatch(0, 1, 0)
    outs_j, tape_j = record_forward(stage.layer_plans(), (tokens_j,))
    grads_j = torch.autograd.grad(gpt_loss(outs_j[0], labels_j), outs_j[0])
    with make_streams("cpu") as streams, HostSyncs() as syncs:
        combined_step(stage.layer_plans(), (tokens_i,), tape_j, grads_j, streams,
                      delay_wgrad_compute=True)
    assert syncs.outside(the_one_point) == []
    expected = 0 if capacity else len(stage.moe_layers())  # one per MoE layer forward
    assert len(syncs.events) == expected, syncs.events
    assert {e.thread for e in syncs.events} <= {"megapipe-comm"}


@pytest.mark.parametrize("case", [
    Case("1f1b", 1, ep=2, dp=2, overlap=True),
    Case("interleaved-1f1b", 2, vpp=2, ep=2, dp=2, overlap=True, bf16=True),
], ids=str)
def test_executor_step_syncs_only_at_the_one_point(rank_pools, case):
    """A whole combined training step with EP = 2 (count exchange, p2p, gradient reduction)."""
    for result in [r for r in rank_pools(4).run(host_sync_run, case) if r is not None]:
        assert [e for e in result["events"] if not the_one_point(e)] == []
        assert len(result["events"]) == result["moe_forwards"] > 0
