import copy
import math

import pytest
import torch
from torch import nn

from megapipe.parallel.config import ParallelConfig
from megapipe.parallel.groups import create_groups
from megapipe.train.optim.adamw import (
    LRSchedule,
    build_optimizer,
    clip_grads,
    global_grad_norm,
    unique_params,
)


def _grads(pp_rank: int, ep_rank: int | None) -> nn.Parameter:
    """A parameter with a gradient that depends only on its place in the model."""
    gen = torch.Generator().manual_seed(100 * pp_rank + (0 if ep_rank is None else 1 + ep_rank))
    p = nn.Parameter(torch.zeros(3, 5))
    p.grad = torch.randn(3, 5, generator=gen)
    if ep_rank is not None:
        p.expert_parallel = True
    return p


def _reference_norm(pp: int, ep: int) -> float:
    total = 0.0
    for s in range(pp):
        total += _grads(s, None).grad.double().pow(2).sum().item()
        for e in range(ep):
            total += _grads(s, e).grad.double().pow(2).sum().item()
    return math.sqrt(total)


def _norm_on_rank(pp: int, dp: int, ep: int):
    groups = create_groups(ParallelConfig(pp=pp, dp=dp, ep=ep))
    params = [_grads(groups.pp_rank, None), _grads(groups.pp_rank, groups.ep_rank)]
    norm = global_grad_norm(params, groups.pp, groups.ep)
    clip_grads(params, max_norm=1.0, total_norm=norm)
    after = global_grad_norm(params, groups.pp, groups.ep)
    return norm, after


@pytest.mark.parametrize("pp,dp,ep", [(2, 2, 2), (1, 4, 2), (4, 1, 1), (2, 2, 1)])
def test_global_grad_norm_counts_each_parameter_once(rank_pools, pp, dp, ep):
    results = rank_pools(4).run(_norm_on_rank, pp, dp, ep)
    expected = _reference_norm(pp, ep)
    for norm, after in results:
        assert norm == pytest.approx(expected, rel=1e-12)
        assert after == pytest.approx(1.0, rel=1e-5)
    assert len({r[0] for r in results}) == 1  # every rank clips by the same norm


def test_clip_leaves_small_gradients_alone():
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([0.3, 0.4])
    assert clip_grads([p], max_norm=1.0, total_norm=0.5) == 1.0
    assert torch.equal(p.grad, torch.tensor([0.3, 0.4]))
    assert clip_grads([p], max_norm=0.0, total_norm=100.0) == 1.0


def test_lr_schedule_warmup_then_cosine_and_linear():
    cos = LRSchedule(lr=1.0, min_lr=0.1, warmup_iters=4, decay_iters=10, style="cosine")
    assert [cos.lr_at(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cos.lr_at(4) == pytest.approx(1.0)
    assert cos.lr_at(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cos.lr_at(14) == pytest.approx(0.1)
    assert cos.lr_at(100) == pytest.approx(0.1)
    lin = LRSchedule(lr=1.0, min_lr=0.0, warmup_iters=0, decay_iters=4, style="linear")
    assert [lin.lr_at(i) for i in range(6)] == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    const = LRSchedule(lr=0.5, min_lr=0.0, warmup_iters=2, decay_iters=4, style="constant")
    assert [const.lr_at(i) for i in range(4)] == [0.25, 0.5, 0.5, 0.5]
    with pytest.raises(ValueError, match="style 'step'"):
        LRSchedule(lr=1.0, min_lr=0.0, warmup_iters=0, decay_iters=1, style="step")


def test_lr_schedule_sets_optimizer_and_resumes():
    model = nn.Linear(3, 3)
    opt = build_optimizer([model], lr=1.0, weight_decay=0.1)
    sched = LRSchedule(lr=1.0, min_lr=0.0, warmup_iters=2, decay_iters=2, style="linear")
    assert [sched.step(opt) for _ in range(4)] == [0.5, 1.0, 1.0, 0.5]
    assert all(g["lr"] == 0.5 for g in opt.param_groups)
    again = LRSchedule(lr=1.0, min_lr=0.0, warmup_iters=2, decay_iters=2, style="linear")
    again.load_state_dict(sched.state_dict())
    assert again.step(opt) == sched.step(opt) == 0.0


def test_optimizer_skips_weight_decay_on_vectors_and_counts_shared_params_once():
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    b.weight = a.weight
    assert len(unique_params([a, b])) == 3
    opt = build_optimizer([a, b], lr=1e-3, weight_decay=0.1)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and [p.ndim for p in decay["params"]] == [2]
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 2


def _bf16_model(seed: int) -> nn.Module:
    from megapipe.train.optim.mixed_precision import cast_to_bf16

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    cast_to_bf16([model], unique_params([model]))
    return model


def _step(model, optimizer, seed: int) -> None:
    optimizer.zero_grad()
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(seed)).bfloat16()
    for half in x.chunk(2):  # two microbatches accumulate in fp32 main_grad
        model(half).float().square().mean().backward()
    optimizer.step()


def test_mixed_precision_adamw_keeps_fp32_main_weights_and_resumes_bitwise():
    model = _bf16_model(0)
    optimizer = build_optimizer([model], lr=1e-2, weight_decay=0.1, mixed_precision=True)
    _step(model, optimizer, 1)
    for p in model.parameters():
        state = optimizer.state[p]
        assert state["main_param"] is optimizer.main_param(p) and p.grad is None
        assert state["main_param"].dtype == state["exp_avg"].dtype == torch.float32
        assert torch.equal(p, state["main_param"].bfloat16())  # bf16 = main rounded
    saved = copy.deepcopy(optimizer.state_dict())  # as if read back from disk
    twin = _bf16_model(7)  # other weights: everything comes from the state dict
    twin_optimizer = build_optimizer([twin], lr=1e-2, weight_decay=0.1, mixed_precision=True)
    twin_optimizer.load_state_dict(saved)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
        assert twin_optimizer.state[q]["main_param"] is twin_optimizer.main_param(q)
    _step(model, optimizer, 2)
    _step(twin, twin_optimizer, 2)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(optimizer.main_param(p), twin_optimizer.main_param(q))


def test_mixed_precision_adamw_needs_bf16_params_with_main_grad():
    with pytest.raises(ValueError, match="needs low-precision parameters with a float32 main_grad"):
        build_optimizer([nn.Linear(2, 2)], lr=1e-3, weight_decay=0.0, mixed_precision=True)
