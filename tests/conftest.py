"""Shared fixtures: long-lived gloo process pools, one per world size, started on first use."""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def rank_pools():
    """``rank_pools(n)`` returns a RankPool of n gloo processes, kept for the whole session."""
    from support.rank_pool import RankPool

    pools = {}

    def get(world_size: int) -> RankPool:
        if world_size not in pools:
            pools[world_size] = RankPool(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.stop()
    for pool in pools.values():
        pool.close()
