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
    groups = [dist.new_group(list(range(dist.get_world_size()))) for _ in range(count)]
    for group in groups:
        dist.all_reduce(torch.ones(1), group=group)
    return len(groups)


def test_a_pool_past_the_thread_limit_starts_afresh(monkeypatch):
    """Each gloo group keeps threads until its process ends; past THREAD_LIMIT the pool
    replaces its ranks before the next task, which then runs as usual."""
    from support import rank_pool

    with rank_pool.RankPool(2) as pool:
        monkeypatch.setattr(rank_pool, "THREAD_LIMIT", pool.most_threads() + 10)
        first = [p.pid for p in pool._procs]
        assert pool.run(_make_groups, 2) == [2, 2]
        assert [p.pid for p in pool._procs] == first  # under the limit: the same ranks
        pool.run(_make_groups, 10)
        assert pool.most_threads() > rank_pool.THREAD_LIMIT
        assert pool.run(_allreduce_rank) == [(0, 1.0), (1, 1.0)]
        assert [p.pid for p in pool._procs] != first
        assert pool.most_threads() <= rank_pool.THREAD_LIMIT


def test_an_idle_pool_with_many_threads_is_closed_when_another_is_asked_for(rank_pools,
                                                                          monkeypatch):
    """Idle gloo threads still cost CPU: asking for one pool closes another that has been idle
    past IDLE_SECONDS with more than IDLE_THREADS threads; its next task starts it again."""
    settings = type(rank_pools).__call__.__globals__  # tests/conftest.py's (not a folder's)
    pools = type(rank_pools)()  # its own registry: the session's pools are left alone
    try:
        first = pools(1, "first")
        monkeypatch.setitem(settings, "IDLE_THREADS", first.most_threads() + 3)
        monkeypatch.setitem(settings, "IDLE_SECONDS", 0.0)
        assert pools(1, "second").run(_make_groups, 1) == [1]
        assert first.running()  # a few threads only: kept
        first.run(_make_groups, 3)
        second = pools(1, "second")
        assert not first.running() and second.running()
        assert first.run(_allreduce_rank) == [(0, 0.0)]  # started again
        assert first.running()
    finally:
        pools.close_all()
