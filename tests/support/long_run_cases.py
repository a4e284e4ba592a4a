"""Rank-side code of ``tests/train/test_long_runs.py`` (run in a ``RankPool``)."""

from __future__ import annotations

import gc

from megapipe.train import manual_gc
from megapipe.train.config.parse import parse_pretrain_args
from megapipe.train.job import build_job
from megapipe.train.loop import train
from megapipe.train.step import evaluate, train_step
from support.cyclic_garbage import cyclic_garbage


def pretrain_step_garbage(argv: list[str]) -> dict[str, int]:
    """What the cyclic collector finds after two pretrain steps and an evaluation."""
    job = build_job(parse_pretrain_args(argv, env={}))
    try:
        def work() -> None:
            for iteration in (1, 2):
                train_step(job, job.batches.next_batch(), iteration)
            evaluate(job)

        return cyclic_garbage(work)
    finally:
        job.close()


def collections_seen(argv: list[str]) -> dict:
    """Train with ``argv``. At the end of each iteration: whether automatic collection is on
    and (from the second on) how many collections of generations 0 and 2 ran since the last
    iteration's end; after the run, whether it is on again."""
    enabled, deltas, last = [], [], []

    def probe(iteration: int) -> None:
        stats = gc.get_stats()
        now = (stats[0]["collections"], stats[2]["collections"])
        enabled.append(gc.isenabled())
        if last:
            deltas.append((now[0] - last[-1][0], now[1] - last[-1][1]))
        last.append(now)

    train(parse_pretrain_args(argv, env={}), write=lambda line: None, on_iteration=probe)
    return {"enabled": enabled, "deltas": deltas, "enabled_after": gc.isenabled()}


def trims_seen(argv: list[str]) -> dict[str, list]:
    """Train with ``argv``, glibc replaced by a recorder: the iterations at whose end the C heap
    was trimmed (each call's argument must be 0: trim everything) and the ``mallopt`` calls."""
    calls: list[int] = []
    trimmed: list[int] = []
    options: list[tuple[int, int]] = []

    class RecordingGlibc:
        def malloc_trim(self, pad: int) -> int:
            assert pad == 0, pad
            calls.append(pad)
            return 1

        def mallopt(self, param: int, value: int) -> int:
            assert not trimmed, "mallopt after the first iteration"
            options.append((param, value))
            return 1

    def probe(iteration: int) -> None:
        if len(calls) > len(trimmed):
            trimmed.append(iteration)
        assert len(calls) == len(trimmed), (calls, trimmed)  # at most one per iteration

    real = manual_gc._glibc
    manual_gc._glibc = RecordingGlibc
    try:
        train(parse_pretrain_args(argv, env={}), write=lambda line: None, on_iteration=probe)
    finally:
        manual_gc._glibc = real
    return {"trimmed": trimmed, "mallopt": options}
