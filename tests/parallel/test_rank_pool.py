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
