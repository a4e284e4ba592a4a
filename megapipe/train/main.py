"""``megapipe pretrain``: validate every flag, then run as one rank or start the ranks here.

``main(argv)`` turns the flags into ``PretrainArgs`` (one line and exit 2 on a bad one, before
any process group), refuses a checkpoint of another layout, and then either trains as one rank
(when torchrun or srun launched this process) or starts ``world_size`` local processes and
trains one rank in each.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from megapipe.parallel.launch import RankExited, launched_world_size, start_local_ranks
from megapipe.train.args import ArgsError, PretrainArgs, args_from_namespace, parse_pretrain_args
from megapipe.train.checkpoint import CheckpointError, check_layout, latest_iteration
from megapipe.train.job import checkpoint_layout
from megapipe.train.logging import NonFiniteLossError
from megapipe.train.loop import train


def main(argv: Sequence[str] | None = None) -> int:
    """``examples/pretrain_moe_gpt.py``: parse, validate, launch, train; returns the exit code."""
    return _validate_then_run(parse_pretrain_args, argv)


def main_from_namespace(ns: argparse.Namespace) -> int:
    """``megapipe pretrain`` (the CLI parsed the flags with ``build_parser(add_help=False)``)."""
    return _validate_then_run(args_from_namespace, ns)


def _validate_then_run(to_args: Callable[[Any], PretrainArgs], source: Any) -> int:
    """Turn flags into PretrainArgs (one clear line and exit code 2 if they are bad), then run."""
    try:
        args = to_args(source)
    except ArgsError as err:
        print(f"megapipe pretrain: error: {err}", file=sys.stderr)
        return 2
    return run(args)


def run(args: PretrainArgs) -> int:
    """Check a checkpoint to resume from, then train as this rank or start the ranks here."""
    try:
        if args.load is not None and latest_iteration(args.load) is not None:
            check_layout(args.load, checkpoint_layout(args))
    except CheckpointError as err:
        print(f"megapipe pretrain: error: {err}", file=sys.stderr)
        return 2
    missing = missing_gpus(args)
    if missing is not None:
        print(f"megapipe pretrain: error: {missing}", file=sys.stderr)
        return 2
    if launched_world_size() is not None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if not torch.cuda.is_available():
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
        _run_rank(args)
        return 0
    threads = max(1, (os.cpu_count() or 1) // args.world_size)
    try:
        start_local_ranks(_local_rank, args.world_size, (args,), threads=threads).join()
    except RankExited as err:
        print(f"megapipe pretrain: error: {err}", file=sys.stderr)
        return 1
    return 0


def missing_gpus(args: PretrainArgs) -> str | None:
    """With CUDA, the processes this node would run (the launcher's LOCAL_WORLD_SIZE, else the
    ranks started here) must not outnumber its GPUs; the reason if they do, else None."""
    if not torch.cuda.is_available():
        return None
    launched = launched_world_size() is not None
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if launched else args.world_size
    count = torch.cuda.device_count()
    if per_node <= count:
        return None
    asked = "LOCAL_WORLD_SIZE" if launched else "--nproc (default pp x ep)"
    return (
        f"{per_node} processes on this node ({asked}) but it has {count} GPU(s); each rank "
        "needs its own GPU"
    )


def _local_rank(rank: int, args: PretrainArgs) -> None:
    """A process ``run`` started: one rank of the job (torchrun's variables are set)."""
    _run_rank(args)


def _run_rank(args: PretrainArgs) -> None:
    """Train as this rank; a NaN loss (seen by every rank alike) ends it with one line."""
    try:
        train(args)
    except NonFiniteLossError as err:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"megapipe pretrain: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
