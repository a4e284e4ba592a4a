"""Shared fixtures: long-lived gloo process pools, one per world size, started on first use;
and the ``heavy`` marker: sweeps that take minutes (every kernel at users' shapes and compiled
for sm_90/sm_100, every section of the GPU check's dry run) are deselected unless
``MEGAPIPE_HEAVY=1``:

    MEGAPIPE_HEAVY=1 .venv/bin/python -m pytest -m heavy
"""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
HEAVY = os.environ.get("MEGAPIPE_HEAVY") == "1"


def pytest_configure(config):
    config.addinivalue_line("markers", "heavy: a sweep of minutes, run with MEGAPIPE_HEAVY=1")


def pytest_collection_modifyitems(config, items):
    if HEAVY:
        return
    drop = [item for item in items if item.get_closest_marker("heavy")]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [item for item in items if not item.get_closest_marker("heavy")]


class RankPools:
    """``pools(n)``: a RankPool of n gloo processes, kept for the whole session.
    ``pools(n, tag, env)``: a separate pool for one purpose (e.g. one Megatron-Core release,
    whose processes import it), with extra environment variables; ``close(n, tag)`` ends it
    early, once its tests are done."""

    def __init__(self) -> None:
        self._pools = {}

    def __call__(self, world_size: int, tag: str | None = None, env: dict | None = None):
        from support.rank_pool import RankPool

        key = (world_size, tag)
        if key not in self._pools:
            self._pools[key] = RankPool(world_size, env=env)
        return self._pools[key]

    def close(self, world_size: int, tag: str | None = None) -> None:
        pool = self._pools.pop((world_size, tag), None)
        if pool is not None:
            pool.close()

    def close_all(self) -> None:
        """At the session's end (``RankPool.close`` kills the ranks)."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


@pytest.fixture(scope="session")
def rank_pools():
    """Long-lived gloo process pools, one per world size (and tag): see ``RankPools``."""
    pools = RankPools()
    yield pools
    pools.close_all()
