"""Start torch.distributed from torchrun's or Slurm's environment, or from explicit arguments.

Resolution order for each value: explicit argument, then torchrun's variables (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), then Slurm's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
the first host of SLURM_JOB_NODELIST). Under Slurm without MASTER_PORT the port is derived from
SLURM_JOB_ID so every task of the job agrees on it without talking. Parsing is separate from
initialising (``resolve_launch``) so it is testable without processes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist

DEFAULT_MASTER_PORT = 29500
_SLURM_PORT_BASE = 20000
_SLURM_PORT_SPAN = 20000


@dataclass(frozen=True)
class LaunchInfo:
    """Who this process is in the job, and where the rendezvous is."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm" or "explicit"


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested brackets in Slurm hostlist {text!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in Slurm hostlist {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced '[' in Slurm hostlist {text!r}")
    parts.append(text[start:])
    return parts


def _expand_range_set(body: str, hostlist: str) -> list[str]:
    """'1-3,05' -> ['1', '2', '3', '05']; a zero-padded bound keeps its width."""
    out = []
    for item in body.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if match is None:
            raise ValueError(f"bad range {item!r} in Slurm hostlist {hostlist!r}")
        lo_text, hi_text = match.group(1), match.group(2)
        if hi_text is None:
            out.append(lo_text)
            continue
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise ValueError(f"descending range {item!r} in Slurm hostlist {hostlist!r}")
        width = len(lo_text) if lo_text.startswith("0") else 0
        out.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return out


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand Slurm hostlist syntax: ``"n[1-3,5],m7"`` -> ``["n1", "n2", "n3", "n5", "m7"]``.

    Supports zero padding (``n[01-03]``) and several bracket groups in one name
    (``r[1-2]n[1-2]`` -> r1n1, r1n2, r2n1, r2n2).
    """
    hostlist = hostlist.strip()
    if not hostlist:
        raise ValueError("empty Slurm hostlist")
    hosts: list[str] = []
    for part in _split_top_level(hostlist):
        part = part.strip()
        if not part:
            raise ValueError(f"empty host name in Slurm hostlist {hostlist!r}")
        names = [""]
        for literal, body in re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", part):
            suffixes = _expand_range_set(body, hostlist) if body else [""]
            names = [n + literal + s for n in names for s in suffixes]
        hosts.extend(names)
    return hosts


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
    if "RANK" in env and "WORLD_SIZE" in env:
        source = "torchrun"
        env_rank, env_world = _int_var(env, "RANK"), _int_var(env, "WORLD_SIZE")
        env_local = _int_var(env, "LOCAL_RANK") if "LOCAL_RANK" in env else None
        env_addr = env.get("MASTER_ADDR")
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        source = "slurm"
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
        # without a launcher's local rank, assume one node: local rank = global rank
        local_rank = env_local if env_local is not None else rank
    if local_rank < 0:
        raise ValueError(f"local_rank={local_rank} must be >= 0")

    if master_addr is None:
        master_addr = env_addr or "127.0.0.1"
    if master_port is None:
        if "MASTER_PORT" in env:
            master_port = _int_var(env, "MASTER_PORT")
        elif source == "slurm" and "SLURM_JOB_ID" in env:
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

    If a default group already exists it is kept, after checking that it agrees with the
    resolved rank and world size.
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
    if torch.cuda.is_available() and backend != "gloo":
        count = torch.cuda.device_count()
        if info.local_rank >= count:
            raise ValueError(f"local_rank={info.local_rank} but only {count} CUDA devices")
        torch.cuda.set_device(info.local_rank)
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (info.rank, info.world_size):
            raise RuntimeError(
                f"a process group already exists as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the launch says rank {info.rank} of "
                f"{info.world_size}"
            )
        return info
    kwargs = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(
        backend,
        init_method=f"tcp://{info.master_addr}:{info.master_port}",
        rank=info.rank,
        world_size=info.world_size,
        **kwargs,
    )
    return info
