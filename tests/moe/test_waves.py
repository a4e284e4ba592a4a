"""MoE layers in waves: the all-to-alls in expert groups give bitwise the one-wave results."""

import pytest
import torch
import torch.distributed as dist

from megapipe.moe import MoEConfig, MoELayer
from megapipe.moe.waves import WaveDispatch, expert_groups
from megapipe.overlap.plan import Fork, run_nodes

# widths that are multiples of 16 floats: every expert's rows start 64-byte aligned in any
# grouping, so the CPU GEMMs pick the same kernels (tiny odd widths would not: see
# docs/combined-step.md, "Lone actions in waves")
BASE = dict(hidden_size=16, num_experts=4, top_k=2, ffn_hidden_size=32, init_std=0.5,
            aux_loss_coeff=0.01, z_loss_coeff=0.001)
VARIANTS = [{}, dict(capacity_factor=0.6), dict(shared_expert_intermediate_size=16)]


def _forward_backward(layer: MoELayer, waves: int, x: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    plan = layer.node_plan() if waves == 1 else layer.node_plan().in_waves(waves)
    y = run_nodes(plan, (x,))[0]
    (y * torch.arange(y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("extra", VARIANTS, ids=["dropless", "capacity", "shared"])
@pytest.mark.parametrize("waves", [2, 3, 4])
def test_chunked_layer_is_bitwise_the_unchunked_one(extra, waves):
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    reference = _forward_backward(MoELayer(MoEConfig(**BASE, **extra), seed=3), 1, x)
    layer = MoELayer(MoEConfig(**BASE, **extra), seed=3)
    plan = layer.node_plan().in_waves(waves)
    forks = [item for item in plan if isinstance(item, Fork)]
    assert len(forks) == 1 and len(forks[0].branches) == waves
    got = _forward_backward(layer, waves, x)
    assert all(torch.equal(a, b) for a, b in zip(reference, got))


def test_expert_groups_are_contiguous_and_bounded():
    assert expert_groups(4, 2) == [(0, 2), (2, 2)]
    assert expert_groups(5, 3) == [(0, 2), (2, 2), (4, 1)]
    with pytest.raises(ValueError, match="moe_a2a_waves=3 must be between 1 and the 2 experts"):
        expert_groups(2, 3)


def check_chunked_on_two_ranks() -> int:
    """EP = 2, two experts per rank: every variant, waved in 2, equals the one-wave layer."""
    rank = dist.get_rank()
    checks = 0
    for extra in VARIANTS:
        x = torch.randn(3, 6, 16, generator=torch.Generator().manual_seed(10 + rank))

        def build(extra=extra):
            return MoELayer(MoEConfig(**BASE, **extra), ep_group=dist.group.WORLD, seed=3)

        reference = _forward_backward(build(), 1, x)
        got = _forward_backward(build(), 2, x)
        assert all(torch.equal(a, b) for a, b in zip(reference, got)), extra
        checks += 1
    return checks


def test_chunked_layer_is_bitwise_the_unchunked_one_over_ep2(rank_pools):
    assert rank_pools(2).run(check_chunked_on_two_ranks) == [len(VARIANTS)] * 2


def test_relabel_gives_each_expert_its_group_major_label():
    """Expert e = r * local + l of group g (first_g, size_g) gets ep * first_g + r * size_g +
    (l - first_g), computed on the device (no table a CUDA graph would read)."""
    from types import SimpleNamespace

    for ep, local in ((1, 5), (2, 4), (3, 7)):
        for waves in range(1, local + 1):
            by_wave = WaveDispatch(SimpleNamespace(ep_size=ep, num_local_experts=local), waves)
            want = [0] * (ep * local)
            for first, size in expert_groups(local, waves):
                for r in range(ep):
                    for offset in range(size):
                        want[r * local + first + offset] = ep * first + r * size + offset
            assert by_wave.relabel(torch.arange(ep * local)).tolist() == want
