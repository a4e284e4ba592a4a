import pytest
import torch
import torch.distributed as dist

from support.rank_pool import RankError


def _allreduce_rank():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on one")
    return 0


def test_pool_runs_collectives_and_returns_in_rank_order(rank_pools):
    assert rank_pools(2).run(_allreduce_rank) == [(0, 1.0), (1, 1.0)]


def test_pool_reports_failing_rank_traceback(rank_pools):
    with pytest.raises(RankError, match=r"(?s)ranks \[1\].*boom on one"):
        rank_pools(2).run(_fail_on_rank_one)
    # the pool stays usable after a task failed
    assert rank_pools(2).run(_allreduce_rank)[1] == (1, 1.0)


def _make_groups(count):
    groups = [dist.new_group([0, 1]) for _ in range(count)]
    for group in groups:
        dist.all_reduce(torch.ones(1), group=group)
    return len(groups)


def test_a_pool_past_the_thread_limit_starts_afresh(rank_pools, monkeypatch):
    """Each gloo group keeps threads until its process ends; past THREAD_LIMIT the pool
    replaces its ranks before the next task, which then runs as usual (the shared pool of 2:
    it is left with fresh ranks)."""
    from support import rank_pool

    pool = rank_pools(2)
    pool.run(_allreduce_rank)  # joined: its threads counted from here
    monkeypatch.setattr(rank_pool, "THREAD_LIMIT", pool._most_threads() + 10)
    first = [p.pid for p in pool._procs]
    assert pool.run(_make_groups, 2) == [2, 2]
    assert [p.pid for p in pool._procs] == first  # under the limit: the same ranks
    pool.run(_make_groups, 10)
    assert pool._most_threads() > rank_pool.THREAD_LIMIT
    assert pool.run(_allreduce_rank) == [(0, 1.0), (1, 1.0)]
    assert [p.pid for p in pool._procs] != first
    assert pool._most_threads() <= rank_pool.THREAD_LIMIT


def _die_on_rank_one():
    import os
    import signal

    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as a crash would: no traceback, no result
    dist.barrier()  # rank 0 waits for the dead rank, as a collective would


def test_a_rank_that_dies_is_named_at_once_and_the_pool_starts_afresh(rank_pools):
    """A rank killed mid-task (a segfault, the OOM killer) ends the task with its name and
    exit code instead of a wait to the timeout; the next task runs on fresh ranks."""
    pool = rank_pools(2)
    pool.timeout, limit = 60.0, pool.timeout  # a missed death would end in "did not finish"
    try:
        with pytest.raises(RankError, match=r"ranks \[1\] died \(exit codes \[-9\]"):
            pool.run(_die_on_rank_one)
    finally:
        pool.timeout = limit
    assert pool.run(_allreduce_rank) == [(0, 1.0), (1, 1.0)]
