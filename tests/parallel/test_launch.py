import subprocess
import sys

import pytest
import torch

from megapipe.parallel.launch import default_backend, free_port, resolve_launch
from megapipe.parallel.slurm_hostlist import expand_hostlist


@pytest.mark.parametrize(
    "hostlist, hosts",
    [
        ("n[1-3,5],m7", ["n1", "n2", "n3", "n5", "m7"]),
        ("node7", ["node7"]),
        ("gpu[008-010]", ["gpu008", "gpu009", "gpu010"]),
        ("a,b[2],c", ["a", "b2", "c"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("x-[3-4].cluster", ["x-3.cluster", "x-4.cluster"]),
    ],
)
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["", "n[1-3", "n1-3]", "n[3-1]", "n[a-b]", "a,,b"])
def test_expand_hostlist_rejects_malformed(bad):
    with pytest.raises(ValueError, match="hostlist"):
        expand_hostlist(bad)


def test_torchrun_env():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "h0",
           "MASTER_PORT": "1234", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    info = resolve_launch(env)
    assert (info.rank, info.world_size, info.local_rank) == (5, 8, 1)
    assert (info.master_addr, info.master_port, info.source) == ("h0", 1234, "torchrun")


def test_slurm_env_uses_first_host_and_job_port():
    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "6", "SLURM_NTASKS": "16", "SLURM_LOCALID": "2",
           "SLURM_JOB_NODELIST": "gpu[03-04],login1", "SLURM_JOB_ID": "123456"}
    info = resolve_launch(env)
    assert (info.rank, info.world_size, info.local_rank) == (6, 16, 2)
    assert info.master_addr == "gpu03" and info.source == "slurm"
    assert info.master_port == 20000 + 123456 % 20000
    # an explicit MASTER_PORT / MASTER_ADDR wins over the derived ones
    info = resolve_launch({**env, "MASTER_PORT": "777", "MASTER_ADDR": "head"})
    assert (info.master_addr, info.master_port) == ("head", 777)


def test_explicit_arguments_override_env():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_PORT": "1000"}
    info = resolve_launch(env, rank=0, world_size=1, master_addr="10.0.0.1", master_port=4242)
    assert (info.rank, info.world_size, info.master_addr, info.master_port) == (
        0, 1, "10.0.0.1", 4242)
    assert info.source == "explicit"
    info = resolve_launch({}, rank=3, world_size=4)
    assert (info.local_rank, info.master_addr, info.master_port) == (3, "127.0.0.1", 29500)


def test_bad_launch_values_rejected():
    with pytest.raises(ValueError, match="cannot tell this process's rank"):
        resolve_launch({})
    with pytest.raises(ValueError, match=r"rank=4 must lie in \[0, world_size=4\)"):
        resolve_launch({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="RANK='x' is not an integer"):
        resolve_launch({"RANK": "x", "WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="master_port=70000 is not a valid TCP port"):
        resolve_launch({}, rank=0, world_size=1, master_port=70000)


_INIT_SCRIPT = """
import sys, torch, torch.distributed as dist
from megapipe.parallel.launch import init_distributed
info = init_distributed(rank=0, world_size=1, master_port=int(sys.argv[1]), backend="gloo", env={})
t = torch.ones(2); dist.all_reduce(t)
print(dist.get_backend(), info.source, dist.get_world_size(), t.tolist())
dist.destroy_process_group()
"""


def test_default_backend_follows_cuda():
    assert default_backend() == ("nccl" if torch.cuda.is_available() else "gloo")


def test_real_init_with_explicit_arguments():
    out = subprocess.run(
        [sys.executable, "-c", _INIT_SCRIPT, str(free_port())],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["gloo", "explicit", "1", "[1.0,", "1.0]"]


def test_launcher_detection_is_one_rule_for_training_and_rendezvous():
    from megapipe.parallel.launch import detect_launcher, launched_world_size

    torchrun = {"RANK": "1", "WORLD_SIZE": "4"}
    srun_task = {"SLURM_STEP_ID": "3", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
    batch_shell = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7"}
    assert (detect_launcher(torchrun), launched_world_size(torchrun)) == ("torchrun", 4)
    assert (detect_launcher(srun_task), launched_world_size(srun_task)) == ("slurm", 2)
    # an sbatch script's own shell is not one of the job's ranks
    assert (detect_launcher(batch_shell), launched_world_size(batch_shell)) == (None, None)
    with pytest.raises(ValueError, match="cannot tell this process's rank"):
        resolve_launch(batch_shell)


def test_nccl_init_binds_the_device_so_communicators_start_eagerly(monkeypatch):
    """With CUDA, init_process_group gets device_id = this rank's GPU (stood in for here)."""
    import torch.distributed as dist

    from megapipe.parallel.launch import init_distributed

    calls = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.setdefault("set", device))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kwargs: calls.update(backend=backend, **kwargs))
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29500"}
    init_distributed(env=env)
    assert calls["backend"] == "nccl" and calls["set"] == 3
    assert calls["device_id"] == torch.device("cuda", 3)
