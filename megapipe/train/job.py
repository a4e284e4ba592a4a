"""One rank's training job, built from the typed config: ``build_job(config) -> Job``.

A ``Job`` holds everything a training step touches — process groups, the schedule, this rank's
stages of the model, the pipeline executor, the data shards, AdamW and the LR schedule — so the step
(``train.step``) and the loop (``train.loop``) are short functions of it. Building is deterministic
in the config's seed: the same flags build the same weights and data sampling on every run, which is
what makes resumed runs bitwise equal to uninterrupted ones.
"""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from megapipe.data.gpt_samples import IndexedTrainBatches
from megapipe.data.raw_text import Microbatch, TrainBatches
from megapipe.models.config import GPTConfig
from megapipe.models.gpt import gpt_loss
from megapipe.models.split import build_stage, copy_into_stage
from megapipe.moe.rank_capacity import buffer_bytes, lane_rows
from megapipe.parallel.groups import ProcessGroups, create_groups
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.pipeline.executor_options import ExecutorOptions
from megapipe.pipeline.grad_sync import is_expert_param
from megapipe.pipeline.overlap_auto import OverlapAuto
from megapipe.pipeline.p2p import TensorSpec
from megapipe.schedule import Schedule
from megapipe.train.config.job_config import JobConfig
from megapipe.train.job_data import build_data
from megapipe.train.optim.adamw import (
    LRSchedule,
    build_optimizer,
    optimizer_state_bytes,
    unique_params,
)
from megapipe.train.optim.dp_sync import DataParallelSync
from megapipe.train.optim.flat_adamw import FlatAdamW
from megapipe.train.optim.grad_buffers import stage_buffers
from megapipe.train.optim.mixed_precision import MixedPrecisionAdamW, cast_to_bf16


@dataclass
class Job:
    """One rank's training state (see the module docstring)."""

    config: JobConfig
    device: torch.device
    groups: ProcessGroups
    schedule: Schedule
    stages: dict[int, nn.Module]
    executor: PipelineExecutor
    data_line: str  # the log's description of the data
    batches: TrainBatches | IndexedTrainBatches
    valid: list[list[Microbatch]]
    byte_counts: torch.Tensor | None  # bytes per token id, on the device (bits per byte)
    optimizer: torch.optim.Optimizer | MixedPrecisionAdamW | FlatAdamW
    lr_schedule: LRSchedule
    all_params: list[nn.Parameter]
    # each model part once per pipeline (DualPipe mirrors), a tied output weight's copy left out
    norm_params: list[nn.Parameter]
    dp_sync: DataParallelSync | None = None  # bucketed reductions (optim.dp_sync), if asked
    # --overlap-moe-expert-parallel-comm-auto: both executors; ``executor`` is its choice
    overlap_auto: OverlapAuto | None = None

    def close(self) -> None:
        """Stop the threads of the communication streams."""
        self.executor.close()
        if self.overlap_auto is not None:
            self.overlap_auto.close()
        if self.dp_sync is not None:
            self.dp_sync.close()


def job_device() -> torch.device:
    """The GPU of this rank under NCCL, else the CPU."""
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_job(
    config: JobConfig, start_from: str | None = None, clock: Callable[[], float] = time.perf_counter
) -> Job:
    """Groups, schedule, stages, executor, data, optimizer (needs the default process group);
    each part from its typed configuration (``config``). The weights are the seed's, or with
    ``start_from`` those of that Hugging Face directory (``--load-hf``; checked beforehand by
    ``checkpoint.resume.check_hf_model``). ``clock`` times the steps of the overlap's auto
    mode (``pipeline.overlap_auto``)."""
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    device = job_device()
    optim = config.optimizer
    groups = create_groups(
        config.parallel,
        high_priority=config.overlap.high_priority_stream_groups,
        timeout=config.failures.timeout,
    )
    schedule = config.schedule.build()
    stages = _stages(config, schedule, groups, device, start_from)
    modules = [stages[s] for s in sorted(stages)]
    norm_stages = [s for s in sorted(stages) if s < schedule.stages_per_pipeline]
    dp_sync, optimizer = _optimizer(config, stages, groups, device, norm_stages)
    executor, overlap_auto = _executors(config, schedule, stages, groups, dp_sync, clock, device)
    job_data = build_data(config, config.parallel.dp, groups.dp_rank)
    counts = job_data.byte_counts
    return Job(
        config=config,
        device=device,
        groups=groups,
        schedule=schedule,
        stages=stages,
        executor=executor,
        data_line=job_data.description,
        batches=job_data.batches,
        valid=job_data.valid,
        byte_counts=None if counts is None else counts.to(device),
        optimizer=optimizer,
        lr_schedule=LRSchedule(
            optim.lr,
            optim.min_lr,
            optim.warmup_iters,
            max(1, optim.decay_end - optim.warmup_iters),
            optim.decay_style,
        ),
        all_params=unique_params(modules),
        norm_params=[
            p
            for p in unique_params([stages[s] for s in norm_stages])
            if not getattr(p, "shared", False)
        ],
        dp_sync=dp_sync,
        overlap_auto=overlap_auto,
    )


