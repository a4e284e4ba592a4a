"""I then W (split_backward) gives the gradients of one ordinary backward, for any module."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from megapipe.models.config import GPTConfig
from megapipe.models.gpt import gpt_loss
from megapipe.models.split import build_stage
from megapipe.pipeline.split_backward import input_backward
from megapipe.pipeline.stage_worker import StageWorker


class SharedWeights(nn.Module):
    """A weight used in two places and a module called twice: multi-anchor parameter groups."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.weight = nn.Parameter(torch.randn(8, 8) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(torch.relu(self.linear(x))) @ self.weight
        return self.linear(y) + x @ self.weight


MODULES = {
    "sequential": lambda: nn.Sequential(
        nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.LayerNorm(8)
    ),
    "shared": SharedWeights,
}


@pytest.mark.parametrize("input_needs_grad", [True, False])
@pytest.mark.parametrize("name", sorted(MODULES))
def test_split_equals_full_backward(name, input_needs_grad):
    torch.manual_seed(0)
    module = MODULES[name]()
    reference = copy.deepcopy(module)
    x = torch.randn(4, 8)
    xa = x.clone().requires_grad_(input_needs_grad)
    out = reference(xa)
    grad = torch.randn_like(out)
    out.backward(grad)

    xb = x.clone().requires_grad_(input_needs_grad)
    grad_inputs, deferred = input_backward([module(xb)], [grad], [xb], list(module.parameters()))
    if input_needs_grad:
        assert torch.equal(grad_inputs[0], xa.grad)
    assert all(p.grad is None for p in module.parameters()), "I must not touch weight grads"
    deferred.run()
    for (pname, p), q in zip(module.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), pname


@pytest.mark.parametrize("use_tape", [False, True])
@pytest.mark.parametrize("part", [0, 1])
def test_stage_worker_i_then_w_equals_b(use_tape, part):
    """A GPT stage, plain autograd or tape: I then W leaves the gradients of B (two
    microbatches)."""
    config = GPTConfig(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, seq_length=8)
    inputs = [
        torch.randint(0, 32, (2, 8)) if part == 0 else torch.randn(2, 8, 16) for _ in range(2)
    ]
    grads = [torch.randn(2, 8, 16) for _ in range(2)]
    labels = [torch.randint(0, 32, (2, 8)) for _ in range(2)]
    workers = [StageWorker(part, build_stage(config, part, 2), use_tape=use_tape) for _ in range(2)]
    results = []
    for split, worker in zip((False, True), workers):
        input_grads = []
        for i in range(2):
            output = worker.forward(i, inputs[i])
            if part == 1:
                worker.attach_loss(i, gpt_loss(output, labels[i]) / 2)
        for i in range(2):
            if split:
                input_grads.append(worker.backward_input(i, grads[i] if part == 0 else None))
            else:
                input_grads.append(worker.backward(i, grads[i] if part == 0 else None))
        if split:
            assert worker.live_activations == 2
            for i in range(2):
                worker.backward_weight(i)
        assert worker.live_activations == 0
        results.append((input_grads, {n: p.grad for n, p in worker.module.named_parameters()}))
    (gi_b, g_b), (gi_s, g_s) = results
    for a, b in zip(gi_b, gi_s):
        assert (a is None and b is None) or torch.equal(a, b)
    for name in g_b:
        assert torch.equal(g_b[name], g_s[name]), name
