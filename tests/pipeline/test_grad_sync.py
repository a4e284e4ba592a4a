"""grad_sync's marks: which parameters are experts, and weights tied across first and last stage."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megapipe.pipeline.grad_sync import is_expert_param, sum_tied_embedding_grads
from megapipe.schedule import build_schedule


def test_experts_are_recognised_by_megapipes_and_megatrons_marks():
    dense, ours, megatrons, megatron_dense = (nn.Parameter(torch.zeros(1)) for _ in range(4))
    ours.expert_parallel = True
    megatrons.allreduce = False  # Megatron: an expert sharded over EP
    megatron_dense.allreduce = True
    assert [is_expert_param(p) for p in (dense, ours, megatrons, megatron_dense)] == [
        False, True, True, False,
    ]


def _stage(grad: float, tied: bool = True) -> nn.Module:
    module = nn.Linear(2, 2, bias=False)
    module.weight.grad = torch.full((2, 2), grad)
    module.weight.shared_embedding = tied
    return module


def test_tied_weights_on_one_rank_both_get_the_sum():
    # zbv with pp = 1: the first and the last stage live on the same rank
    schedule = build_schedule("zbv", 1, 2)
    first, last = _stage(1.5), _stage(0.25)
    untouched = nn.Linear(2, 2, bias=False)
    untouched.weight.grad = torch.full((2, 2), 7.0)
    first.extra = untouched  # an untied parameter of the same stage keeps its gradient
    sum_tied_embedding_grads(schedule, 0, {0: first, 1: last}, None, [0])
    assert torch.equal(first.weight.grad, torch.full((2, 2), 1.75))
    assert torch.equal(last.weight.grad, torch.full((2, 2), 1.75))
    assert torch.equal(untouched.weight.grad, torch.full((2, 2), 7.0))


def test_without_tied_weights_nothing_changes_and_two_marks_are_refused():
    schedule = build_schedule("zbv", 1, 2)
    first, last = _stage(1.0, tied=False), _stage(2.0, tied=False)
    sum_tied_embedding_grads(schedule, 0, {0: first, 1: last}, None, [0])
    assert first.weight.grad[0, 0] == 1.0 and last.weight.grad[0, 0] == 2.0
    first.other = _stage(3.0)
    first.weight.shared_embedding = True
    with pytest.raises(ValueError, match="2 parameters marked shared_embedding"):
        sum_tied_embedding_grads(schedule, 0, {0: first, 1: _stage(1.0)}, None, [0])
