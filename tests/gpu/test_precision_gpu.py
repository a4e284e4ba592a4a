"""bf16 and the host-sync-free hot path on CUDA (skipped without CUDA; one GPU, ep = 1).

Determinism switches, set here as docs/precision.md says: the
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` environment variable at import, before the first cuBLAS call
of the session (cuBLAS reads it when it creates its handle), and
``deterministic_kernels(strict=False)`` (deterministic algorithms, attention on the math backend)
around the bitwise comparisons.
"""

import dataclasses
import os

import pytest
import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from megapipe.models.config import GPTConfig  # noqa: E402
from megapipe.models.gpt import gpt_loss  # noqa: E402
from megapipe.models.split import build_stage  # noqa: E402
from megapipe.moe.dispatcher import HostCounts  # noqa: E402
from megapipe.moe.grouped_gemm import (  # noqa: E402
    cuda_kernel_reads_no_offsets,
    grouped_forward,
    grouped_input_grad,
    grouped_weight_grad,
    use_grouped_mm,
)
from megapipe.overlap import combined_step, make_streams, record_forward  # noqa: E402
from megapipe.overlap.sequential import run_backward  # noqa: E402
from megapipe.overlap.wgrad import WeightGradQueue  # noqa: E402
from megapipe.precision.main_grad import accumulated_grad  # noqa: E402
from megapipe.train.determinism import deterministic_kernels  # noqa: E402
from megapipe.train.optim.adamw import build_optimizer  # noqa: E402
from megapipe.train.optim.mixed_precision import cast_to_bf16  # noqa: E402

CONFIG = GPTConfig(vocab_size=256, hidden_size=128, num_layers=3, num_heads=4, seq_length=64,
                   ffn_hidden_size=256, num_experts=8, moe_top_k=2, moe_ffn_hidden_size=128,
                   first_k_dense_layers=1, seed=3)


@pytest.fixture
def deterministic():
    with deterministic_kernels(strict=False):
        yield


def _bf16_stage(capacity=None):
    config = dataclasses.replace(CONFIG, moe_capacity_factor=capacity)
    stage = build_stage(config, 0, 1).cuda()
    cast_to_bf16([stage], list(stage.parameters()))
    return stage


def _batch(seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_length + 1), generator=gen).cuda()
    return ids[:, :-1], ids[:, 1:]


def _backward_half(stage):
    tokens, labels = _batch(1)
    outs, tape = record_forward(stage.layer_plans(), (tokens,))
    return tape, torch.autograd.grad(gpt_loss(outs[0], labels), outs[0])


@pytest.mark.parametrize("capacity", [None, 1.0], ids=["dropless", "capacity"])
def test_combined_step_runs_under_sync_debug_error_but_the_one_read(monkeypatch, capacity):
    """No host sync anywhere in a bf16 combined step on CUDA streams, apart from the documented
    read of the all-to-all split sizes (``HostCounts``: one per dropless MoE layer forward)."""
    stage = _bf16_stage(capacity)
    tape, grads = _backward_half(stage)
    tokens, _ = _batch(2)
    reads = []

    def allowed(method):
        def run(*args, **kwargs):
            reads.append(method.__name__)
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(0)  # the one documented point
            try:
                return method(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(previous)

        return run

    monkeypatch.setattr(HostCounts, "__init__", allowed(HostCounts.__init__))
    monkeypatch.setattr(HostCounts, "wait", allowed(HostCounts.wait))
    torch.cuda.synchronize()
    with make_streams("cuda") as streams:
        torch.cuda.set_sync_debug_mode("error")
        try:
            combined_step(stage.layer_plans(), (tokens,), tape, grads, streams,
                          delay_wgrad_compute=True)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    expected = 0 if capacity else len(stage.moe_layers())
    assert reads.count("wait") == expected


def _combined_or_sequential(mode):
    torch.manual_seed(0)
    stage = _bf16_stage()
    tape, grads = _backward_half(stage)
    tokens, _ = _batch(2)
    if mode == "sequential":
        outs, _ = record_forward(stage.layer_plans(), (tokens,))
        queue = WeightGradQueue()
        input_grads = run_backward(tape, grads, wgrad=queue)
        queue.run()
    else:
        with make_streams("cuda") as streams:
            outs, _, input_grads = combined_step(stage.layer_plans(), (tokens,), tape, grads,
                                                 streams, delay_wgrad_compute=True)
    torch.cuda.synchronize()
    main_grads = [accumulated_grad(p).clone() for p in stage.parameters()]
    return [outs[0].detach().clone()] + main_grads, input_grads


def test_bf16_combined_step_is_bitwise_the_sequential_one(deterministic):
    combined, _ = _combined_or_sequential("combined")
    sequential, _ = _combined_or_sequential("sequential")
    assert combined[0].dtype == torch.bfloat16
    assert all(g.dtype == torch.float32 for g in combined[1:])
    for a, b in zip(combined, sequential):
        assert torch.equal(a, b)


def test_grouped_gemm_kernel_on_cuda_matches_the_loop(deterministic):
    counts = [300, 0, 212, 512]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), 256, generator=gen).cuda().bfloat16()
    w = torch.randn(len(counts), 256, 128, generator=gen).cuda().bfloat16()
    g = torch.randn(sum(counts), 128, generator=gen).cuda().bfloat16()
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    if cuda_kernel_reads_no_offsets(torch.cuda.get_device_capability()):
        assert use_grouped_mm(x, w, offsets)
    pairs = [
        (grouped_forward(x, w, counts, offsets), grouped_forward(x, w, counts, None)),
        (grouped_input_grad(g, w, counts, offsets), grouped_input_grad(g, w, counts, None)),
        (grouped_weight_grad(x, g, w, counts, offsets),
         grouped_weight_grad(x, g, w, counts, None)),
    ]
    for kernel, loop in pairs:  # different kernels: equal up to bf16 rounding
        assert kernel.dtype == torch.bfloat16
        scale = loop.float().abs().max().item()
        torch.testing.assert_close(kernel.float(), loop.float(), rtol=2e-2, atol=2e-2 * scale)
    again = grouped_forward(x, w, counts, offsets)
    assert torch.equal(again, pairs[0][0])  # and deterministic run to run


def test_bf16_optimizer_step_on_cuda_keeps_fp32_main_weights():
    stage = _bf16_stage()
    optimizer = build_optimizer([stage], lr=1e-3, weight_decay=0.01, mixed_precision=True)
    tokens, labels = _batch(3)
    gpt_loss(stage(tokens), labels).backward()
    optimizer.step()
    for p in stage.parameters():
        main = optimizer.main_param(p)
        assert main.dtype == torch.float32 and p.dtype == torch.bfloat16
        assert torch.equal(p, main.bfloat16())
        assert optimizer.state[p]["exp_avg"].dtype == torch.float32
    assert optimizer.optimizer.defaults["fused"]
