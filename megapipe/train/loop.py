"""The training loop of one rank: build the job, resume, step, evaluate, save, log, exit.

``train(config)`` returns a ``TrainResult`` (the loss of every iteration it ran, evaluations,
checkpoints written, why it stopped early) so tests can compare runs bitwise. What it keeps per
iteration is bounded (the last ``history`` iterations), so a run of 10^5 iterations holds no
more than a short one; ``--manual-gc`` schedules Python's garbage collector (``manual_gc``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch.distributed as dist

from megapipe.parallel.groups import release_groups
from megapipe.parallel.launch import init_distributed
from megapipe.train.checkpoint.files import CheckpointError
from megapipe.train.checkpoint.resume import ResumeChoice, choose_resume, descriptor_parts
from megapipe.train.checkpoint.state import load_checkpoint, save_checkpoint
from megapipe.train.config.job_config import JobConfig
from megapipe.train.determinism import deterministic_kernels
from megapipe.train.exits import ExitPolicy
from megapipe.train.job import Job, build_job, describe
from megapipe.train.manual_gc import ManualCollector
from megapipe.train.observe.logging import TrainingLogger
from megapipe.train.observe.profiling import RunProfiler
from megapipe.train.step import evaluate, train_step

V = TypeVar("V")

HISTORY = 1000  # the most recent iterations (and lines, evaluations, saves) a result keeps


@dataclass
class TrainResult:
    """What one rank saw: the global mean loss of the iterations run, and the evaluations.

    Bounded: the per-iteration values, evaluations, saved checkpoints and log lines are kept for
    the last ``history`` of each (the log's first ``head`` lines, the run's description, stay);
    ``dropped`` iterations fell out, so ``losses[k]`` is iteration ``first_iteration + dropped +
    k + 1``; ``first_loss`` is the run's first loss.
    """

    first_iteration: int = 0
    losses: list[float] = field(default_factory=list)
    aux_losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    valid_losses: dict[int, float] = field(default_factory=dict)  # mean loss per token
    valid_bits_per_byte: dict[int, float | None] = field(default_factory=dict)
    saved: list[str] = field(default_factory=list)
    ran_again: list[int] = field(default_factory=list)  # the last iterations run again (below)
    reruns: int = 0  # iterations a rank capacity made run again, in all
    lines: list[str] = field(default_factory=list)
    exit_reason: str | None = None
    history: int = HISTORY
    dropped: int = 0
    first_loss: float | None = None
    head: int = 0

    def add_iteration(self, loss: float, aux_loss: float, grad_norm: float) -> None:
        """One iteration's global mean loss, auxiliary loss and gradient norm."""
        if self.first_loss is None:
            self.first_loss = loss
        for values, value in (
            (self.losses, loss),
            (self.aux_losses, aux_loss),
            (self.grad_norms, grad_norm),
        ):
            values.append(value)
        if len(self.losses) > self.history:
            for values in (self.losses, self.aux_losses, self.grad_norms):
                del values[0]
            self.dropped += 1

    def add_evaluation(self, iteration: int, loss: float, bits_per_byte: float | None) -> None:
        _keep_last_key(self.valid_losses, iteration, loss, self.history)
        _keep_last_key(self.valid_bits_per_byte, iteration, bits_per_byte, self.history)

    def add_ran_again(self, iteration: int) -> None:
        """An iteration whose rank capacity overflowed on some rank, so it ran again."""
        self.reruns += 1
        _keep_last(self.ran_again, iteration, self.history)

    def add_saved(self, path: str) -> None:
        _keep_last(self.saved, path, self.history)

    def add_line(self, line: str) -> None:
        _keep_last(self.lines, line, self.history, self.head)


def _keep_last(values: list[Any], value: Any, limit: int, head: int = 0) -> None:
    """Append ``value``; beyond ``head + limit`` items drop the oldest after the first ``head``."""
    values.append(value)
    if len(values) > head + limit:
        del values[head]


def _keep_last_key(values: dict[int, V], key: int, value: V, limit: int) -> None:
    """Set ``values[key]``; beyond ``limit`` entries drop the oldest."""
    values[key] = value
    if len(values) > limit:
        del values[next(iter(values))]