def _stages(
    config: JobConfig,
    schedule: Schedule,
    groups: ProcessGroups,
    device: torch.device,
    start_from: str | None,
) -> dict[int, nn.Module]:
    """This rank's stages of the model: the seed's weights or ``start_from``'s, then in bf16
    when asked (flat buffers give the parameters their main_grad themselves)."""
    stages: dict[int, nn.Module] = {
        s: build_stage(
            config.model, schedule.model_part(s), schedule.stages_per_pipeline, ep_group=groups.ep
        ).to(device)
        for s in schedule.stages_of_rank(groups.pp_rank)
    }
    if start_from is not None:  # before the bf16 cast and the optimizer's fp32 copies
        _copy_hf_weights(start_from, config.model, stages)
    if config.precision.bf16:
        modules = [stages[s] for s in sorted(stages)]
        cast_to_bf16(
            modules, [] if config.data_parallel.flat_grad_buffers else unique_params(modules)
        )
    return stages


def _executors(
    config: JobConfig,
    schedule: Schedule,
    stages: dict[int, nn.Module],
    groups: ProcessGroups,
    dp_sync: DataParallelSync | None,
    clock: Callable[[], float],
    device: torch.device,
) -> tuple[PipelineExecutor, OverlapAuto | None]:
    """The executor the step runs; with the overlap's auto mode also the plain schedule's, over
    the same stages, and the ``OverlapAuto`` that chooses between them."""
    overlap = config.overlap
    executor = _executor(config, schedule, stages, groups, dp_sync, overlap.record_trace)
    if not overlap.auto:
        return executor, None
    plain = replace(config.schedule, overlap=False).build()
    overlap_auto = OverlapAuto(
        _executor(config, plain, stages, groups, dp_sync, record_trace=False),
        executor,
        overlap.auto_interval,
        clock,
        device=device,
    )
    return overlap_auto.executor, overlap_auto


def _executor(
    config: JobConfig,
    schedule: Schedule,
    stages: dict[int, nn.Module],
    groups: ProcessGroups,
    dp_sync: DataParallelSync | None,
    record_trace: bool,
) -> PipelineExecutor:
    """The pipeline executor of ``schedule`` over this rank's ``stages``; with CUDA graphs and
    the flat buffers, its replays wait for the parameter gathers (a replay runs no module hook)."""
    overlap, model, data = config.overlap, config.model, config.data
    executor = PipelineExecutor(
        schedule,
        stages,
        ExecutorOptions(
            groups=groups,
            loss_fn=gpt_loss,
            grad_reduction="none" if dp_sync is not None else "dp",
            spec=TensorSpec(
                (data.micro_batch_size, model.seq_length, model.hidden_size),
                torch.bfloat16 if config.precision.bf16 else torch.float32,
            ),
            delay_wgrad_compute=overlap.delay_wgrad_compute,
            moe_a2a_waves=overlap.moe_a2a_waves,
            record_trace=record_trace,
            measure_activations=config.logging.activation_memory,
            timeout=config.failures.timeout.total_seconds(),
            cuda_graph_impl=config.graphs.impl,
            cuda_graph_modules=config.graphs.modules,
        ),
    )
    if dp_sync is not None and executor.cuda_graphs is not None:
        dp_sync.wait_before_replays(executor.cuda_graphs)
        executor.cuda_graphs.after_backward.append(dp_sync.grad_added)  # bucket counts
    return executor


