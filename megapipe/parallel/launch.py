"""How this process joins a job: launcher detection, rendezvous, and starting ranks locally.

One place answers the three questions every entry point (training, tests, benchmarks, examples)
asks:

- *Who launched me?* ``detect_launcher``: torchrun (RANK and WORLD_SIZE set), Slurm (inside an
  srun step: SLURM_STEP_ID with SLURM_PROCID and SLURM_NTASKS; a batch script's own shell is
  not a rank), or nobody.
- *Where do we meet?* ``resolve_launch``: for each value the explicit argument, then torchrun's
  variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), then Slurm's
  (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, the first host of SLURM_JOB_NODELIST). Under
  Slurm without MASTER_PORT the port is derived from SLURM_JOB_ID so every task of the job
  agrees on it without talking. ``init_distributed`` then starts the default process group.
- *Nobody launched us, so start the ranks here:* ``start_local_ranks`` spawns one process per
  rank on this machine with torchrun's variables set (a free port from ``free_port``), so each
  rank initialises exactly as under torchrun.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megapipe.parallel.slurm_hostlist import expand_hostlist

DEFAULT_MASTER_PORT = 29500
_SLURM_PORT_BASE = 20000
_SLURM_PORT_SPAN = 20000
TORCHRUN, SLURM = "torchrun", "slurm"


@dataclass(frozen=True)
class LaunchInfo:
    """Who this process is in the job, and where the rendezvous is."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm" or "explicit"


def detect_launcher(env: Mapping[str, str] | None = None) -> str | None:
    """``"torchrun"``, ``"slurm"`` (a task of an srun step) or None (started by hand)."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return TORCHRUN
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return SLURM
    return None


def launched_world_size(env: Mapping[str, str] | None = None) -> int | None:
    """The world size the launcher set (WORLD_SIZE or SLURM_NTASKS); None without a launcher."""
    env = os.environ if env is None else env
    launcher = detect_launcher(env)
    if launcher == TORCHRUN:
        return _int_var(env, "WORLD_SIZE")
    if launcher == SLURM:
        return _int_var(env, "SLURM_NTASKS")
    return None


def _int_var(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def resolve_launch(
    env: Mapping[str, str] | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
) -> LaunchInfo:
    """Work out rank, world size, local rank and rendezvous from arguments and ``env``."""
    env = os.environ if env is None else env
    launcher = detect_launcher(env)
    env_rank: int | None
    env_world: int | None
    if launcher == TORCHRUN:
        source = TORCHRUN
        env_rank, env_world = _int_var(env, "RANK"), _int_var(env, "WORLD_SIZE")
        env_local = _int_var(env, "LOCAL_RANK") if "LOCAL_RANK" in env else None
        env_addr = env.get("MASTER_ADDR")
    elif launcher == SLURM:
        source = SLURM
        env_rank, env_world = _int_var(env, "SLURM_PROCID"), _int_var(env, "SLURM_NTASKS")
        env_local = _int_var(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else None
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        env_addr = env.get("MASTER_ADDR") or (expand_hostlist(nodelist)[0] if nodelist else None)
    else:
        source = "explicit"
        env_rank = env_world = env_local = None
        env_addr = env.get("MASTER_ADDR")

    if rank is not None or world_size is not None:
        source = "explicit"
    rank = env_rank if rank is None else rank
    world_size = env_world if world_size is None else world_size
    if rank is None or world_size is None:
        raise ValueError(
            "cannot tell this process's rank: set RANK and WORLD_SIZE (torchrun), run under "
            "srun (SLURM_PROCID, SLURM_NTASKS), or pass rank= and world_size="
        )
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")
    if local_rank is None:
        # without a launcher's local rank, assume one host: local rank = global rank
        local_rank = env_local if env_local is not None else rank
    if local_rank < 0:
        raise ValueError(f"local_rank={local_rank} must be >= 0")

    if master_addr is None:
        master_addr = env_addr or "127.0.0.1"
    if master_port is None:
        if "MASTER_PORT" in env:
            master_port = _int_var(env, "MASTER_PORT")
        elif source == SLURM and "SLURM_JOB_ID" in env:
            job = _int_var(env, "SLURM_JOB_ID")
            master_port = _SLURM_PORT_BASE + job % _SLURM_PORT_SPAN
        else:
            master_port = DEFAULT_MASTER_PORT
    if not 0 < master_port < 65536:
        raise ValueError(f"master_port={master_port} is not a valid TCP port")
    return LaunchInfo(rank, world_size, local_rank, master_addr, master_port, source)


def default_backend() -> str:
    """NCCL when CUDA is available, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    backend: str | None = None,
    timeout: timedelta | None = None,
    env: Mapping[str, str] | None = None,
) -> LaunchInfo:
    """Initialise the default process group (and the CUDA device) and describe this process.

    With NCCL the group is bound to this rank's GPU (``device_id``), so its communicators are
    created eagerly here rather than inside the first collective of a training step. If a
    default group already exists it is kept, after checking that it agrees with the resolved
    rank and world size.
    """
    info = resolve_launch(
        env,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        master_addr=master_addr,
        master_port=master_port,
    )
    backend = default_backend() if backend is None else backend
    device_id = None
    if torch.cuda.is_available() and backend != "gloo":
        count = torch.cuda.device_count()
        if info.local_rank >= count:
            raise ValueError(f"local_rank={info.local_rank} but only {count} CUDA devices")
        torch.cuda.set_device(info.local_rank)
        # bound to its device, NCCL creates the communicators now, not at the first collective
        device_id = torch.device("cuda", info.local_rank)
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (info.rank, info.world_size):
            raise RuntimeError(
                f"a process group already exists as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the launch says rank {info.rank} of "
                f"{info.world_size}"
            )
        return info
    kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    url = f"tcp://{info.master_addr}:{info.master_port}"
    attempt = (env if env is not None else os.environ).get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt in ("", "0"):
        kwargs["init_method"] = url
    else:
        # torchrun restarts every worker against the same store: the keys of an earlier
        # attempt (the addresses of its dead processes) must not be read as this attempt's
        store, _, _ = next(dist.rendezvous(url, info.rank, info.world_size, **kwargs))
        kwargs["store"] = dist.PrefixStore(f"megapipe/attempt{attempt}", store)
    if device_id is not None:
        kwargs["device_id"] = device_id
    dist.init_process_group(backend, rank=info.rank, world_size=info.world_size, **kwargs)
    return info


