"""One training step and one evaluation of a ``Job``, with the values the log reports.

``train_step(job, batch)`` runs the pipeline schedule over the batch's microbatches, then
clips and applies AdamW; the reported loss, auxiliary loss and the all-to-all time hidden and
exposed are means over every rank that holds them (one small all-reduce each), so every rank
logs the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megapipe.data.bits_per_byte import bits_per_byte, target_bytes
from megapipe.data.raw_text import Microbatch
from megapipe.moe.layer import set_sync_free, take_aux_loss_logs, take_overflow
from megapipe.pipeline.executor import StepResult
from megapipe.pipeline.grad_sync import sum_tied_embedding_grads
from megapipe.train.job import Job
from megapipe.train.observe.logging import check_finite_loss
from megapipe.train.observe.profiling import RunProfiler
from megapipe.train.optim.adamw import clip_grads, global_grad_norm
from megapipe.train.optim.flat_adamw import FlatAdamW


@dataclass(frozen=True)
class StepStats:
    """What one training step reports (global means; ``a2a_hidden`` and ``a2a_exposed``, seconds
    of all-to-all beside compute and alone, None without a trace)."""

    loss: float
    aux_loss: float
    lr: float
    grad_norm: float
    a2a_hidden: float | None
    a2a_exposed: float | None
    act_mem: float | None = None  # the largest rank's peak bytes saved or held (activation_meter)
    ran_again: bool = False  # a rank capacity overflowed: the step ran again without it


def global_mean(values: Sequence[torch.Tensor], device: torch.device) -> float:
    """Mean of ``values`` over every rank that holds some (sum and count, all-reduced)."""
    local = torch.zeros(2, dtype=torch.float64, device=device)
    if values:
        local[0] = torch.stack([v.detach().double() for v in values]).sum().to(device)
        local[1] = len(values)
    dist.all_reduce(local)
    return float(local[0] / local[1]) if local[1] > 0 else float("nan")


def a2a_hidden_exposed(step: StepResult, device: torch.device) -> tuple[float, float] | None:
    """Seconds of all-to-all per rank with compute beside it and without (mean over the ranks
    that ran any, from their node traces); None when no rank did."""
    local = torch.zeros(3, dtype=torch.float64, device=device)
    if step.a2a_time is not None and step.exposed_comm_fraction is not None:
        exposed = step.a2a_time * step.exposed_comm_fraction
        local[0], local[1], local[2] = step.a2a_time - exposed, exposed, 1
    dist.all_reduce(local)
    if local[2] == 0:
        return None
    return float(local[0] / local[2]), float(local[1] / local[2])


def peak_activation_bytes(step: StepResult, device: torch.device) -> float | None:
    """The largest rank's measured activation peak of the step (None when not measured)."""
    local = torch.tensor([float(step.activation_bytes or 0)], dtype=torch.float64, device=device)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return float(local[0]) if step.activation_bytes is not None else None


def pop_aux_losses(job: Job) -> list[torch.Tensor]:
    """The mean auxiliary loss each MoE layer recorded since the last call."""
    logs = take_aux_loss_logs(list(job.stages.values()))
    # torch's stub types Tensor.mean's result loosely
    return [log.mean() for log in logs]  # type: ignore[misc]