def _copy_hf_weights(directory: str, model: GPTConfig, stages: dict[int, nn.Module]) -> None:
    """The weights of a Hugging Face directory into this rank's stages; the rank reads only the
    tensors its stages hold (its MoE layers' experts all, each stage keeping its own)."""
    from megapipe.hf.load_hf import load_hf  # safetensors: the hf extra

    names = {name for stage in stages.values() for name, _ in stage.named_parameters()}
    _, state = load_hf(directory, model.seq_length, keep=names.__contains__)
    for stage in stages.values():
        copy_into_stage(stage, state)


def _optimizer(
    config: JobConfig,
    stages: dict[int, nn.Module],
    groups: ProcessGroups,
    device: torch.device,
    norm_stages: list[int],
) -> tuple[DataParallelSync | None, torch.optim.Optimizer | MixedPrecisionAdamW | FlatAdamW]:
    """AdamW over the parameters, or with ``--overlap-grad-reduce`` /
    ``--use-distributed-optimizer`` the flat buffers, their collectives and AdamW over them."""
    modules = [stages[s] for s in sorted(stages)]
    optim, dp, bf16 = config.optimizer, config.data_parallel, config.precision.bf16
    if not dp.flat_grad_buffers:
        return None, build_optimizer(modules, optim.lr, optim.weight_decay, mixed_precision=bf16)
    buffers = {
        s: stage_buffers(
            stages[s],
            groups.dp,
            groups.expert_dp,
            dp.bucket_size,
            dp.distributed_optimizer,
            is_expert_param,
        )
        for s in sorted(stages)
    }
    sync = DataParallelSync(
        stages,
        buffers,
        config.parallel.dp,
        device,
        overlap=dp.overlap_grad_reduce,
        overlap_param_gather=dp.overlap_param_gather,
        link=dp.link(),
    )
    return sync, FlatAdamW(
        buffers, sync, optim.lr, optim.weight_decay, mixed_precision=bf16, norm_stages=norm_stages
    )


def describe(job: Job) -> list[str]:
    """The log's header: layout and schedule, model, tokenizer and data, the emulated link,
    placement."""
    config = job.config
    parallel, overlap, model = config.parallel, config.overlap, config.model
    local_params = sum(p.numel() for p in job.all_params)
    waves = overlap.moe_a2a_waves
    lines = [
        f"megapipe pretrain: world {parallel.world_size} = pp {parallel.pp} x dp {parallel.dp} "
        f"(ep {parallel.ep}), vpp {config.schedule.vpp}, schedule {job.schedule.name}"
        f"{' with overlap' if overlap.enabled else ''}{' auto' if overlap.auto else ''}"
        f"{', delayed wgrad' if overlap.delay_wgrad_compute else ''}"
        f"{f', all-to-alls in {waves} waves' if waves > 1 else ''}; "
        f"{precision_text(config)}; "
        f"{config.schedule.num_microbatches} microbatches of {config.data.micro_batch_size} x "
        f"{model.seq_length} tokens per dp rank per step",
        f"{model_text(model)}; {local_params:,} parameters on rank 0; device {job.device.type}",
        tokenizer_text(config),
        job.data_line,
    ]
    if model.moe_link is not None:
        lines.append(model.moe_link.describe())
    if model.moe_expert_rank_capacity_factor is not None:
        lines.append(rank_capacity_text(config))
    if job.dp_sync is not None:
        lines.append(data_parallel_text(job))
    if job.executor.cuda_graph_note is not None:  # graphs on, or off without CUDA
        lines.append(job.executor.cuda_graph_note)
    lines.append(placement_line())
    return lines


