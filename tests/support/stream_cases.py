"""The runs the stream checker (``stream_checker``) watches: the CUDA path of the combined step,
on CPU, in the configurations that matter (``tests/overlap/test_stream_checker.py``).

Each function runs one configuration under a fresh ``StreamChecker`` and returns its findings
as strings (none: the run keeps CUDA's stream and allocator rules). The executor's streams and,
for a job, the DP sync's streams are the checker's ``CudaStream`` pair (``make_streams`` and
``dp_streams`` replaced for the run, restored after), so every stream switch, event and
``record_stream`` the CUDA path makes is the one checked.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from megapipe.models import GPTConfig, build_stage
from megapipe.models.gpt import gpt_loss
from megapipe.overlap.combined import combined_step
from megapipe.overlap.plan import Node, NodeKind
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.pipeline.executor_options import ExecutorOptions
from megapipe.schedule import build_schedule
from megapipe.train.optim.mixed_precision import cast_to_bf16
from support.fake_graphs import FakeGraphApi
from support.overlap_toys import exchange, toy_stack
from support.stream_checker import StreamChecker

# the reference GPT, tiny: a dense layer then MoE layers (4 experts, top-2, dropless)
CONFIG = GPTConfig(hidden_size=16, num_layers=3, num_heads=2, seq_length=8, ffn_hidden_size=32,
                   num_experts=4, moe_top_k=2, moe_ffn_hidden_size=16, first_k_dense_layers=1)
GRAPH_MODULES = ("attn", "moe_router", "mlp")


@contextlib.contextmanager
def checked_streams(checker: StreamChecker) -> Iterator[None]:
    """The executor's and the DP sync's streams are ``checker``'s while inside."""
    import megapipe.pipeline.executor as executor_module
    import megapipe.train.optim.dp_sync as dp_module

    saved = (executor_module.make_streams, dp_module.dp_streams,
             dp_module.wait_on_current_stream)
    executor_module.make_streams = lambda device="cpu", high_priority_comm=True: \
        checker.streams()
    dp_module.dp_streams = lambda device: checker.streams(dp_module.DP_STREAM)
    dp_module.wait_on_current_stream = checker.wait_on_current_stream
    try:
        yield
    finally:
        (executor_module.make_streams, dp_module.dp_streams,
         dp_module.wait_on_current_stream) = saved


def executor_findings(schedule: str, vpp: int = 1, delay: bool = False, graphs: bool = False,
                      bf16: bool = False, waves: int = 1, microbatches: int = 4,
                      recompute: bool = False, capacity_factor: float | None = None,
                      rank_capacity_factor: float | None = None) -> list[str]:
    """One training step of the reference GPT at pp 1 (every stage on this process) with the
    schedule's OVERLAP pairs, under the checker (``recompute``: full recompute, node by node;
    ``capacity_factor``: expert buffers padded to a capacity, no host read;
    ``rank_capacity_factor``: dropless in fixed-size lanes, no host read)."""
    config = dataclasses.replace(CONFIG, recompute_method="uniform" if recompute else None,
                                 moe_capacity_factor=capacity_factor,
                                 moe_expert_rank_capacity_factor=rank_capacity_factor)
    ids = torch.randint(0, 64, (microbatches, 1, CONFIG.seq_length + 1),
                        generator=torch.Generator().manual_seed(0))
    built = build_schedule(schedule, 1, microbatches, vpp=vpp, overlap=True)
    stages = {s: build_stage(config, built.model_part(s), built.stages_per_pipeline)
              for s in built.stages_of_rank(0)}
    if bf16:
        cast_to_bf16(stages.values(), [p for m in stages.values() for p in m.parameters()])
    options: dict[str, Any] = dict(cuda_graph_impl="local", cuda_graph_modules=GRAPH_MODULES,
                                   graph_api=FakeGraphApi()) if graphs else {}
    checker = StreamChecker()
    with checked_streams(checker), checker:
        with PipelineExecutor(built, stages,
                              ExecutorOptions(loss_fn=gpt_loss, delay_wgrad_compute=delay,
                                              moe_a2a_waves=waves, **options)) as executor:
            executor.step([i[:, :-1] for i in ids], [i[:, 1:] for i in ids])
        del executor, stages
    assert checker.ops > 100, checker.ops  # the step ran under the checker
    return [str(f) for f in checker.findings]


def ends_in_combine(layer: torch.nn.Module) -> list[Node]:
    """A toy MoE layer whose last node is its combine (comm), as the Megatron-Core adapter's
    MoE layers are (``megatron.mcore_layers.moe_plan``: attn, dispatch, mlp, combine)."""
    attention, dispatch, experts, _, _ = layer.node_plan()

    def combine(state: Any, tensors: tuple) -> tuple:
        x, z = tensors
        return (x + exchange(z, None, 0.0) * layer.scale,)

    return [attention, dispatch, experts, Node("combine", NodeKind.COMM, combine)]


def comm_last_findings(delay: bool) -> list[str]:
    """A combined step of two such layers beside the backward of two others, the backward
    tape recorded on the streams too (as the executor records every forward)."""
    f_stack, b_stack = toy_stack("mm", seed=1), toy_stack("mm", seed=2)
    checker = StreamChecker()
    with checker:
        streams = checker.streams()
        gen = torch.Generator().manual_seed(0)
        x_i = torch.randn(6, 8, generator=gen, requires_grad=True)
        x_j = torch.randn(6, 8, generator=gen, requires_grad=True)
        _, tape, _ = combined_step([ends_in_combine(m) for m in b_stack], (x_j,), None, None,
                                   streams)
        out = combined_step([ends_in_combine(m) for m in f_stack], (x_i,), tape,
                            (torch.randn(6, 8, generator=gen),), streams,
                            delay_wgrad_compute=delay)
        del out, tape
    return [str(f) for f in checker.findings]


def job_findings(argv: list[str], iterations: int = 2) -> list[str]:
    """``iterations`` training steps of the pretrain job ``argv`` on this rank (inside a rank
    pool), the executor's and the DP sync's streams checked."""
    from megapipe.train.config.parse import parse_pretrain_args
    from megapipe.train.job import build_job
    from megapipe.train.step import train_step

    checker = StreamChecker()
    with checked_streams(checker), checker:
        job = build_job(parse_pretrain_args(argv, env={}))
        try:
            for iteration in range(1, iterations + 1):
                train_step(job, job.batches.next_batch(), iteration)
        finally:
            job.close()
        del job
    assert checker.ops > 100, checker.ops
    return [str(f) for f in checker.findings]


def pipeline_findings(case: Any, delay: bool = False, bf16: bool = False) -> list[str]:
    """One training step of a pipeline ``Case`` (``pipeline_cases``; inside a rank pool: p2p
    between ranks, expert-parallel all-to-alls on the comm stream) under the checker."""
    from support.combined_cases import _run

    checker = StreamChecker()
    with checked_streams(checker), checker:
        result = _run(case, True, delay, bf16=bf16)
        del result
    assert checker.ops > 100, checker.ops
    return [str(f) for f in checker.findings]


def mcore_findings(case: Any) -> list[str]:
    """megapipe's combined schedule on Megatron-Core's own chunks (``mcore_cases``: inside the
    pool whose processes imported the release) under the checker. Megatron's own side streams
    are host stand-ins there (``megatron_cpu``), so only megapipe's streams are checked."""
    from support import mcore_cases

    mcore_cases._setup(case)
    checker = StreamChecker()
    with checked_streams(checker), checker:
        result = mcore_cases.megapipe_run(case, overlap=True)
        del result
    assert checker.ops > 100, checker.ops
    return [str(f) for f in checker.findings]
