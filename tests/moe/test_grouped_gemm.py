"""The grouped matmul's GEMMs: torch's grouped kernel where it applies, the loop otherwise, the
same bits on CPU; bf16, autocast, and deferred weight gradients into an fp32 main_grad."""

import pytest
import torch

from megapipe.moe.grouped_gemm import (
    cuda_kernel_reads_no_offsets,
    grouped_forward,
    grouped_input_grad,
    grouped_matmul,
    grouped_weight_grad,
    use_grouped_mm,
)
from megapipe.overlap.plan import LayerState
from megapipe.overlap.wgrad import WeightGradQueue
from megapipe.precision.main_grad import attach_main_grads

HAS_KERNEL = hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")
COUNTS = [[40, 0, 60, 28], [0, 0, 128, 0], [32, 32, 32, 32]]


def _operands(counts, dtype, hidden=96, ffn=64):
    gen = torch.Generator().manual_seed(sum(counts))
    n = sum(counts)
    x = torch.randn(n, hidden, generator=gen).to(dtype)
    w = torch.randn(len(counts), hidden, ffn, generator=gen).to(dtype)
    g = torch.randn(n, ffn, generator=gen).to(dtype)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    return x, w, g, offsets


@pytest.mark.skipif(not HAS_KERNEL, reason="this torch has no grouped_mm")
@pytest.mark.parametrize("counts", COUNTS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grouped_kernel_gives_the_loops_bits_on_cpu(counts, dtype):
    x, w, g, offsets = _operands(counts, dtype)
    assert use_grouped_mm(x, w, offsets)
    pairs = [
        (grouped_forward(x, w, counts, offsets), grouped_forward(x, w, counts, None)),
        (grouped_input_grad(g, w, counts, offsets), grouped_input_grad(g, w, counts, None)),
        (grouped_weight_grad(x, g, w, counts, offsets),
         grouped_weight_grad(x, g, w, counts, None)),
    ]
    for kernel, loop in pairs:
        assert kernel.dtype == dtype and torch.equal(kernel, loop)


def test_the_loop_runs_where_the_kernel_does_not_apply():
    x, w, _, offsets = _operands([2, 3], torch.float32, hidden=6, ffn=4)  # 24-byte rows
    assert not use_grouped_mm(x, w, offsets)  # rows not a multiple of 16 bytes
    assert not use_grouped_mm(*_operands([2, 3], torch.float32)[:2], None)  # no offsets
    assert not use_grouped_mm(x.double(), w.double(), offsets)
    assert torch.equal(grouped_forward(x, w, [2, 3], offsets), grouped_forward(x, w, [2, 3], None))


@pytest.mark.parametrize("defer", [False, True])
def test_autocast_runs_in_bf16_and_returns_fp32_grads(defer):
    """Under torch.autocast the matmuls run in bf16 (they used to fail in backward with
    'expected m1 and m2 to have the same dtype'); gradients come back in fp32."""
    counts = [40, 0, 60, 28]
    x, w, g, offsets = _operands(counts, torch.float32)
    weight = torch.nn.Parameter(w.clone())
    xi = x.clone().requires_grad_(True)
    queue = WeightGradQueue()
    state = LayerState(wgrad_queue=queue if defer else None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = grouped_matmul(xi, counts, weight, state, offsets)
    assert out.dtype == torch.bfloat16
    out.backward(g.bfloat16())
    queue.run()
    assert xi.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32
    expected = grouped_weight_grad(x.bfloat16(), g.bfloat16(), w.bfloat16(), counts, None)
    assert torch.equal(weight.grad, expected.float())


def test_bf16_weights_defer_into_fp32_main_grad_with_the_same_bits():
    counts = [40, 0, 60, 28]
    x, w, g, offsets = _operands(counts, torch.bfloat16)
    main_grads = []
    for defer in (False, True):
        weight = torch.nn.Parameter(w.clone())
        attach_main_grads([weight])
        queue = WeightGradQueue()
        for _ in range(2):  # two microbatches accumulate in fp32
            out = grouped_matmul(x, counts, weight, LayerState(queue if defer else None), offsets)
            out.backward(g)
            queue.run()
        assert weight.grad is None and weight.main_grad.dtype == torch.float32
        main_grads.append(weight.main_grad)
    assert torch.equal(*main_grads)
    once = grouped_weight_grad(x, g, w, counts, offsets).float()
    assert torch.equal(main_grads[0], once + once)


def test_mixed_dtypes_without_autocast_are_named():
    with pytest.raises(TypeError, match="x is torch.bfloat16 but weight is torch.float32"):
        grouped_matmul(torch.randn(4, 3).bfloat16(), [2, 2], torch.randn(2, 3, 3))


@pytest.mark.parametrize("capability,kernel", [
    ((8, 0), False),  # A100: torch's fallback copies the offsets to the host
    ((8, 9), False),
    ((9, 0), True),  # H100 / H200: the CUTLASS kernel reads them on the device
    ((10, 0), True),  # B200 / GB200
    ((12, 0), False),
])
def test_cuda_runs_the_kernel_only_where_it_reads_no_offsets_on_the_host(capability, kernel):
    assert cuda_kernel_reads_no_offsets(capability) is kernel
