"""Long runs (issue 41): no reference cycles in a pretrain step, ``--manual-gc`` with
Megatron's meaning, and a ``TrainResult`` that stays bounded however long the run."""

from __future__ import annotations

import gc

import pytest

from megapipe.train import manual_gc
from megapipe.train.config.job_config import CollectorConfig
from megapipe.train.config.parse import ArgsError, parse_pretrain_args
from megapipe.train.loop import TrainResult
from megapipe.train.manual_gc import M_MMAP_THRESHOLD, MMAP_THRESHOLD, ManualCollector, _glibc
from support.long_run_cases import collections_seen, pretrain_step_garbage, trims_seen
from support.pretrain_flags import TINY


def _run(pool, fn, argv: list[str]) -> list:
    """``pool.run(fn, argv)`` with room for a busy machine: a short run of 4 ranks takes seconds
    alone and minutes when the suite and other jobs share 2 cores (the pool's 120 s limit is a
    hang guard, not what the tests assert)."""
    limit, pool.timeout = pool.timeout, max(pool.timeout, 600.0)
    try:
        return pool.run(fn, argv)
    finally:
        pool.timeout = limit


def test_a_pretrain_step_leaves_no_cyclic_garbage(rank_pools):
    """The default shape (pp 2, vpp 2, ep 2, dp 2, overlap on with its node trace), deferred
    weight gradients: two steps and an evaluation leave nothing to the cyclic collector."""
    for rank, found in enumerate(_run(
            rank_pools(4), pretrain_step_garbage, TINY + ["--delay-wgrad-compute"])):
        assert found == {}, f"rank {rank}: {found}"


def test_manual_gc_collects_at_the_same_points_on_every_rank(rank_pools):
    """Automatic collection off during the run and on again after it; (generation 0,
    generation 2) collections per iteration from the second: with an evaluation at 2, a full
    collection before it, a young one after it, and the interval's full one at the end."""
    argv = TINY + ["--manual-gc", "--log-interval", "4"]
    for seen in _run(rank_pools(4), collections_seen, argv + [
            "--train-iters", "3", "--eval-interval", "2", "--manual-gc-interval", "2"]):
        assert seen["enabled"] == [False] * 3 and seen["enabled_after"], seen
        assert seen["deltas"] == [(1, 2), (0, 0)], seen
    for seen in _run(rank_pools(4), collections_seen, argv + [
            "--train-iters", "2", "--eval-interval", "1", "--manual-gc-interval", "1",
            "--no-manual-gc-eval"]):
        assert seen["deltas"] == [(0, 1)], seen


def test_the_heap_is_trimmed_every_n_iterations_on_every_rank(rank_pools):
    """By default (no --manual-gc) malloc_trim(0) at the end of every N-th iteration, on each
    rank, through the real loop: at 2 and 4 of 5 iterations, neither every iteration nor at the
    run's end. What the trims are counted at is the iteration, never a time, so load (which
    made the pool's time limit end it once) changes nothing but how long it takes.
    glibc's mmap threshold pinned at 128 KiB once, before the first iteration.
    --heap-trim-interval 0 (never) is the collector's own test below, on the parsed flag."""
    argv = TINY + ["--log-interval", "4", "--train-iters", "5", "--heap-trim-interval", "2"]
    pinned = [(M_MMAP_THRESHOLD, MMAP_THRESHOLD)]
    assert _run(rank_pools(4), trims_seen, argv) == [{"trimmed": [2, 4], "mallopt": pinned}] * 4


