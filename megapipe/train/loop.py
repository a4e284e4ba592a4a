"""The training loop of one rank: build the job, resume, step, evaluate, save, log.

``train(args)`` returns a ``TrainResult`` (the loss of every iteration it ran, evaluations,
checkpoints written) so tests can compare runs bitwise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch.distributed as dist

from megapipe.parallel.launch import init_distributed
from megapipe.train.args import PretrainArgs
from megapipe.train.checkpoint import latest_iteration, load_checkpoint, save_checkpoint
from megapipe.train.job import Job, build_job, describe
from megapipe.train.logging import TrainingLogger
from megapipe.train.step import evaluate, train_step


@dataclass
class TrainResult:
    """What one rank saw: the global mean loss of every iteration run, and the evaluations."""

    first_iteration: int = 0
    losses: list[float] = field(default_factory=list)
    aux_losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    valid_losses: dict[int, float] = field(default_factory=dict)
    saved: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


def train(args: PretrainArgs, write: Callable[[str], None] = print) -> TrainResult:
    """Run one rank of the job (the default process group is started here if needed)."""
    if not dist.is_initialized():
        init_distributed()
    result = TrainResult()
    is_rank_0 = dist.get_rank() == 0

    def say(line: str) -> None:
        result.lines.append(line)
        if is_rank_0:
            write(line)

    job = build_job(args)
    for line in describe(job):
        say(line)
    iteration = result.first_iteration = resume(job, say)
    logger = TrainingLogger(args.train_iters, args.log_interval, enabled=is_rank_0,
                            tensorboard_dir=args.tensorboard_dir, write=say)
    tokens_per_iter = args.global_batch_size * args.seq_length
    started = time.perf_counter()
    try:
        while iteration < args.train_iters:
            start = time.perf_counter()
            stats = train_step(job, job.batches.next_batch(), iteration + 1)
            iteration += 1
            result.losses.append(stats.loss)
            result.aux_losses.append(stats.aux_loss)
            result.grad_norms.append(stats.grad_norm)
            logger.record(iteration, loss=stats.loss,
                          aux_loss=stats.aux_loss if stats.aux_loss == stats.aux_loss else None,
                          lr=stats.lr, grad_norm=stats.grad_norm,
                          step_time=time.perf_counter() - start, tokens=tokens_per_iter,
                          exposed_a2a=stats.exposed_a2a)
            if args.eval_interval and args.eval_iters and iteration % args.eval_interval == 0:
                result.valid_losses[iteration] = evaluate(job)
                logger.evaluation(iteration, result.valid_losses[iteration])
            due = bool(args.save_interval) and iteration % args.save_interval == 0
            if args.save and (due or iteration == args.train_iters):
                result.saved.append(save(job, iteration))
                say(f"saved checkpoint {result.saved[-1]}")
        if result.losses:
            say(f"done: iterations {result.first_iteration + 1}-{iteration} in "
                f"{time.perf_counter() - started:.0f} s; loss {result.losses[0]:.4f} -> "
                f"{result.losses[-1]:.4f}")
    finally:
        logger.close()
        job.executor.close()  # its communication-stream thread
    return result


def resume(job: Job, say: Callable[[str], None]) -> int:
    """Load the newest checkpoint of ``--load`` into the job; returns its iteration (0: none)."""
    load = job.args.load
    if load is None:
        return 0
    if latest_iteration(load) is None:
        say(f"--load {load}: no checkpoint yet, starting from scratch")
        return 0
    extra = {"scheduler": job.lr_schedule.state_dict(), "data": job.batches.state_dict()}
    iteration, loaded = load_checkpoint(load, job.stages, job.optimizer, extra, job.layout,
                                        job.groups.ep_rank)
    job.lr_schedule.load_state_dict(loaded["scheduler"])
    job.batches.load_state_dict(loaded["data"])
    say(f"resumed from {load} at iteration {iteration}")
    return iteration


def save(job: Job, iteration: int) -> str:
    """Write the checkpoint of ``iteration`` (every rank its shard); returns its directory."""
    args = job.args
    assert args.save is not None
    extra = {"scheduler": job.lr_schedule.state_dict(), "data": job.batches.state_dict()}
    info = {"schedule": job.schedule.name, "overlap": args.overlap_moe_expert_parallel_comm,
            "train_iters": args.train_iters}
    path = save_checkpoint(args.save, iteration, job.stages, job.optimizer, extra, job.layout,
                           job.groups.ep_rank, info)
    return str(path)
