"""Run a function on N gloo processes on CPU: the multi-process test helper.

``RankPool(n)`` starts n processes once (starting torch costs seconds) with
``megapipe.parallel.launch.start_local_ranks``, joins them into a gloo world, and then runs many
tasks: ``pool.run(fn, *args)`` calls ``fn(*args)`` on every rank and returns the per-rank
results in rank order. ``fn`` must be importable (a module-level function). If any rank raises,
``run`` raises ``RankError`` carrying that rank's traceback; a task that outlives ``timeout``
kills the pool and says so, so nothing hangs silently.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import queue
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from megapipe.parallel.launch import start_local_ranks


class RankError(RuntimeError):
    """A task failed on some rank; the message holds the first failing rank's traceback."""


def _serve(rank: int, task_queues: list[Any], results: Any, store_file: str) -> None:
    """A pool process: join the gloo world, then run this rank's tasks until the pool kills it.

    The ranks meet through a file, not a TCP port: a port picked free by the parent can be
    taken by another process (another test run on the machine) before rank 0 binds it."""
    import torch.distributed as dist

    tasks = task_queues[rank]
    parent = os.getppid()
    _die_with_parent()
    # a crash (a segfault, an abort) leaves every thread's Python stack where the pool reads it
    faulthandler.enable(open(_fault_file(os.path.dirname(store_file), rank), "w"))  # noqa: SIM115

    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank,
                            world_size=len(task_queues))
    results.put((rank, None, "joined"))
    while True:
        try:
            item = tasks.get(timeout=5.0)
        except queue.Empty:  # a pool whose test process was killed ends too (gloo's idle
            if os.getppid() != parent:  # threads would keep a core busy for nothing)
                os._exit(0)
            continue
        fn, args, kwargs = item
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # report every failure, including assertion errors
            results.put((rank, False, traceback.format_exc()))


def _fault_file(folder: str, rank: int) -> str:
    """Where rank ``rank`` of the pool whose store lives in ``folder`` writes a crash's stacks
    (the file stays open for the rank's life)."""
    return os.path.join(folder, f"fault_{rank}.txt")


