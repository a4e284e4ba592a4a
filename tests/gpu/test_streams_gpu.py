"""CUDA streams: the same bits as the CPU implementation, and real overlap of the two streams.

Skipped without CUDA. One GPU, ep = 1 (no process group): the comm nodes still run on the
communication stream.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "overlap"))

from megapipe.overlap.coscheduler import combined_step  # noqa: E402
from megapipe.overlap.streams import CudaStream, make_streams  # noqa: E402
from megapipe.overlap.tape import record_forward, run_backward  # noqa: E402
from megapipe.overlap.wgrad import WeightGradQueue  # noqa: E402


def _toy_stacks(device):
    from support.overlap_toys import toy_stack

    return toy_stack("dmm", hidden=64, seed=1).to(device), toy_stack("mdm", hidden=64, seed=2).to(device)


def _moe_stacks(device):
    from megapipe.moe.layer import MoEConfig, MoELayer

    cfg = MoEConfig(hidden_size=64, num_experts=4, top_k=2, ffn_hidden_size=128, aux_loss_coeff=0.01)
    build = lambda seed: torch.nn.ModuleList([MoELayer(cfg, layer_index=i, seed=seed) for i in range(2)])
    return build(1).to(device), build(2).to(device)


def _run(make_stacks, mode: str, defer: bool):
    """mode: 'sequential' (tape only), 'cpu-streams' or 'cuda-streams' (combined step)."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    stack_f, stack_b = make_stacks(device)
    x_i = torch.randn(64, 64, device=device, requires_grad=True)
    x_j = torch.randn(64, 64, device=device, requires_grad=True)
    g_j = torch.randn(64, 64, device=device)
    _, tape_j = record_forward([layer.node_plan() for layer in stack_b], (x_j,))
    plans_f = [layer.node_plan() for layer in stack_f]
    if mode == "sequential":
        outs, _ = record_forward(plans_f, (x_i,))
        queue = WeightGradQueue() if defer else None
        gx = run_backward(tape_j, (g_j,), wgrad=queue)
        if queue is not None:
            queue.run()
    else:
        with make_streams("cpu" if mode == "cpu-streams" else device) as streams:
            outs, _, gx = combined_step(plans_f, (x_i,), tape_j, (g_j,), streams, delay_wgrad_compute=defer)
    torch.cuda.synchronize()
    params = [p.grad.clone() for s in (stack_f, stack_b) for p in s.parameters() if p.grad is not None]
    return [outs[0].detach().clone(), gx[0].clone()] + params


@pytest.mark.parametrize("make_stacks", [_toy_stacks, _moe_stacks], ids=["toy", "moe"])
@pytest.mark.parametrize("defer", [False, True])
def test_cuda_streams_give_the_bits_of_the_cpu_implementation(make_stacks, defer):
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        runs = {mode: _run(make_stacks, mode, defer) for mode in ("sequential", "cpu-streams", "cuda-streams")}
    finally:
        torch.use_deterministic_algorithms(False)
    reference = runs["sequential"]
    for mode in ("cpu-streams", "cuda-streams"):
        assert len(runs[mode]) == len(reference)
        for a, b in zip(runs[mode], reference):
            assert torch.equal(a, b), mode


def _timed(stream: CudaStream, fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream.stream)
    fn()
    end.record(stream.stream)
    end.synchronize()
    return start.elapsed_time(end)


def test_work_on_the_comm_stream_overlaps_the_compute_stream():
    cycles = 50_000_000  # tens of milliseconds on current GPUs
    with make_streams("cuda") as streams:
        torch.cuda._sleep(1000)  # warm up
        torch.cuda.synchronize()
        alone = _timed(streams.compute, lambda: streams.compute.submit(torch.cuda._sleep, cycles))

        def both() -> None:
            streams.comm.wait_event(streams.compute.record_event())
            event = streams.comm.submit(torch.cuda._sleep, cycles)
            streams.compute.submit(torch.cuda._sleep, cycles)
            streams.compute.wait_event(event)

        together = _timed(streams.compute, both)
    assert together < 0.85 * (2 * alone), (together, alone)


class _GpuSleep(torch.autograd.Function):
    """Identity that keeps the GPU busy in forward and in backward."""

    @staticmethod
    def forward(ctx, x, cycles):
        ctx.cycles = cycles
        torch.cuda._sleep(cycles)
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        torch.cuda._sleep(ctx.cycles)
        return grad * 1.0, None


def test_combined_step_on_cuda_overlaps_comm_nodes_with_compute_nodes():
    from megapipe.overlap.plan import Node, NodeKind

    cycles = 10_000_000

    def busy(state, t):
        return (_GpuSleep.apply(t[0], cycles),)

    kinds = ["compute", "comm", "compute", "comm", "compute"]
    plan = [Node(f"{k}{i}", NodeKind(k), busy) for i, k in enumerate(kinds)]
    device = torch.device("cuda")
    x = torch.randn(8, device=device, requires_grad=True)
    g = torch.ones(8, device=device)
    with make_streams(device) as streams:
        _, tape_a = record_forward([plan, plan], (x,))
        _, tape_b = record_forward([plan, plan], (x,))
        torch.cuda.synchronize()
        sequential = _timed(streams.compute, lambda: (record_forward([plan, plan], (x,)), run_backward(tape_a, (g,))))
        combined = _timed(streams.compute, lambda: combined_step([plan, plan], (x,), tape_b, (g,), streams))
    # every node keeps the GPU busy for one unit: 20 units in sequence; the combined step
    # needs 6 per pair of layers (4 slots with a comm node beside a compute node)
    assert combined < 0.85 * sequential, (combined, sequential)
