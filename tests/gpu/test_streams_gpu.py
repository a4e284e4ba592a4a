"""CUDA streams: the bits of the CPU implementation, and real overlap of the two streams.

Skipped without CUDA. One GPU, ep = 1 (no process group): the comm nodes still run on the
communication stream. Determinism: ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` is set before the first
cuBLAS call and the bitwise test runs under ``deterministic_kernels(strict=False)``.

The race detector: on 64 x 64 tensors every kernel ends before the host issues the next, so a
missing cross-stream wait would almost never change a bit. The ``slow-moe`` stacks run 2048
tokens of hidden 512 with an ``EmulatedLink`` of 1 ms per all-to-all, whose rows are written
after the wait on the communication stream: a compute node that does not wait for its comm node
reads unwritten memory, and the bits differ.

Every backward tape here is recorded through a combined step (``combined_step`` with no backward
half), as the engine does: autograd runs each backward op on the stream of its forward op, so
only a comm node whose forward ran on the comm stream has its backward there.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megapipe.overlap.combined import combined_step  # noqa: E402
from megapipe.overlap.cuda_streams import CudaStream  # noqa: E402
from megapipe.overlap.device_streams import make_streams  # noqa: E402
from megapipe.overlap.node_trace import NodeTrace  # noqa: E402
from megapipe.overlap.plan import Node, NodeKind  # noqa: E402
from megapipe.overlap.sequential import record_forward, run_backward  # noqa: E402
from megapipe.overlap.wgrad import WeightGradQueue  # noqa: E402
from megapipe.train.determinism import deterministic_kernels  # noqa: E402


def _toy_stacks(device):
    from support.overlap_toys import toy_stack

    stacks = (
        toy_stack("dmm", hidden=64, seed=1).to(device),
        toy_stack("mdm", hidden=64, seed=2).to(device),
    )
    return stacks, (64, 64)


def _moe(device, hidden: int, link=None):  # noqa: ANN001, ANN202
    from megapipe.moe.layer import MoEConfig, MoELayer

    cfg = MoEConfig(hidden_size=hidden, num_experts=4, top_k=2, ffn_hidden_size=2 * hidden,
                    aux_loss_coeff=0.01, link=link)

    def build(seed):
        return torch.nn.ModuleList([MoELayer(cfg, layer_index=i, seed=seed) for i in range(2)])

    return build(1).to(device), build(2).to(device)


def _moe_stacks(device):
    return _moe(device, 64), (64, 64)


def _slow_moe_stacks(device):
    from megapipe.moe.link import EmulatedLink

    rows, hidden = 2048, 512
    payload = rows * 2 * hidden * 4  # top-2 rows of fp32
    link = EmulatedLink(bandwidth_bytes_per_s=payload / 1e-3)  # 1 ms per all-to-all
    return _moe(device, hidden, link), (rows, hidden)


def _record(plans, inputs, streams):
    """A forward recorded on the streams (comm nodes on the comm stream), as the engine does."""
    _, tape, _ = combined_step(plans, inputs, None, None, streams)
    return tape


def _run(make_stacks, mode: str, defer: bool):
    """mode: 'sequential' (tape only), 'cpu-streams' or 'cuda-streams' (combined step)."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    (stack_f, stack_b), shape = make_stacks(device)
    x_i = torch.randn(*shape, device=device, requires_grad=True)
    x_j = torch.randn(*shape, device=device, requires_grad=True)
    g_j = torch.randn(*shape, device=device)
    plans_b = [layer.node_plan() for layer in stack_b]
    plans_f = [layer.node_plan() for layer in stack_f]
    if mode == "sequential":
        _, tape_j = record_forward(plans_b, (x_j,))
        outs, _ = record_forward(plans_f, (x_i,))
        queue = WeightGradQueue() if defer else None
        gx = run_backward(tape_j, (g_j,), wgrad=queue)
        if queue is not None:
            queue.run()
    else:
        with make_streams("cpu" if mode == "cpu-streams" else device) as streams:
            tape_j = _record(plans_b, (x_j,), streams)
            outs, _, gx = combined_step(
                plans_f, (x_i,), tape_j, (g_j,), streams, delay_wgrad_compute=defer
            )
    torch.cuda.synchronize()
    params = [
        p.grad.clone() for s in (stack_f, stack_b) for p in s.parameters() if p.grad is not None
    ]
    return [outs[0].detach().clone(), gx[0].clone()] + params


@pytest.mark.parametrize("make_stacks", [_toy_stacks, _moe_stacks, _slow_moe_stacks],
                         ids=["toy", "moe", "slow-moe"])
@pytest.mark.parametrize("defer", [False, True])
def test_cuda_streams_give_the_bits_of_the_cpu_implementation(make_stacks, defer):
    with deterministic_kernels(strict=False):
        runs = {
            mode: _run(make_stacks, mode, defer)
            for mode in ("sequential", "cpu-streams", "cuda-streams")
        }
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