# ---------------------------------------------------------------------- ranks started here
def free_port() -> int:
    """A TCP port that is free on this machine right now (for a local rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankExited(RuntimeError):
    """A locally started rank exited with an error; ``rank`` and ``exit_code`` name it."""

    def __init__(self, rank: int, exit_code: int) -> None:
        super().__init__(f"rank {rank} exited with code {exit_code}")
        self.rank = rank
        self.exit_code = exit_code


def _rank_main(
    target: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    threads: int,
    args: Sequence[Any],
) -> None:
    """A started process: torchrun's variables, ``threads`` CPU threads, then ``target``."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS=str(threads),
    )
    torch.set_num_threads(threads)
    target(rank, *args)


class LocalRanks:
    """The processes ``start_local_ranks`` started, rank by rank."""

    def __init__(self, processes: list[Any]) -> None:
        self.processes = processes

    def failure(self) -> RankExited | None:
        """The first rank that has exited with a non-zero code, if any."""
        for rank, process in enumerate(self.processes):
            if process.exitcode not in (None, 0):
                return RankExited(rank, process.exitcode)
        return None

    def terminate(self) -> None:
        """Stop every rank still running (they may be blocked in a collective)."""
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join()

    def join(self, poll_s: float = 0.2) -> None:
        """Wait for every rank; on the first failure stop the others and raise ``RankExited``."""
        while any(p.is_alive() for p in self.processes):
            failed = self.failure()
            if failed is not None:
                self.terminate()
                raise failed
            time.sleep(poll_s)
        for process in self.processes:
            process.join()
        failed = self.failure()
        if failed is not None:
            raise failed


def start_local_ranks(
    target: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    threads: int = 1,
    daemon: bool = False,
    port: int | None = None,
) -> LocalRanks:
    """Spawn ``world_size`` processes on this machine; process r calls ``target(r, *args)``.

    Each process sees torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    MASTER_ADDR=127.0.0.1, MASTER_PORT) and uses ``threads`` CPU threads, so
    ``init_distributed()`` (or ``init_process_group`` with ``env://``) works in it unchanged.
    ``target`` and ``args`` must be picklable (a module-level function).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    ctx = mp.get_context("spawn")
    port = free_port() if port is None else port
    processes = [
        ctx.Process(
            target=_rank_main,
            args=(target, rank, world_size, port, threads, tuple(args)),
            daemon=daemon,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    return LocalRanks(processes)
