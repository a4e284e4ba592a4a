"""The activation meter: the peak of saved and held bytes is exact on toy models (saved-tensor
hooks, the executor's stash and data in transit, the tape's node boundaries, deferred weight
gradients), counts a storage once, skips parameters, changes no result (deferred weight
gradients included), and falls by at least what selective or full recompute stops saving."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch import nn

from megapipe.models.config import GPTConfig
from megapipe.models.gpt import gpt_loss
from megapipe.models.split import build_stage
from megapipe.moe.grouped_gemm import grouped_matmul
from megapipe.overlap.plan import LayerState, Node, NodeKind
from megapipe.overlap.sequential import record_forward, run_backward
from megapipe.overlap.wgrad import WeightGradQueue
from megapipe.pipeline.activation_meter import ActivationMeter
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.pipeline.executor_options import ExecutorOptions
from megapipe.precision.main_grad import accumulated_grad, attach_main_grads
from megapipe.schedule import build_schedule
from support.meter_cases import Toy, toy_pipeline_peak


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


def test_parameters_are_not_counted_and_a_held_storage_counts_once_until_freed():
    w = nn.Parameter(torch.randn(500))
    x = torch.randn(1000, requires_grad=True)
    with ActivationMeter(params=[w]) as meter:
        u = (w[:100] * w[:100]).sum()  # saves views of a parameter: not counted
        y = torch.exp(x)  # saves its result y: 4000 bytes
        meter.track([y, y[:10], None, 3])  # held too: the same storage, still 4000
        assert meter.live_bytes == 4000
        y.sum().backward()  # the graph lets go of y; the hold keeps it counted
        assert meter.live_bytes == 4000
        del y
        assert meter.live_bytes == 0  # freed
        u.backward()
    assert meter.peak_bytes == 4000


def test_executor_peak_is_saved_plus_stashed():
    """looped-bfs, pp = 1, two stages on the rank: all four forwards, then the backwards. At
    the peak each microbatch holds: stage 0's input x (saved by sin; the caller's), sin(x)
    (saved), its output (handed to stage 1, stashed for the backward and saved there by sin:
    one storage), stage 1's sin (saved) and output (stashed), the target (saved by the loss's
    mul) and the scaled loss (4 bytes, stashed)."""
    n, m = 1000, 2
    schedule = build_schedule("looped-bfs", 1, m, vpp=2)
    inputs = [torch.randn(n) for _ in range(m)]
    targets = [torch.randn(n) for _ in range(m)]
    options = ExecutorOptions(loss_fn=lambda o, t: (o * t).sum(), measure_activations=True)
    with PipelineExecutor(schedule, {0: Toy(n), 1: Toy(n)}, options) as executor:
        result = executor.step(inputs, targets)
    assert result.activation_bytes == m * (6 * n * 4 + 4)
    assert result.cuda_activation_bytes is None


def test_two_rank_peak_counts_receive_buffers_and_sends(rank_pools):
    """GPipe, pp = 2, 2 microbatches, n floats per tensor (4n bytes). Rank 0 peaks just before
    B0: per microbatch its input (the caller's, saved by sin), sin(x) (saved) and its output
    (sent, and stashed for the backward), plus B0's received gradient buffer: 7 tensors. Rank 1
    peaks after F1: per microbatch the receive buffer (its input, also saved by sin: one
    storage), sin (saved), the output (stashed), the target (saved by the loss) and the 4-byte
    scaled loss."""
    n = 1000
    assert rank_pools(2).run(toy_pipeline_peak, n, 2) == [7 * 4 * n, 2 * (4 * 4 * n + 4)]


def _node(name, fn):
    return Node(name, NodeKind.COMPUTE, lambda state, inputs: (fn(inputs[0]),))


def test_tape_node_boundaries_are_held():
    """exp saves its result; ``+ 1`` and ``* 2`` save nothing, but the tape holds their outputs
    as node boundaries until their backward: three storages of 4000 bytes."""
    x = torch.randn(1000, requires_grad=True)
    layers = [[_node("exp", torch.exp), _node("add", lambda v: v + 1)],
              [_node("double", lambda v: v * 2)]]
    with ActivationMeter() as meter:
        outs, tape = record_forward(layers, (x,), track=meter.track)
        assert meter.live_bytes == 3 * 4000
        run_backward(tape, (torch.ones(1000),))
        del outs, tape
        assert meter.live_bytes == 0
    assert meter.peak_bytes == 3 * 4000


def test_deferred_weight_gradient_keeps_its_inputs_held():
    w = nn.Parameter(torch.randn(2, 4, 3))
    x = torch.randn(6, 4, requires_grad=True)
    g = torch.randn(6, 3)
    with ActivationMeter(params=[w]) as meter:
        queue = WeightGradQueue(track=meter.track)
        out = grouped_matmul(x, [2, 4], w, LayerState(wgrad_queue=queue))
        assert meter.live_bytes == x.nbytes  # saved (the weight is a parameter)
        out.backward(g.clone())  # the clone: only the queue keeps it
        del out
        assert len(queue) == 1 and meter.live_bytes == x.nbytes + g.nbytes  # kept for the W
        queue.run()
        assert meter.live_bytes == x.nbytes  # x is still the caller's; the gradient is freed
    reference = torch.stack([a.detach().T @ b for a, b in zip(x.split([2, 4]), g.split([2, 4]))])
    assert torch.equal(w.grad, reference)


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


def _tape_step(measure: bool, defer: bool, main_grad: bool):
    """One microbatch on the tape, the experts' weight gradients deferred into a queue or not,
    accumulating in ``.grad`` or in ``main_grad``: the gradients."""
    torch.manual_seed(0)
    config = GPTConfig()
    model = build_stage(config, 0, 1)
    if main_grad:
        attach_main_grads(model.parameters())
    ids = torch.randint(0, config.vocab_size, (2, config.seq_length))
    meter = ActivationMeter(params=model.parameters())
    with meter if measure else contextlib.nullcontext():
        queue = WeightGradQueue(meter.track if measure else None) if defer else None
        outs, tape = record_forward(model.layer_plans(), (ids,), meter.track if measure else None)
        gpt_loss(outs[0], ids).backward()
        run_backward(tape, None, wgrad=queue)
        if queue is not None:
            assert len(queue) > 0
            queue.run()
    return [accumulated_grad(p).clone() for p in model.parameters()]


def test_measuring_changes_no_bit():
    config = GPTConfig()
    _, losses, grads = _step(config, measure=False)
    _, measured_losses, measured_grads = _step(config, measure=True)
    assert all(torch.equal(a, b) for a, b in zip(losses, measured_losses))
    assert all(torch.equal(a, b) for a, b in zip(grads, measured_grads))


@pytest.mark.parametrize("main_grad", [False, True])
def test_measuring_changes_no_bit_of_deferred_weight_gradients(main_grad):
    """Saved-tensor hooks hand a Function's backward a new tensor object for a saved parameter:
    a deferred weight gradient added to that object's ``.grad`` / ``main_grad`` was lost (the
    experts' weights got no gradient under ``--delay-wgrad-compute --log-activation-memory``)."""
    reference = _tape_step(measure=False, defer=False, main_grad=main_grad)
    for defer in (False, True):
        measured = _tape_step(measure=True, defer=defer, main_grad=main_grad)
        assert all(torch.equal(a, b) for a, b in zip(reference, measured)), defer


def test_selective_recompute_drops_at_least_what_it_no_longer_saves():
    config = GPTConfig()
    full, _, _ = _step(config, measure=True)
    recomputed = GPTConfig(recompute_modules=("core_attn", "moe_act"))
    less, _, _ = _step(recomputed, measure=True)
    b, s, microbatches = 2, config.seq_length, 2
    # no longer saved per microbatch: the attention core's log-sum-exp [b, heads, s] in every
    # layer (its output stays: the output projection saves it, as a view). The experts'
    # activation saves only its inputs, gate and up, with moe_act or without: the fused SwiGLU
    # (megapipe.kernels.swiglu) keeps no silu(gate), so moe_act drops nothing more
    attention = config.num_layers * b * config.num_heads * s * 4
    assert full - less >= microbatches * attention, (full, less)


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


@pytest.mark.parametrize(
    "method, layers", [("uniform", 1), ("uniform", 2), ("block", 1), ("block", 2)]
)
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
