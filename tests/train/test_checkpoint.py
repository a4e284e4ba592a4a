import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megapipe.train.checkpoint import (
    CheckpointError,
    CheckpointLayout,
    check_layout,
    latest_iteration,
    load_checkpoint,
    save_checkpoint,
)
from megapipe.train.optim import build_optimizer

LAYOUT = CheckpointLayout(pp=2, vpp=1, ep=2, dp=2, num_layers=2, hidden_size=4, num_experts=2,
                          ffn_hidden_size=8, moe_ffn_hidden_size=4)


class _Stage(nn.Module):
    def __init__(self, pp_rank: int, ep_rank: int) -> None:
        super().__init__()
        self.dense = nn.Linear(4, 4)
        self.expert = nn.Parameter(torch.full((4, 4), float(10 * pp_rank + ep_rank)))
        self.expert.expert_parallel = True

    def forward(self, x):
        # dense grads must not depend on the (per-EP-rank) expert: no DP all-reduce here
        return self.dense(x).square().sum() + (self.expert * x.sum()).square().sum()


def _coords():
    rank = dist.get_rank()
    pp_rank, dp_rank = divmod(rank, 2)
    return pp_rank, dp_rank % 2


def _train(stage, opt, steps):
    for _ in range(steps):
        opt.zero_grad()
        stage(torch.ones(2, 4) + torch.rand(2, 4)).backward()
        opt.step()


def _save_then_resume(directory: str):
    pp_rank, ep_rank = _coords()
    torch.manual_seed(7)  # the same everywhere, so dense params agree over DP
    stage = _Stage(pp_rank, ep_rank)
    opt = build_optimizer([stage], lr=1e-2, weight_decay=0.1)
    _train(stage, opt, 2)
    save_checkpoint(directory, 2, {pp_rank: stage}, opt, {"data": {"consumed_samples": 64}},
                    LAYOUT, ep_rank)
    random.random()
    _train(stage, opt, 2)
    expected = [p.detach().clone() for p in stage.parameters()]

    torch.manual_seed(99)
    fresh = _Stage(pp_rank, ep_rank)
    fresh_opt = build_optimizer([fresh], lr=1e-2, weight_decay=0.1)
    iteration, extra = load_checkpoint(directory, {pp_rank: fresh}, fresh_opt,
                                       {"data": {"consumed_samples": 0}}, LAYOUT, ep_rank)
    _train(fresh, fresh_opt, 2)
    same = all(torch.equal(a, b) for a, b in zip(expected, fresh.parameters()))
    return iteration, extra["data"]["consumed_samples"], same


def test_save_load_resumes_bitwise_with_expert_shards(rank_pools, tmp_path):
    results = rank_pools(4).run(_save_then_resume, str(tmp_path))
    assert results == [(2, 64, True)] * 4
    assert latest_iteration(tmp_path) == 2
    assert check_layout(tmp_path, LAYOUT) == 2


def test_other_layout_is_refused_naming_both(tmp_path):
    (tmp_path / "iter_0000003").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3\n")
    import json
    from dataclasses import asdict
    (tmp_path / "iter_0000003" / "megapipe_layout.json").write_text(
        json.dumps({"iteration": 3, "layout": asdict(LAYOUT)})
    )
    other = CheckpointLayout(pp=4, vpp=1, ep=2, dp=1, num_layers=2, hidden_size=4, num_experts=2,
                             ffn_hidden_size=8, moe_ffn_hidden_size=4)
    with pytest.raises(CheckpointError, match=r"saved with layout \[pp=2 .*this run has \[pp=4"):
        check_layout(tmp_path, other)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        check_layout(tmp_path / "nothing", LAYOUT)