@pytest.mark.parametrize("flags,message", [
    (["--manual-gc-interval", "10"], "--manual-gc-interval=10 needs --manual-gc"),
    (["--no-manual-gc-eval"], "--no-manual-gc-eval needs --manual-gc"),
    (["--manual-gc", "--manual-gc-interval", "-1"], "--manual-gc-interval=-1 must be >= 0"),
    (["--heap-trim-interval", "-1"], "--heap-trim-interval=-1 must be >= 0"),
])
def test_manual_gc_flags_are_checked(flags, message):
    with pytest.raises(ArgsError, match=message):
        parse_pretrain_args(flags, env={})
    config = parse_pretrain_args(["--manual-gc", "--manual-gc-interval", "5"], env={})
    assert (config.collector.manual, config.collector.interval, config.collector.at_eval) == \
        (True, 5, True)
    assert parse_pretrain_args([], env={}).collector.trim_interval == 100  # on by default


def test_a_train_result_keeps_a_fixed_window():
    result = TrainResult(history=3)
    for i in range(10):
        result.add_iteration(float(i), 0.1 * i, 1.0 + i)
        result.add_evaluation(i + 1, float(i), None)
        result.add_saved(f"iter_{i + 1}")
    assert result.losses == [7.0, 8.0, 9.0] and result.grad_norms == [8.0, 9.0, 10.0]
    assert len(result.aux_losses) == 3 and result.dropped == 7 and result.first_loss == 0.0
    assert list(result.valid_losses) == [8, 9, 10] and list(result.valid_bits_per_byte) == [
        8,
        9,
        10,
    ]
    assert result.saved == ["iter_8", "iter_9", "iter_10"]
    result.add_line("model: ...")
    result.head = 1  # the run's description stays
    for i in range(10):
        result.add_line(f"iter {i}")
    assert result.lines == ["model: ...", "iter 7", "iter 8", "iter 9"]


def test_the_collector_collects_and_trims_at_its_intervals():
    with ManualCollector(CollectorConfig(manual=True, interval=2, trim_interval=3)) as collector:
        assert not gc.isenabled()
        for iteration in range(1, 6):
            collector.after_iteration(iteration)
        with collector.around_evaluation():
            pass
    assert gc.isenabled()
    assert collector.collections == 1 + 2 + 2  # the start, iterations 2 and 4, the evaluation
    assert collector.trims == (1 if _glibc() is not None else 0)  # iteration 3
    with ManualCollector(CollectorConfig(trim_interval=2)) as automatic:  # trims, no collection
        assert gc.isenabled()
        for iteration in range(1, 6):
            automatic.after_iteration(iteration)
    assert automatic.collections == 0
    assert automatic.trims == (2 if _glibc() is not None else 0)
    with ManualCollector(CollectorConfig()) as off:  # neither: nothing changes
        assert gc.isenabled()
        off.after_iteration(2)
    assert off.collections == off.trims == 0
    never = parse_pretrain_args(["--heap-trim-interval", "0"], env={}).collector
    with ManualCollector(never) as untrimmed:  # --heap-trim-interval 0: never trimmed
        for iteration in range(1, 201):
            untrimmed.after_iteration(iteration)
    assert (never.trim_interval, untrimmed.trims, untrimmed.collections) == (0, 0, 0)


def test_the_mmap_threshold_is_pinned_with_the_trim_and_glibc_left_alone_without(monkeypatch):
    """--heap-trim-interval N > 0 pins glibc's mmap threshold once, when the run starts; 0
    touches neither mallopt nor malloc_trim."""
    calls: list[tuple] = []

    class Recording:
        def mallopt(self, param: int, value: int) -> int:
            calls.append(("mallopt", param, value))
            return 1

        def malloc_trim(self, pad: int) -> int:
            calls.append(("malloc_trim", pad))
            return 1

    monkeypatch.setattr(manual_gc, "_glibc", Recording)
    with ManualCollector(CollectorConfig(trim_interval=2)) as trimmed:
        assert calls == [("mallopt", M_MMAP_THRESHOLD, MMAP_THRESHOLD)]
        trimmed.after_iteration(1)
        trimmed.after_iteration(2)
    assert calls[1:] == [("malloc_trim", 0)]
    calls.clear()
    with ManualCollector(CollectorConfig(trim_interval=0)) as untouched:
        untouched.after_iteration(2)
    assert calls == []
