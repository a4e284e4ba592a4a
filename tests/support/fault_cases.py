"""Rank-side code for the failure tests: a rank that stops calling, and early exits.

Every function runs inside the ranks of a ``RankPool``. A stuck collective runs on a dedicated
group of ranks 0 and 1 with a short timeout, which is then abandoned, so the pool's other groups
stay usable.
"""

from __future__ import annotations

import datetime
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn

import megapipe.train.loop as loop
from megapipe.moe.dispatcher import TokenDispatcher
from megapipe.overlap.streams import WorkerStream
from megapipe.parallel.config import ParallelConfig
from megapipe.parallel.groups import assemble_groups, rank_grid
from megapipe.pipeline.grad_sync import all_reduce_grads
from megapipe.pipeline.p2p import CommOp, PipelineP2P, TensorSpec
from megapipe.schedule.ir import parse_action
from megapipe.train.config.parse import parse_pretrain_args
from megapipe.train.failures import describe_failure


def _stuck(timeout: float, what) -> tuple[str, float] | None:
    """Rank 0 calls ``what(group)`` on a group where rank 1 never calls; (its line, seconds)."""
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=timeout))
    outcome = None
    if dist.get_rank() == 0:
        started = time.monotonic()
        try:
            what(group)
        except Exception as err:  # what the training app would report
            outcome = (describe_failure(err, 0), time.monotonic() - started)
    dist.barrier()
    return outcome


def _receive(group) -> None:
    p2p = PipelineP2P(group, (0, 1), (0, 1), lambda s, m: TensorSpec((2,)), timeout=1.0,
                      wait_mode="poll")
    p2p.post([CommOp(parse_action("1RECV_F0"), 1, torch.empty(2))]).wait()


def _all_to_all(group) -> None:
    dispatcher = TokenDispatcher(num_experts=2, ep_group=group)
    stream = WorkerStream("comm")  # as in a combined step: the all-to-all on the comm thread
    try:
        stream.submit(dispatcher.dispatch, torch.ones(3, 4), torch.tensor([2, 1])).synchronize()
    finally:
        stream.close()


def _gradient_reduction(group) -> None:
    grid = rank_grid(ParallelConfig(pp=1, dp=2, ep=1))
    groups = assemble_groups(grid, 0, lambda name, ranks: group)
    stage = nn.Linear(2, 2)
    stage(torch.ones(1, 2)).sum().backward()
    all_reduce_grads({0: stage}, groups)


def stuck_waits(timeout: float) -> dict[str, tuple[str, float]] | None:
    """What rank 0 says when rank 1 stops calling in each of the three waits."""
    cases = {"pipeline receive": _receive, "all-to-all": _all_to_all,
             "gradient reduction": _gradient_reduction}
    results = {name: _stuck(timeout, what) for name, what in cases.items()}
    return results if dist.get_rank() == 0 else None


def train_with_signal(argv: list[str], signal_at: int | None = None):
    """``train`` on every rank; rank 1 receives SIGTERM during iteration ``signal_at``."""
    args = parse_pretrain_args(argv, env={})
    real_step = loop.train_step

    def step(job, batch, iteration, *rest):
        if iteration == signal_at and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(job, batch, iteration, *rest)

    loop.train_step = step
    try:
        return loop.train(args, write=lambda line: None)
    finally:
        loop.train_step = real_step