def _busy_plan(cycles: int) -> list[Node]:
    def busy(state, t):
        return (_GpuSleep.apply(t[0], cycles),)

    kinds = ["compute", "comm", "compute", "comm", "compute"]
    return [Node(f"{k}{i}", NodeKind(k), busy) for i, k in enumerate(kinds)]


def _overlap(span, others) -> float:
    return sum(max(0.0, min(span.end, o.end) - max(span.start, o.start)) for o in others)


def test_combined_step_on_cuda_overlaps_forward_and_backward_comm_nodes_with_compute():
    cycles = 10_000_000
    plan = _busy_plan(cycles)
    device = torch.device("cuda")
    x = torch.randn(8, device=device, requires_grad=True)
    g = torch.ones(8, device=device)
    with make_streams(device) as streams:
        _, tape_a = record_forward([plan, plan], (x,))  # the sequential baseline: one stream
        tape_b = _record([plan, plan], (x,), streams)
        torch.cuda.synchronize()
        sequential = _timed(
            streams.compute,
            lambda: (record_forward([plan, plan], (x,)), run_backward(tape_a, (g,))),
        )
        trace = NodeTrace()
        combined = _timed(
            streams.compute,
            lambda: combined_step([plan, plan], (x,), tape_b, (g,), streams, trace=trace),
        )
    spans = trace.spans  # GPU times
    # every node keeps the GPU busy for one unit: 20 units in sequence; the combined step
    # needs about 6 per pair of layers (4 slots with a comm node beside a compute node)
    assert combined < 0.85 * sequential, (combined, sequential)
    for direction, other in (("F", "B"), ("B", "F")):
        comm = [s for s in spans if s.kind == "comm" and s.direction == direction]
        beside = [s for s in spans if s.kind == "compute" and s.direction == other]
        assert len(comm) == 4
        for span in comm:  # the backward's all-to-alls too: they run on the comm stream
            assert _overlap(span, beside) > 0.5 * span.duration, (span.label(), spans)


def test_finish_is_stream_ordered_so_the_host_runs_ahead():
    cycles = 200_000_000  # a long comm node: the host must not wait for it
    device = torch.device("cuda")
    fast = _busy_plan(1000)
    slow = [Node(n.name, n.kind, n.fn) if n.kind == NodeKind.COMPUTE else
            Node(n.name, n.kind, lambda s, t: (_GpuSleep.apply(t[0], cycles),)) for n in fast]
    x = torch.randn(8, device=device, requires_grad=True)
    g = torch.ones(8, device=device)
    with make_streams(device) as streams:
        tape = _record([fast], (x,), streams)
        torch.cuda.synchronize()
        outs, _, grads = combined_step([slow], (x,), tape, (g,), streams)
        # finish() returned while the comm stream still sleeps: the host did not wait for it
        comm_busy = not streams.comm.record_event().query()
        # ... and work queued on the compute stream now runs after the comm stream's
        after = streams.compute.record_event()
        after.synchronize()
        comm_done = streams.comm.record_event().query()
    assert comm_busy, "finish() waited on the host for the comm stream"
    assert comm_done, "the compute stream did not wait for the comm stream"
    assert torch.equal(outs[0], x.detach()) and torch.equal(grads[0], g)


def test_node_trace_measures_gpu_time_not_issue_time():
    cycles = 50_000_000
    device = torch.device("cuda")
    x = torch.randn(8, device=device)
    with make_streams(device) as streams:
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
        alone = _timed(streams.compute, lambda: torch.cuda._sleep(cycles)) / 1e3
        trace = NodeTrace()
        combined_step([_busy_plan(cycles)], (x,), None, None, streams, trace=trace)
        spans = trace.spans
    for span in spans:
        assert span.duration > 0.8 * alone, (span.label(), span.duration, alone)


def test_emulated_link_waits_on_the_comm_stream_with_ep1():
    from megapipe.moe import EmulatedLink, MoEConfig, MoELayer

    device = torch.device("cuda")
    link = EmulatedLink(bandwidth_bytes_per_s=1e12, latency_s=0.05)
    base = dict(hidden_size=64, num_experts=4, top_k=2, ffn_hidden_size=128)
    layer = MoELayer(MoEConfig(**base, link=link), seed=1).to(device)
    plain = MoELayer(MoEConfig(**base), seed=1).to(device)
    x = torch.randn(32, 64, device=device)
    link.gpu_cycles_per_second(device)  # the one-time calibration, before timing
    with make_streams(device) as streams:
        torch.cuda.synchronize()
        trace = NodeTrace()
        outs, _, _ = combined_step([layer.node_plan()], (x,), None, None, streams, trace=trace)
        host_went_on = not streams.comm.record_event().query()  # the combine still sleeps
        spans = trace.spans
    comm = [s for s in spans if s.kind == "comm"]
    assert len(comm) == 2 and all(s.stream == "comm" for s in comm)
    assert all(s.duration > 0.9 * link.latency_s for s in comm), [s.duration for s in comm]
    assert host_went_on, "the host slept for the link"
    assert torch.equal(outs[0], plain(x))