def model_text(model: GPTConfig) -> str:
    """The log's model line: shape and architecture, every choice named."""
    moe = f"{model.num_experts} experts top-{model.moe_top_k}" if model.num_experts else "dense"
    if model.num_experts and model.first_k_dense_layers:
        moe += f" after {model.first_k_dense_layers} dense layer(s)"
    groups = f", {model.query_groups} query groups" if model.query_groups != model.num_heads else ""
    position = "rope" if model.position_embedding_type == "rope" else "learned absolute positions"
    return (
        f"model: GPT, {model.num_layers} layers, hidden {model.hidden_size}, {moe}; "
        f"attention {model.num_heads} heads of {model.head_dim}{groups}, {position}"
        f"{', QK norm' if model.qk_layernorm else ''}; RMSNorm, SwiGLU, no biases, "
        f"{'untied' if model.untie_embeddings_and_output_weights else 'tied'} embeddings"
    )


def tokenizer_text(config: JobConfig) -> str:
    """The log's tokenizer line: which, its size, the model's padded vocabulary."""
    tok = config.tokenizer
    which = (
        "ByteTokenizer (one token per byte)"
        if tok.tokenizer_type == "ByteTokenizer"
        else f"{tok.tokenizer_type} {tok.tokenizer_model}"
    )
    return (
        f"tokenizer: {which}, {tok.vocab_size:,} tokens; model vocabulary {tok.padded_vocab_size:,}"
    )


def data_parallel_text(job: Job) -> str:
    """What the log says of bucketed data parallelism (``--overlap-grad-reduce``,
    ``--use-distributed-optimizer``)."""
    dp, parallel, sync = job.config.data_parallel, job.config.parallel, job.dp_sync
    assert sync is not None
    buckets = sum(len(b.buckets) for bs in sync.buffers.values() for b in bs)
    when = "as each is final in the backward" if dp.overlap_grad_reduce else "after the step"
    text = f"data parallel: gradients reduced in {buckets} bucket(s) on rank 0, {when}"
    if dp.distributed_optimizer:
        text += (
            f"; AdamW state sharded over dp {parallel.dp} (experts over expert-dp "
            f"{parallel.expert_dp}), updated weights all-gathered "
            + ("behind the next step's forwards" if dp.overlap_param_gather else "after the step")
        )
    text += f"; optimizer state {optimizer_state_bytes(job.optimizer) / 2**20:.2f} MiB on rank 0"
    link = dp.link()
    if link is not None:
        text += f"; emulated DP link ON: {link.bandwidth_bytes_per_s / 1e9:.3g} GB/s"
    return text


def rank_capacity_text(config: JobConfig) -> str:
    """What the log says of ``--moe-expert-rank-capacity-factor``: the lanes and the memory of
    the fixed buffers."""
    model, factor = config.model, config.model.moe_expert_rank_capacity_factor
    assert factor is not None
    ep = config.parallel.ep
    rows = config.data.micro_batch_size * model.seq_length * model.moe_top_k
    lane = lane_rows(rows, factor, ep)
    size = buffer_bytes(lane, ep, model.hidden_size, 2 if config.precision.bf16 else 4)
    return (
        f"rank capacity {factor:g}: dispatch in fixed lanes of {lane} rows per EP rank "
        f"pair ({ep * lane} rows received for {rows} routed), counts on the device; "
        f"buffers {size / 2**20:.3f} MiB per MoE layer and microbatch; a step that "
        "overflows on any rank runs again without it"
    )


def precision_text(config: JobConfig) -> str:
    """What the first log line says about precision."""
    kernels = ", deterministic kernels" if config.precision.deterministic else ""
    if not config.precision.bf16:
        return f"fp32{kernels}"
    dtype = config.model.moe_router_dtype
    router = f", router {dtype}" if dtype else ""
    return f"bf16 with fp32 main weights, moments and gradients{router}{kernels}"


def placement_line(hostname: Callable[[], str] = socket.gethostname) -> str:
    """Which ranks run on which host (gathered from every rank)."""
    me = (dist.get_rank(), os.environ.get("SLURMD_NODENAME") or hostname())
    everyone: list[tuple[int, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, me)
    hosts: dict[str, list[int]] = {}
    for rank, host in sorted(e for e in everyone if e is not None):
        hosts.setdefault(host, []).append(rank)
    placed = "; ".join(
        f"{host}: ranks {','.join(map(str, ranks))}" for host, ranks in hosts.items()
    )
    return f"placement: {len(hosts)} host(s): {placed}"