def to_device(
    batch: list[Microbatch], device: torch.device
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [t.to(device) for t, _ in batch], [lab.to(device) for _, lab in batch]


def train_step(
    job: Job, batch: list[Microbatch], iteration: int, profiler: RunProfiler | None = None
) -> StepStats:
    """Forward and backward over ``batch``, clip, AdamW; ``iteration`` is 1-based. With a
    ``profiler`` (``--profile-trace``) a traced iteration runs profiled and keeps its spans."""
    tokens, labels = to_device(batch, job.device)
    job.optimizer.zero_grad(set_to_none=True)
    options = profiler.options(iteration) if profiler is not None else None
    sync = job.dp_sync
    if profiler is not None:
        profiler.open_dp_trace(iteration, sync)
    step = job.executor.step(tokens, labels, profile=options, grad_hooks=sync)
    ran_again = rank_capacity_overflowed(job)
    if ran_again:  # some rank's rows did not fit: the same step again, dropless, from scratch
        pop_aux_losses(job)
        job.optimizer.zero_grad(set_to_none=True)
        stages = list(job.stages.values())
        set_sync_free(stages, False)
        try:
            step = job.executor.step(tokens, labels, profile=options, grad_hooks=sync)
        finally:
            set_sync_free(stages, True)
    if sync is not None:
        sync.finish_grad_sync()
        finish_tied_grads(job)
    if profiler is not None:
        profiler.record(iteration, step, sync)
    loss = global_mean(list(step.losses.values()), job.device)
    aux = global_mean(pop_aux_losses(job), job.device)
    a2a = a2a_hidden_exposed(step, job.device) if job.executor.record_trace else None
    act_mem = peak_activation_bytes(step, job.device)
    check_finite_loss(loss, iteration)
    lr = job.lr_schedule.step(job.optimizer)
    optimizer, clip = job.optimizer, job.config.optimizer.clip_grad
    if isinstance(optimizer, FlatAdamW) and optimizer.sharded:
        norm = optimizer.grad_norm(job.groups.pp, job.groups.ep, job.device)
        optimizer.clip(clip, norm)
    else:
        norm = global_grad_norm(job.norm_params, job.groups.pp, job.groups.ep, job.device)
        clip_grads(job.all_params, clip, norm)
    optimizer.step()
    if sync is not None:
        if profiler is not None:
            profiler.open_dp_trace(iteration + 1, sync)
        sync.start_param_gather()
    hidden, exposed = a2a if a2a is not None else (None, None)
    return StepStats(loss, aux, lr, norm, hidden, exposed, act_mem, ran_again)


def rank_capacity_overflowed(job: Job) -> bool:
    """Whether any rank's rank-capacity dispatch overflowed in the step just run: one MAX
    all-reduce and the step's one host read, after the step (False without a rank capacity,
    with nothing issued)."""
    if job.config.model.moe_expert_rank_capacity_factor is None:
        return False
    local = take_overflow(list(job.stages.values()))
    flag = torch.zeros((), dtype=torch.int32, device=job.device) if local is None else local
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def finish_tied_grads(job: Job) -> None:
    """With flat buffers (the executor reduces nothing): after the data-parallel reduction,
    give both copies of a weight tied across the first and last stage the sum of their
    gradients, as the executor's own reduction does (``pipeline.grad_sync``)."""
    executor = job.executor
    sum_tied_embedding_grads(
        job.schedule, executor.pp_rank, job.stages, executor.position.group, executor.position.ranks
    )


@dataclass(frozen=True)
class Validation:
    """One evaluation: the mean loss per token and, with a byte-level tokenizer, the bits per
    byte of text of the same targets."""

    loss: float
    bits_per_byte: float | None


def evaluate(job: Job) -> Validation:
    """Validation over the job's validation batches (forward only, nothing kept)."""
    losses: list[torch.Tensor] = []
    counted = torch.zeros(2, dtype=torch.float64, device=job.device)  # target tokens, bytes
    if job.dp_sync is not None:
        job.dp_sync.finish_param_gather()  # forward-only steps run no gather waits
    for batch in job.valid:
        tokens, labels = to_device(batch, job.device)
        step = job.executor.step(tokens, labels, forward_only=True)
        losses.extend(step.losses.values())
        if job.byte_counts is not None:
            for microbatch in step.losses:  # the microbatches whose loss this rank made
                counted[0] += labels[microbatch].numel()
                counted[1] += target_bytes(labels[microbatch], job.byte_counts)
    pop_aux_losses(job)  # evaluation's router losses are not training's
    loss = global_mean(losses, job.device)
    if job.byte_counts is None:
        return Validation(loss, None)
    dist.all_reduce(counted)
    total_tokens, total_bytes = (int(v) for v in counted.tolist())
    return Validation(loss, bits_per_byte(loss * total_tokens, total_bytes))
