"""Deferred weight gradients: same bits as computing them at once."""

import pytest
import torch

from megapipe.moe.grouped_gemm import grouped_matmul
from megapipe.overlap.plan import LayerState
from megapipe.overlap.wgrad import WeightGradQueue


@pytest.mark.parametrize("counts", [[3, 0, 4], [0, 0, 7], [2, 2, 3]])
def test_deferred_weight_grads_are_bitwise_immediate(counts):
    torch.manual_seed(0)
    w = torch.randn(3, 5, 4)
    x = torch.randn(7, 5)
    g = torch.randn(7, 4)
    results = []
    for defer in (False, True):
        weight = torch.nn.Parameter(w.clone())
        weight.grad = torch.full_like(w, 0.5)  # accumulation onto an existing grad
        xi = x.clone().requires_grad_(True)
        queue = WeightGradQueue()
        source = LayerState(wgrad_queue=queue if defer else None)
        for _ in range(2):
            out = grouped_matmul(xi, counts, weight, source)
            out.backward(g)
        if defer:
            assert len(queue) == 2 and torch.equal(weight.grad, torch.full_like(w, 0.5))
            assert queue.run() == 2 and len(queue) == 0
        results.append((out.detach(), xi.grad, weight.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    # and the values are those of the per-group matmuls
    ref = torch.cat([c @ w[i] for i, c in enumerate(torch.split(x, counts))])
    assert torch.equal(results[0][0], ref)


def test_no_source_computes_at_once():
    weight = torch.nn.Parameter(torch.randn(2, 3, 3))
    grouped_matmul(torch.randn(4, 3), [1, 3], weight).sum().backward()
    assert weight.grad is not None


def test_bad_counts_are_named():
    w = torch.randn(2, 3, 3)
    with pytest.raises(ValueError, match="one count per group, got 3"):
        grouped_matmul(torch.randn(4, 3), [1, 1, 2], w)
    with pytest.raises(ValueError, match="counts sum to 3 but x has 4 rows"):
        grouped_matmul(torch.randn(4, 3), [1, 2], w)


def test_deferral_needs_a_leaf_weight():
    base = torch.nn.Parameter(torch.randn(2, 3, 3))
    source = LayerState(wgrad_queue=WeightGradQueue())
    out = grouped_matmul(torch.randn(4, 3), [2, 2], base * 2, source)
    with pytest.raises(RuntimeError, match="only for a leaf weight"):
        out.sum().backward()
