"""The CUDA path held to CUDA's stream and allocator rules on CPU (``support.stream_checker``).

The checker itself: it reports a read with no wait after the write, and a block freed while
another stream's use may still run; it accepts the wait, ``record_stream`` and the owner
stream's own wait. Then the matrix: every combined schedule family (pp 1 in this process;
DualPipe, and expert and data parallelism, in a pool of two),
deferred weight gradients on and off, graphs (the stand-in), bf16, waves, layers whose last
node is a comm node, and a pretrain job with the distributed optimizer, overlapped grad reduce
and param gather: no findings. A ``record_stream`` taken out is reported, naming the op.
"""

from __future__ import annotations

import pytest
import torch

from megapipe.moe.layer import MoEState
from megapipe.overlap.combined import CombinedStep
from support.pipeline_cases import Case
from support.pretrain_flags import TINY
from support.stream_cases import (
    comm_last_findings,
    executor_findings,
    job_findings,
    pipeline_findings,
)
from support.stream_checker import StreamChecker


def _made_on_compute_read_on_comm(wait: bool, keep: bool, owner_waits: bool) -> list[str]:
    checker = StreamChecker()
    with checker:
        streams = checker.streams()
        x = torch.ones(4) * 2  # made on the compute stream

        def read():
            return (x + 1).sum()  # noqa: F821  # x is deleted below after read() is queued

        if wait:
            streams.comm.wait_event(streams.compute.record_event())
        streams.comm.submit(read)
        if keep:
            streams.comm.record_use(x)
        if owner_waits:
            streams.compute.wait_event(streams.comm.record_event())
        del x  # the host drops the maker's reference
    return [f.kind for f in checker.findings]


def test_the_checker_reports_a_read_without_a_wait_and_a_free_while_pending():
    assert _made_on_compute_read_on_comm(wait=False, keep=True, owner_waits=False) == \
        ["unordered"]
    assert _made_on_compute_read_on_comm(wait=True, keep=False, owner_waits=False) == ["freed"]
    # kept for the reader, or the maker's stream waited for the read: the block is safe
    assert _made_on_compute_read_on_comm(wait=True, keep=True, owner_waits=False) == []
    assert _made_on_compute_read_on_comm(wait=True, keep=False, owner_waits=True) == []


def test_the_findings_name_the_op_the_origin_and_both_streams():
    checker = StreamChecker()
    with checker:
        streams = checker.streams()
        made = streams.comm.submit(lambda: torch.arange(6.0).cumsum(0)).value_on(
            streams.compute)  # value_on waits and keeps: safe
        streams.compute.submit(lambda: made * 3)  # noqa: F821  # deleted after submit
        del made
        raw = streams.comm.submit(lambda: torch.arange(6.0).cumsum(0)).value
        streams.compute.submit(lambda: raw * 3)  # noqa: F821  # no wait, no record_stream
        del raw
    (unordered, freed) = checker.findings
    assert (unordered.kind, unordered.op, unordered.origin, unordered.maker,
            unordered.reader) == ("unordered", "aten.mul", "aten.cumsum", "comm", "compute")
    assert (freed.kind, freed.op, freed.maker, freed.reader) == \
        ("freed", "aten.mul", "comm", "compute")
    assert "use after free" in str(freed) and "test_stream_checker.py" not in freed.where


# every schedule family with OVERLAP pairs (GPipe and looped BFS have none: all forwards, then
# all backwards), at pp 1 in this process (DualPipe needs an even pp: the pool below), deferred
# weight gradients off and on
@pytest.mark.parametrize("schedule,vpp", [("1f1b", 1), ("interleaved-1f1b", 2), ("zb1p", 2),
                                          ("zbv", 2), ("dualpipev", 2)])
def test_every_combined_schedule_keeps_the_stream_rules(schedule, vpp):
    for delay in (False, True):
        assert executor_findings(schedule, vpp, delay=delay) == [], (schedule, delay)


def test_graphs_bf16_waves_recompute_and_capacity_keep_the_stream_rules():
    assert executor_findings("1f1b", graphs=True, delay=True, bf16=True) == []
    assert executor_findings("1f1b", waves=2, delay=True) == []
    assert executor_findings("interleaved-1f1b", 2, recompute=True, delay=True) == []
    assert executor_findings("zbv", 2, capacity_factor=1.5, delay=True) == []
    assert executor_findings("1f1b", rank_capacity_factor=2.0, delay=True) == []


def test_layers_ending_in_a_comm_node_keep_their_incoming_gradients(monkeypatch):
    """The Megatron-Core adapter's MoE plans end in combine: that node's backward runs first,
    on the comm stream, reading the gradient the next layer (compute) gave."""
    assert comm_last_findings(delay=False) == []
    assert comm_last_findings(delay=True) == []
    real = CombinedStep._keep_crossing

    def unkept(self, stream, layer, record, forward):
        if forward or record is not layer.nodes[-1]:  # the incoming gradients go unkept
            real(self, stream, layer, record, forward)

    monkeypatch.setattr(CombinedStep, "_keep_crossing", unkept)
    findings = comm_last_findings(delay=False)
    assert findings and all(f.startswith("aten.mul on 'comm' uses a tensor made on 'compute'")
                            for f in findings), findings


def test_a_crossing_without_record_stream_is_reported_naming_the_op(monkeypatch):
    """The dispatch's grouped-GEMM offsets (made on the comm stream) without their
    ``record_stream`` on the compute stream: the deferred weight gradient's grouped GEMM reads
    them after the layer dropped them."""
    monkeypatch.setattr(MoEState, "crossing", lambda self, reader: ())
    (finding,) = executor_findings("1f1b", delay=True)
    assert finding.startswith("aten._grouped_mm on 'compute' uses a tensor made on 'comm' by "
                              "aten.cumsum"), finding
    assert "use after free" in finding and "grouped_weight_grad" in finding


DP_JOB = [f if f != "32" else "16" for f in TINY] + [  # TINY at half its sizes
    "--pipeline-model-parallel-size", "1", "--virtual-pipeline-model-parallel-size", "1",
    "--nproc", "2", "--train-iters", "2", "--eval-interval", "0", "--bf16",
    "--delay-wgrad-compute", "--use-distributed-optimizer", "--overlap-grad-reduce",
    "--overlap-param-gather", "--ddp-bucket-size", "512",
]


def test_pipelines_expert_and_data_parallel_keep_the_stream_rules_on_two_ranks(rank_pools):
    pool = rank_pools(2)
    for case, delay, bf16 in [
        (Case("dualpipe", 2, vpp=2, overlap=True), True, False),
        (Case("1f1b", 1, ep=2, dp=2, overlap=True), True, True),  # real all-to-alls
    ]:
        assert pool.run(pipeline_findings, case, delay, bf16) == [[], []], case
    # two steps: the second's forwards wait for the first's overlapped parameter gathers
    assert pool.run(job_findings, DP_JOB) == [[], []]
