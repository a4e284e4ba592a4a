"""``megapipe pretrain``: validate every flag, decide the resume, then run the ranks.

``main(argv)`` turns the flags into the typed ``JobConfig`` and picks the checkpoint to resume
(``resume.choose_resume``): a bad flag, path or checkpoint prints one line and exits 2 before any
process group exists. Then it trains as one rank (when torchrun or srun launched this process)
or starts ``world_size`` local processes and supervises them (``supervise``). A failure inside
a rank reaches the user as one line naming the rank and the cause (``failures``); the full
traceback only with ``MEGAPIPE_DEBUG=1``. Exit codes: 0 done (or saved and exited early),
1 a rank failed, 2 bad input, 130 interrupted, 143 stopped by SIGTERM.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megapipe.data.errors import DataError
from megapipe.parallel.launch import launched_world_size, start_local_ranks
from megapipe.train.checkpoint.files import CheckpointError
from megapipe.train.checkpoint.resume import ResumeChoice, choose_resume
from megapipe.train.config.job_config import JobConfig
from megapipe.train.config.parse import ArgsError, parse_pretrain_args
from megapipe.train.failures import debug_enabled, describe_failure, is_secondary
from megapipe.train.loop import train
from megapipe.train.observe.logging import NonFiniteLossError
from megapipe.train.supervise import run_local, write_report

PROG = "megapipe pretrain"
Report = Callable[[str, bool], None]
"""``report(line, secondary)``: where a failing rank says what happened."""


def main(argv: Sequence[str] | None = None) -> int:
    """``examples/pretrain_moe_gpt.py``: parse, validate, launch, train; returns the exit code."""
    return _validate_then_run(parse_pretrain_args, argv)


def _error(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)


def _validate_then_run(to_config: Callable[[Any], JobConfig], source: Any) -> int:
    """Turn flags into the config (one clear line and exit code 2 if they are bad), then run."""
    try:
        config = to_config(source)
    except (ArgsError, DataError) as err:  # one line each
        _error(str(err))
        return 2
    return run(config)


def run(config: JobConfig) -> int:
    """Decide the resume, then train as this rank or start and supervise the ranks here."""
    try:
        choice = choose_resume(config)
    except (CheckpointError, DataError) as err:
        _error(str(err))
        return 2
    world_size = config.parallel.world_size
    problem = missing_gpus(world_size)
    if problem is not None:
        _error(problem)
        return 2
    launched = launched_world_size() is not None
    if not launched or int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0:
        for line in choice.warnings:
            print(f"{PROG}: {line}", file=sys.stderr, flush=True)
    if launched:
        local = _local_world_size()
        if not torch.cuda.is_available():
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
        return run_rank(config, choice, _print_report)
    threads = max(1, (os.cpu_count() or 1) // world_size)

    def start(folder: Path) -> list[Any]:
        return start_local_ranks(
            _local_rank, world_size, (config, choice, str(folder)), threads=threads
        ).processes

    return run_local(start, config.failures.exit_signal_handler, _error)


def _local_world_size() -> int:
    """Processes on this host: torchrun's LOCAL_WORLD_SIZE, or srun's tasks per host."""
    text = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE", "1")
    match = re.match(r"\d+", text)  # Slurm may write "2(x3)"
    return max(1, int(match.group())) if match else 1


def _print_report(line: str, secondary: bool) -> None:
    _error(line)


def missing_gpus(world_size: int) -> str | None:
    """With CUDA, the processes this host would run (the launcher's, else the ranks started
    here) must not outnumber its GPUs; the reason if they do, else None."""
    if not torch.cuda.is_available():
        return None
    launched = launched_world_size() is not None
    per_node = _local_world_size() if launched else world_size
    count = torch.cuda.device_count()
    if per_node <= count:
        return None
    asked = "LOCAL_WORLD_SIZE" if launched else "--nproc (default pp x ep)"
    return (
        f"{per_node} processes on this host ({asked}) but it has {count} GPU(s); each rank "
        "needs its own GPU"
    )


def _local_rank(rank: int, config: JobConfig, choice: ResumeChoice, folder: str) -> None:
    """A process ``run`` started: one rank of the job (torchrun's variables are set)."""

    def report(line: str, secondary: bool) -> None:
        write_report(Path(folder), rank, line, secondary)

    code = run_rank(config, choice, report)
    if code:
        raise SystemExit(code)


def run_rank(config: JobConfig, choice: ResumeChoice | None, report: Report) -> int:
    """Train as this rank; a failure becomes one reported line and exit code 1 (130: Ctrl-C)."""
    try:
        train(config, choice=choice)
        return 0
    except BaseException as err:  # every failure is told, none as a bare traceback
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        if debug_enabled():
            traceback.print_exc()
        if not isinstance(err, NonFiniteLossError) or rank == 0:  # NaN: every rank sees it
            report(describe_failure(err, rank), is_secondary(err))
        return 130 if isinstance(err, KeyboardInterrupt) else 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