def train(
    config: JobConfig,
    write: Callable[[str], None] = print,
    choice: ResumeChoice | None = None,
    clock: Callable[[], float] = time.perf_counter,
    on_iteration: Callable[[int], None] | None = None,
) -> TrainResult:
    """Run one rank of the job (the default process group is started here if needed).

    ``choice`` is the resume decision made before the processes started (``choose_resume``); when
    it is None every rank makes it here, and the ranks check that they agree. ``clock`` times
    the steps the overlap's auto mode compares (tests script it). ``on_iteration(i)`` is called
    at the end of each iteration i (1-based) that does not end the run early (a benchmark's
    probe: ``benchmarks/long_run.py``).
    """
    with deterministic_kernels() if config.precision.deterministic else nullcontext():
        return _train(config, write, choice, clock, on_iteration)


def _train(
    config: JobConfig,
    write: Callable[[str], None],
    choice: ResumeChoice | None,
    clock: Callable[[], float],
    on_iteration: Callable[[int], None] | None,
) -> TrainResult:
    if not dist.is_initialized():
        init_distributed(timeout=config.failures.timeout)
    result = TrainResult()
    is_rank_0 = dist.get_rank() == 0

    def say(line: str) -> None:
        result.add_line(line)
        if is_rank_0:
            write(line)

    decided_here = choice is None  # then this rank tells the decision's warnings
    if choice is None:
        choice = choose_resume(config)
    job = build_job(config, start_from=choice.hf_dir, clock=clock)
    for line in describe(job):
        say(line)
    result.head = len(result.lines)
    try:
        with (
            ExitPolicy(config.failures, job.device) as exits,
            ManualCollector(config.collector) as collector,
        ):
            result.first_iteration = resume(job, say, choice, decided_here)
            _run(job, result, exits, collector, say, on_iteration)
    finally:
        job.close()  # the communication streams' threads
    # a finished run's groups; after a failure they stay (a peer may still be in a collective
    # on them) and the process ends with them
    release_groups(job.groups)
    return result


def _run(
    job: Job,
    result: TrainResult,
    exits: ExitPolicy,
    collector: ManualCollector,
    say: Callable[[str], None],
    on_iteration: Callable[[int], None] | None,
) -> None:
    """Iterations from ``result.first_iteration`` to the end, or to an early exit."""
    config, checkpoint, data = job.config, job.config.checkpoint, job.config.data
    iters = config.train_iters
    logger = TrainingLogger(
        iters,
        config.logging.interval,
        enabled=dist.get_rank() == 0,
        tensorboard_dir=config.logging.tensorboard_dir,
        write=say,
    )
    tokens_per_iter = data.global_batch_size * config.model.seq_length
    iteration = result.first_iteration
    started = time.perf_counter()
    profiler = RunProfiler(config, job.schedule, job.device, job.groups.coordinates, say)
    try:
        while iteration < iters:
            iteration += 1
            _train_iteration(job, result, iteration, profiler, logger, say, tokens_per_iter)
            if data.eval_interval and data.eval_iters and iteration % data.eval_interval == 0:
                with collector.around_evaluation():
                    validation = evaluate(job)
                result.add_evaluation(iteration, validation.loss, validation.bits_per_byte)
                logger.evaluation(iteration, validation.loss, validation.bits_per_byte)
            result.exit_reason = exits.reason(iteration)
            interval = checkpoint.save_interval
            due = interval is not None and interval != 0 and iteration % interval == 0
            final = iteration == iters or result.exit_reason is not None
            if checkpoint.save and (due or final):
                result.add_saved(save(job, iteration))
                say(f"saved checkpoint {result.saved[-1]}")
            if result.exit_reason is not None:
                saved = (
                    f"checkpoint {result.saved[-1]}" if checkpoint.save else "nothing (no --save)"
                )
                say(f"exiting after iteration {iteration}: {result.exit_reason}; saved {saved}")
                return
            collector.after_iteration(iteration)  # every rank is here, after the same work
            if on_iteration is not None:
                on_iteration(iteration)
        if result.losses:
            say(_done_line(job, result, iteration, logger, time.perf_counter() - started))
    finally:
        profiler.close()
        logger.close()


