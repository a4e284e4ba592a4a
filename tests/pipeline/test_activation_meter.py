"""The activation meter: the peak of saved-tensor bytes is exact on a toy model, counts a
storage once, changes no result, and falls by at least what selective or full recompute stops
saving."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from megapipe.models.config import GPTConfig
from megapipe.models.gpt import gpt_loss
from megapipe.models.split import build_stage
from megapipe.pipeline.activation_meter import ActivationMeter


def test_toy_peak_is_the_sum_of_saved_tensors():
    x = torch.randn(1000, requires_grad=True)
    w = torch.randn(500, requires_grad=True)
    with ActivationMeter() as meter:
        y = torch.sin(x)  # saves x: 4000 bytes
        z = torch.exp(y)  # saves its result z: 4000 bytes
        v = torch.cos(x[:10])  # saves a view of x: same storage, counted once
        u = (w * w).sum()  # saves w (twice, one storage): 2000 bytes
        assert meter.live_bytes == 4000 + 4000 + 2000
        (z.sum() + v.sum() + u).backward()
        del y, z, v, u
    assert meter.peak_bytes == 10000
    assert meter.live_bytes == 0  # every saved tensor released with its graph
    assert meter.cuda_peak_bytes is None


def _step(config: GPTConfig, measure: bool):
    torch.manual_seed(0)
    model = build_stage(config, 0, 1)
    ids = [torch.randint(0, config.vocab_size, (2, config.seq_length)) for _ in range(2)]
    meter = ActivationMeter()
    with meter if measure else contextlib.nullcontext():
        losses = [gpt_loss(model(i), i) for i in ids]  # both microbatches in flight
        sum(losses).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return meter.peak_bytes, [loss.detach() for loss in losses], grads


def test_measuring_changes_no_bit():
    config = GPTConfig()
    _, losses, grads = _step(config, measure=False)
    _, measured_losses, measured_grads = _step(config, measure=True)
    assert all(torch.equal(a, b) for a, b in zip(losses, measured_losses))
    assert all(torch.equal(a, b) for a, b in zip(grads, measured_grads))


def test_selective_recompute_drops_at_least_what_it_no_longer_saves():
    config = GPTConfig()
    full, _, _ = _step(config, measure=True)
    recomputed = GPTConfig(recompute_modules=("core_attn", "moe_act"))
    less, _, _ = _step(recomputed, measure=True)
    b, s, microbatches = 2, config.seq_length, 2
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers))
    # no longer saved per microbatch: the attention core's log-sum-exp [b, heads, s] in every
    # layer (its output stays: the output projection saves it, as a view), and silu(gate)
    # [b * s * top_k, moe_ffn] in every MoE layer (fp32)
    attention = config.num_layers * b * config.num_heads * s * 4
    activation = moe_layers * b * s * config.moe_top_k * config.moe_ffn_hidden_size * 4
    assert full - less >= microbatches * (attention + activation), (full, less)


def _full_recompute_lower_bound(config: GPTConfig, layers: range, b: int) -> int:
    """Bytes per microbatch a layer recomputed whole no longer saves, at least: the q, k, v
    projection [b, s, 3h] (the attention core saves views of it), and the SwiGLU's gate, up and
    activation (dense: [b * s, ffn]; MoE: [b * s * top_k, moe_ffn] dropless), all fp32. Its
    inputs stay saved, and one node's graph lives while that node runs (both counted)."""
    s, total = config.seq_length, 0
    for layer in layers:
        total += b * s * 3 * config.hidden_size * 4
        if config.is_moe_layer(layer):
            total += 3 * b * s * config.moe_top_k * config.moe_ffn_hidden_size * 4
        else:
            total += 3 * b * s * config.ffn_hidden_size * 4
    return total


@pytest.mark.parametrize("method, layers", [("uniform", 1), ("uniform", 2), ("block", 1), ("block", 2)])
def test_full_recompute_drops_at_least_what_it_no_longer_saves(method, layers):
    config = GPTConfig()
    full, _, _ = _step(config, measure=True)
    recomputed = dataclasses.replace(config, recompute_method=method, recompute_num_layers=layers)
    less, _, _ = _step(recomputed, measure=True)
    whole = range(config.num_layers) if method == "uniform" else range(layers)
    microbatches = 2
    assert full - less >= microbatches * _full_recompute_lower_bound(config, whole, 2), (full, less)


def _held_after_forward(config: GPTConfig) -> int:
    """Bytes saved for backward once both microbatches' forwards ran: what the microbatches in
    flight hold (the peak adds one node's graph while it runs)."""
    model = build_stage(config, 0, 1)
    ids = [torch.randint(0, config.vocab_size, (2, config.seq_length),
                         generator=torch.Generator().manual_seed(i)) for i in range(2)]
    with ActivationMeter() as meter:
        losses = [gpt_loss(model(i), i) for i in ids]
        held = meter.live_bytes
        sum(losses).backward()
    return held


def test_uniform_groups_of_two_layers_hold_less_per_microbatch_in_flight():
    config = GPTConfig(recompute_method="uniform")
    one = _held_after_forward(config)
    two = _held_after_forward(dataclasses.replace(config, recompute_num_layers=2))
    b, microbatches = 2, 2
    inside = config.num_layers // 2  # groups (0, 1), (2, 3): the outputs of layers 0 and 2
    assert one - two >= microbatches * inside * b * config.seq_length * config.hidden_size * 4