def _die_with_parent() -> None:
    """A rank stopped between tasks cannot see its test process die: the kernel kills it then
    (Linux's PR_SET_PDEATHSIG; elsewhere the rank ends when it next finds its parent gone)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return


# Between tasks a pool's ranks are stopped (SIGSTOP) and continued (SIGCONT) when the next task
# comes: each gloo group keeps an event loop that wakes every 10 ms, and the idle ranks of the
# pools a session keeps took 15-35 % of a core from the tests that ran meanwhile. Every rank
# has returned from the task, so none is inside a collective its peers wait on; a stopped
# process resumes where it stopped.

# gloo keeps about three threads per process group until its process ends (cases build their
# own groups), and idle ones still cost CPU: 450 threads on each of 4 ranks kept 0.65 of a core
# busy doing nothing. A pool whose ranks pass this many threads starts afresh (about 4 s).
THREAD_LIMIT = 300
_POLL_S = 1.0  # how often a waiting ``run`` looks for ranks that died
START_TIMEOUT = 600.0  # for the ranks to start and join (torch's import; slow on a busy machine)


class RankPool:
    """n long-lived gloo processes that run tasks on every rank."""

    def __init__(self, world_size: int, timeout: float = 120.0,
                 env: dict[str, str] | None = None) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self.env = dict(env or {})  # extra environment of the rank processes
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        saved = {name: os.environ.get(name) for name in self.env}
        os.environ.update(self.env)  # spawned processes start with the parent's environment
        self._store_dir = tempfile.mkdtemp(prefix="rank_pool_")
        store_file = os.path.join(self._store_dir, "store")
        try:
            ranks = start_local_ranks(_serve, self.world_size,
                                      (self._tasks, self._results, store_file), daemon=True)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        self._procs = ranks.processes
        self._joined = False

    def _await_joined(self) -> None:
        """Wait for every rank to join the gloo world: a task's ``timeout`` counts from then,
        so a slow start (eight imports of torch on two busy cores) is not a task's timeout."""
        joined: set[int] = set()
        deadline = time.monotonic() + START_TIMEOUT
        while len(joined) < self.world_size:
            try:
                rank, _, _ = self._results.get(timeout=_POLL_S)
                joined.add(rank)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close()
                    raise RankError(f"the pool's ranks {dead} died while starting" if dead else
                                    f"the pool did not start within {START_TIMEOUT:.0f}s"
                                    ) from None
        self._joined = True

    def _most_threads(self) -> int:
        """The most threads of any rank (0 where /proc cannot tell)."""
        try:
            return max(len(os.listdir(f"/proc/{p.pid}/task")) for p in self._procs)
        except OSError:
            return 0

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; per-rank results in rank order. Ranks
        that hold more than ``THREAD_LIMIT`` threads are replaced by fresh ones first, and a
        pool that was killed (a timeout, a lost rank) starts afresh. A rank that dies during
        the task (a crash, a signal) ends it at once with ``RankError`` naming the rank."""
        if not self._procs:
            self._start()
        elif self._most_threads() > THREAD_LIMIT:
            self.close()
            self._start()
        if not self._joined:
            self._await_joined()
        self._signal(signal.SIGCONT)
        for q in self._tasks:
            q.put((fn, args, kwargs))
        name = getattr(fn, "__name__", fn)
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + self.timeout
        while len(results) + len(failures) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=min(_POLL_S, self.timeout))
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - set(results) - set(failures))
                dead = {r: self._procs[r].exitcode for r in missing
                        if not self._procs[r].is_alive()}
                if dead:
                    crashes = self._crash_reports(sorted(dead))
                    self.close()
                    raise RankError(f"{name}: ranks {sorted(dead)} died (exit codes "
                                    f"{list(dead.values())}; a negative code is a signal)"
                                    + _format_failures(failures) + crashes) from None
                if time.monotonic() > deadline:
                    self.close()
                    raise RankError(f"{name} did not finish within {self.timeout:.0f}s "
                                    f"on ranks {missing}" + _format_failures(failures)) from None
                continue
            (results if ok else failures)[rank] = value
        self._signal(signal.SIGSTOP)  # every rank returned: idle until the next task
        if failures:
            raise RankError(f"{name} failed" + _format_failures(failures))
        return [results[r] for r in range(self.world_size)]

    def _crash_reports(self, ranks: list[int]) -> str:
        """What faulthandler wrote for ``ranks`` as they died (nothing for a SIGKILL)."""
        reports = []
        for rank in ranks:
            try:
                with open(_fault_file(self._store_dir, rank)) as f:
                    text = f.read().strip()
            except OSError:
                continue
            if text:
                reports.append(f"\nrank {rank} crashed:\n{text}")
        return "".join(reports)

    def _signal(self, number: int) -> None:
        for p in self._procs:
            if p.is_alive():
                os.kill(p.pid, number)

    def close(self) -> None:
        """End the ranks. They are killed: a pool is closed between tasks, when nothing is
        left to finish, and ranks leaving their gloo groups one by one took 6 to 10 s per pool
        that had made many groups (a Megatron-Core release's pool, one past its thread limit)."""
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)
        self._procs = []
        shutil.rmtree(self._store_dir, ignore_errors=True)

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def run_with_room(pool: RankPool, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """``pool.run`` with room for a busy machine (600 s at least): a Megatron-Core case runs
    Megatron and megapipe on 4 processes, and its first imports Megatron in each (seconds
    alone, minutes when other jobs share the 2 cores)."""
    limit, pool.timeout = pool.timeout, max(pool.timeout, 600.0)
    try:
        return pool.run(fn, *args)
    finally:
        pool.timeout = limit


def results_by_case(per_rank: list[list[Any]], cases: list[Any]) -> dict[Any, list[Any]]:
    """Regroup ``RankPool.run`` results, one list per rank with one entry per case, into one
    list per case of the ranks that took part in it (a rank outside a case returns None)."""
    return {case: [r[i] for r in per_rank if r[i] is not None] for i, case in enumerate(cases)}


def _format_failures(failures: dict[int, str]) -> str:
    if not failures:
        return ""
    first = min(failures)
    return f" on ranks {sorted(failures)}; rank {first}:\n{failures[first]}"
