import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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


def _state(pid):
    """A process's state letter (T: stopped, Z: exited, not yet reaped); "gone" once reaped."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def _wait_until(done, seconds=30.0):
    """Poll ``done()`` until true or ``seconds`` pass (a signal takes effect when the kernel
    next runs the process)."""
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_pool_is_stopped_between_tasks_and_runs_the_next(rank_pools):
    """Idle ranks take no CPU: each gloo group's event loop wakes every 10 ms, so a pool with
    many groups, kept for the session, would tax every test that runs meanwhile."""
    pool = rank_pools(2)
    pool.run(_allreduce_rank)
    _wait_until(lambda: {_state(p.pid) for p in pool._procs} == {"T"})
    assert [_state(p.pid) for p in pool._procs] == ["T", "T"]  # stopped
    assert pool.run(_allreduce_rank) == [(0, 1.0), (1, 1.0)]


def test_a_stopped_pool_ends_with_its_test_process(tmp_path):
    """A stopped rank cannot notice that the process that made its pool died (a killed test
    run): the kernel kills it then, so no stopped rank outlives the run."""
    tests = Path(__file__).resolve().parents[1]
    code = ("import os, sys, torch.distributed as dist\n"
            "from support.rank_pool import RankPool\n"
            "pool = RankPool(1)\n"
            "pool.run(dist.get_rank)\n"
            "print(pool._procs[0].pid, flush=True)\n"
            "sys.stdin.read()\n")
    paths = [str(tests), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
    rank = int(child.stdout.readline())
    _wait_until(lambda: _state(rank) == "T")
    assert _state(rank) == "T"
    child.send_signal(signal.SIGKILL)
    child.wait()
    _wait_until(lambda: _state(rank) in ("Z", "gone"))
    assert _state(rank) in ("Z", "gone")


def _segfault_on_rank_one():
    import ctypes

    if dist.get_rank() == 1:
        ctypes.string_at(0)  # reads address 0: SIGSEGV, as a crash in C++ code would
    dist.barrier()


def test_a_rank_that_crashes_is_named_with_its_python_stack(rank_pools):
    """A segfault names the rank, its signal and where its threads were (faulthandler)."""
    pool = rank_pools(2)
    crash = (r"(?s)ranks \[1\] died \(exit codes \[-11\].*"
             r"rank 1 crashed:.*Segmentation fault.*_segfault_on_rank_one")
    with pytest.raises(RankError, match=crash):
        pool.run(_segfault_on_rank_one)
    assert pool.run(_allreduce_rank) == [(0, 1.0), (1, 1.0)]