def _train_iteration(
    job: Job,
    result: TrainResult,
    iteration: int,
    profiler: RunProfiler,
    logger: TrainingLogger,
    say: Callable[[str], None],
    tokens: int,
) -> None:
    """Training step ``iteration`` (auto mode: on its trial's or its choice's executor), its
    log line and the trace's part of it."""
    start = time.perf_counter()
    auto = job.overlap_auto
    if auto is not None:  # plain or combined: its trial's, or its choice
        job.executor = auto.executor
        auto.start()
    stats = train_step(job, job.batches.next_batch(), iteration, profiler)
    decision = auto.finish() if auto is not None else None
    if decision is not None:
        say(decision)
    if stats.ran_again:
        result.add_ran_again(iteration)
        say(
            f"iter {iteration}: the rank capacity overflowed on some rank; the step ran "
            f"again without it ({result.reruns} so far)"
        )
    result.add_iteration(stats.loss, stats.aux_loss, stats.grad_norm)
    logger.record(
        iteration,
        loss=stats.loss,
        aux_loss=stats.aux_loss if stats.aux_loss == stats.aux_loss else None,
        lr=stats.lr,
        grad_norm=stats.grad_norm,
        step_time=time.perf_counter() - start,
        tokens=tokens,
        a2a_hidden=stats.a2a_hidden,
        a2a_exposed=stats.a2a_exposed,
        act_mem=stats.act_mem,
    )
    profiler.after(iteration)  # at M: gather the traced steps, write the trace


def _done_line(
    job: Job, result: TrainResult, iteration: int, logger: TrainingLogger, seconds: float
) -> str:
    """The run's last line: iterations, time, first and last loss, overlap, graphs, reruns."""
    overlap = logger.overlap_summary()
    graphs = job.executor.cuda_graphs
    return (
        f"done: iterations {result.first_iteration + 1}-{iteration} in {seconds:.0f} s; "
        f"loss {result.first_loss:.4f} -> {result.losses[-1]:.4f}"
        + ("" if overlap is None else f"; {overlap}")
        + ("" if graphs is None else f"; CUDA graphs: {graphs.describe()}")
        + (
            ""
            if job.config.model.moe_expert_rank_capacity_factor is None
            else f"; steps run again without the rank capacity: {result.reruns}"
        )
    )


def resume(
    job: Job, say: Callable[[str], None], choice: ResumeChoice, tell_warnings: bool = False
) -> int:
    """Load the checkpoint the resume choice names into the job; returns its iteration (0: none,
    the weights the job was built with: its seed's, or ``--load-hf``'s)."""
    if tell_warnings:
        for line in choice.warnings:
            say(line)
    _check_ranks_agree(choice)
    if choice.checkpoint is None:
        if choice.note:
            say(choice.note)
        return 0
    extra = {"scheduler": job.lr_schedule.state_dict(), "data": job.batches.state_dict()}
    loaded = load_checkpoint(
        choice.checkpoint.path, job.stages, job.optimizer, extra, choice.saved_world
    )
    job.lr_schedule.load_state_dict(loaded["scheduler"])
    job.batches.load_state_dict(loaded["data"])
    say(f"resumed from {choice.checkpoint.path} at iteration {choice.checkpoint.iteration}")
    return choice.checkpoint.iteration


def _check_ranks_agree(choice: ResumeChoice) -> None:
    """Every rank resumes the same checkpoint (a shared filesystem seen alike by all)."""
    mine = None if choice.checkpoint is None else str(choice.checkpoint.path)
    everyone: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if len(set(everyone)) > 1:
        raise CheckpointError(
            "the ranks chose different checkpoints to resume: "
            + "; ".join(f"rank {r}: {c}" for r, c in enumerate(everyone))
        )


def save(job: Job, iteration: int) -> str:
    """Write the checkpoint of ``iteration`` (every rank its shard); returns its directory."""
    checkpoint = job.config.checkpoint
    assert checkpoint.save is not None
    extra = {"scheduler": job.lr_schedule.state_dict(), "data": job.batches.state_dict()}
    info = {"train_iters": job.config.train_iters}
    descriptor = descriptor_parts(job.config, job.schedule.name, info)
    if job.dp_sync is not None:
        job.dp_sync.finish_param_gather()  # the whole updated model, on every rank
    path = save_checkpoint(
        checkpoint.save,
        iteration,
        job.stages,
        job.optimizer,
        extra,
        descriptor,
        checkpoint.keep_last,
    )
    return str(path)
