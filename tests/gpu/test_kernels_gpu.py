"""Triton kernels compiled on CUDA against the plain-torch reference (permute/unpermute and the
fused operators, bf16 included), one kernel per megapipe operator (the launch count's rule),
and the MoE layer on CUDA (Triton path) against the same layer on CPU (reference path)."""

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _kernel_checks():
    path = Path(__file__).resolve().parents[1] / "kernels" / "test_permute_kernels.py"
    spec = importlib.util.spec_from_file_location("permute_kernel_checks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_triton_kernels_match_reference_on_cuda():
    pytest.importorskip("triton")
    problems = _kernel_checks().compare_triton_with_reference("cuda")
    assert not problems, "\n".join(problems)


def test_triton_kernels_are_deterministic_on_cuda():
    pytest.importorskip("triton")
    from megapipe.kernels import triton_permute
    from megapipe.moe.dispatcher import sort_by_expert

    gen = torch.Generator().manual_seed(0)
    indices = torch.stack([torch.randperm(8, generator=gen)[:4] for _ in range(512)]).cuda()
    row_choice, choice_rows, _ = sort_by_expert(indices, 8)
    rows = torch.randn(row_choice.numel(), 1024, device="cuda")
    probs = torch.rand(512, 4, device="cuda")
    first = triton_permute.sum_choices(rows, probs, choice_rows)
    again = triton_permute.sum_choices(rows, probs, choice_rows)
    assert torch.equal(first, again)


def test_moe_layer_on_cuda_matches_cpu():
    from megapipe.moe import MoEConfig, MoELayer

    config = MoEConfig(
        hidden_size=64,
        num_experts=8,
        top_k=2,
        ffn_hidden_size=32,
        aux_loss_coeff=0.01,
        shared_expert_intermediate_size=16,
        init_std=0.1,
    )
    cpu = MoELayer(config, layer_index=1, seed=5)
    gpu = MoELayer(config, layer_index=1, seed=5).cuda()
    x = torch.randn(4, 16, 64)
    grad = torch.randn(4, 16, 64)
    x_cpu = x.clone().requires_grad_()
    x_gpu = x.cuda().requires_grad_()
    (cpu(x_cpu) * grad).sum().backward()
    y_gpu = gpu(x_gpu)
    (y_gpu * grad.cuda()).sum().backward()
    torch.testing.assert_close(y_gpu.cpu(), cpu(x), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(x_gpu.grad.cpu(), x_cpu.grad, rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(cpu.named_parameters(), gpu.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-4, atol=1e-5, msg=name)


def _fused_checks():
    path = Path(__file__).resolve().parents[1] / "kernels" / "test_fused_kernels.py"
    spec = importlib.util.spec_from_file_location("fused_kernel_checks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fused_triton_kernels_match_reference_on_cuda():
    pytest.importorskip("triton")
    problems = _fused_checks().compare_triton_with_reference("cuda")
    assert not problems, "\n".join(problems)


def test_every_megapipe_operator_is_one_kernel_on_cuda():
    """The launch count's rule (benchmarks/launch_count.py): one kernel per megapipe operator."""
    pytest.importorskip("triton")
    from torch.profiler import ProfilerActivity, profile

    import megapipe.kernels as K

    dev, bf16 = "cuda", torch.bfloat16
    x, w = torch.randn(64, 96, device=dev, dtype=bf16), torch.ones(96, device=dev, dtype=bf16)
    y, rstd = K.rms_norm_op(x, w, 1e-5)
    logits = torch.randn(64, 8, device=dev, dtype=bf16)
    probs, indices, _ = K.router_op(logits, 2, False)
    row_choice, choice_rows, counts = K.routing_rows_op(indices, 8, -1)
    rows = K.permute_op(x, row_choice, 2)
    calls = {
        "rms_norm": lambda: K.rms_norm_op(x, w, 1e-5),
        "rms_norm_backward": lambda: K.rms_norm_backward_op(y, x, w, rstd, x),
        "swiglu": lambda: K.swiglu_op(x, x, [64]),
        "swiglu_backward": lambda: K.swiglu_backward_op(x, x, x, [64]),
        "router": lambda: K.router_op(logits, 2, False),
        "router_backward": lambda: K.router_backward_op(probs, logits, counts, None, 2, False,
                                                        0.01, 0.001),
        "routing_rows": lambda: K.routing_rows_op(indices, 8, -1),
        "permute": lambda: K.permute_op(x, row_choice, 2),
        "sum_choices": lambda: K.sum_choices_op(rows, probs, choice_rows),
        "unpermute_backward": lambda: K.unpermute_backward_op(x, rows, probs, row_choice,
                                                              choice_rows),
    }
    for name, call in calls.items():
        call()  # compiled before it is counted
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
        assert len(kernels) == 1, f"megapipe::{name} ran {kernels}"
