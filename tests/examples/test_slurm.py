"""A real two-node Slurm cluster on this machine, and the sbatch launcher run on it.

The fixture installs Slurm and munge from Debian's packages when they are missing, then starts
munged, slurmctld and two slurmd daemons (nodes n1 and n2, both at 127.0.0.1, told apart by
``slurmd -N``) with every file under a temporary directory. Cgroup-free plugins keep it working
in containers. Every daemon it started is stopped by the fixture's finalizer, also on failure.
A failing check prints the job's output and the daemons' logs.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SBATCH_SCRIPT = REPO / "examples" / "slurm" / "pretrain.sbatch"
NODES = ("n1", "n2")
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol", "munged")


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _find(binary: str) -> str | None:
    """Daemons live in /usr/sbin, which a non-login PATH may lack."""
    return shutil.which(binary) or shutil.which(binary, path="/usr/sbin:/usr/bin:/sbin")


def _ensure_installed() -> None:
    if all(_find(b) for b in BINARIES):
        return
    if shutil.which("apt-get") is None:
        pytest.skip("Slurm is not installed and apt-get is unavailable to install it")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            pytest.fail(
                f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
            )
    missing = [b for b in BINARIES if not _find(b)]
    if missing:
        pytest.fail(f"installed {PACKAGES} but these are still missing: {missing}")


@dataclass
class SlurmCluster:
    """Paths and processes of the local test cluster."""

    root: Path
    env: dict[str, str]
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def logs(self) -> str:
        parts = []
        for log in sorted(self.root.glob("*.log")):
            text = log.read_text(errors="replace")
            parts.append(f"===== {log.name} (last 4000 chars) =====\n{text[-4000:]}")
        return "\n".join(parts)

    def run(self, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(
            [_find(cmd[0]) or cmd[0], *cmd[1:]],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def start(self, name: str, *cmd: str) -> None:
        log = open(self.root / f"{name}.stdout.log", "w")
        self.processes[name] = subprocess.Popen(
            [_find(cmd[0]) or cmd[0], *cmd[1:]],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()

    def check_alive(self) -> None:
        dead = {n: p.returncode for n, p in self.processes.items() if p.poll() is not None}
        if dead:
            raise AssertionError(f"daemons exited early: {dead}\n{self.logs()}")

    def stop(self) -> None:
        """Cancel any job still running (so no job step outlives its slurmd), then the daemons."""
        if "slurmctld" in self.processes and self.processes["slurmctld"].poll() is None:
            try:
                self.run("scancel", "--user", "root", "--full", timeout=10)
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline:
                    if not self.run("squeue", "-h", timeout=10).stdout.strip():
                        break
                    time.sleep(0.5)
            except (subprocess.TimeoutExpired, OSError):
                pass
        for proc in reversed(list(self.processes.values())):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.processes.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


def _write_config(root: Path, ctld_port: int, node_ports: list[int]) -> Path:
    host = socket.gethostname().split(".")[0]
    cpus = os.cpu_count() or 1
    nodes = "\n".join(
        f"NodeName={name} NodeAddr=127.0.0.1 NodeHostname={host} Port={port} CPUs={cpus} "
        "RealMemory=1 State=UNKNOWN"
        for name, port in zip(NODES, node_ports)
    )
    conf = root / "slurm.conf"
    conf.write_text(
        f"""ClusterName=megapipe-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/linear
SlurmdParameters=config_overrides
ReturnToService=2
MaxJobCount=100
InactiveLimit=0
KillWait=5
SlurmdTimeout=60
SlurmctldTimeout=60
{nodes}
PartitionName=test Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""
    )
    return conf


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """Start munged, slurmctld and two slurmd (n1, n2); stop them all afterwards."""
    _ensure_installed()
    root = tmp_path_factory.mktemp("slurm")
    root.chmod(0o700)
    for sub in ["munge", "state", *(f"spool/{n}" for n in NODES)]:
        (root / sub).mkdir(parents=True, mode=0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    ctld_port, *node_ports = _free_ports(1 + len(NODES))
    conf = _write_config(root, ctld_port, node_ports)
    env = dict(os.environ, SLURM_CONF=str(conf))
    for name in list(env):
        if name.startswith(("SLURM_", "SBATCH_", "SRUN_")) and name != "SLURM_CONF":
            del env[name]  # a test run inside a Slurm job must not leak its job into ours
    cluster = SlurmCluster(root, env)
    try:
        cluster.start(
            "munged",
            "munged", "--foreground", "--force",
            f"--socket={root}/munge/munge.socket",
            f"--key-file={key}",
            f"--log-file={root}/munged.log",
            f"--pid-file={root}/munge/munged.pid",
            f"--seed-file={root}/munge/munged.seed",
        )
        _wait(lambda: (root / "munge" / "munge.socket").exists(), 15, "munged socket", cluster)
        cluster.start("slurmctld", "slurmctld", "-D", "-c", "-f", str(conf))
        for name in NODES:
            cluster.start(f"slurmd-{name}", "slurmd", "-D", "-N", name, "-f", str(conf))

        def nodes_idle() -> bool:
            cluster.check_alive()
            out = cluster.run("sinfo", "-h", "-N", "-o", "%N %t").stdout.split()
            states = dict(zip(out[::2], out[1::2]))
            return all(states.get(n) == "idle" for n in NODES)

        _wait(nodes_idle, 60, "both nodes idle in sinfo", cluster)
        yield cluster
    finally:
        cluster.stop()


def _wait(ready, timeout: float, what: str, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{cluster.logs()}")


def submit(
    cluster: SlurmCluster, script: Path, env: dict[str, str], *options: str
) -> tuple[str, Path]:
    """sbatch ``script`` on both nodes; returns (job id, its output file)."""
    cluster = SlurmCluster(cluster.root, env, cluster.processes)
    done = cluster.run(
        "sbatch", "--parsable", "-N", str(len(NODES)), f"--output={cluster.root}/job-%j.out",
        *options, str(script),
    )
    assert done.returncode == 0, f"sbatch failed: {done.stderr}\n{cluster.logs()}"
    job_id = done.stdout.strip().split(";")[0]
    return job_id, cluster.root / f"job-{job_id}.out"


def _output(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else "(no output file)"


def wait_for_end(cluster: SlurmCluster, job_id: str, output: Path, timeout: float) -> str:
    """Wait for the job to leave the queue; returns its final state."""
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        cluster.check_alive()
        state = cluster.run("scontrol", "show", "job", job_id, "-o").stdout
        fields = dict(f.split("=", 1) for f in state.split() if "=" in f)
        state = fields.get("JobState", "")
        if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", ""):
            return state
        time.sleep(1)
    cluster.run("scancel", job_id)
    raise AssertionError(
        f"job {job_id} still {state} after {timeout:.0f}s\n{_output(output)}\n{cluster.logs()}"
    )


def submit_and_wait(
    cluster: SlurmCluster, script: Path, env: dict[str, str], timeout: float, *options: str
) -> tuple[str, str]:
    """sbatch ``script`` and wait for it to end; returns (final state, job output)."""
    job_id, output = submit(cluster, script, env, *options)
    state = wait_for_end(cluster, job_id, output, timeout)
    return state, _output(output)


def test_slurm_cluster_runs_a_two_node_job(slurm_cluster, tmp_path):
    """The harness itself: one task per node, each reporting its Slurm node name."""
    script = tmp_path / "hello.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        "srun --ntasks-per-node=1 bash -c "
        '\'echo "hello from $SLURMD_NODENAME task $SLURM_PROCID"\'\n'
    )
    state, log = submit_and_wait(slurm_cluster, script, slurm_cluster.env, 60)
    assert state == "COMPLETED", f"{state}\n{log}\n{slurm_cluster.logs()}"
    for node in NODES:
        assert f"hello from {node}" in log, f"{log}\n{slurm_cluster.logs()}"


# A CPU configuration small enough for seconds per step: 2 nodes x 2 processes, pp=2, ep=2;
# it would train for long, but is preempted after a few iterations.
CPU_PRETRAIN_ARGS = (
    "--pipeline-model-parallel-size 2 --virtual-pipeline-model-parallel-size 2 "
    "--expert-model-parallel-size 2 --num-layers 2 --hidden-size 32 --num-attention-heads 2 "
    "--ffn-hidden-size 64 --num-experts 4 --moe-ffn-hidden-size 32 --seq-length 16 "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 100000 --log-interval 1 "
    "--eval-interval 0 --lr-warmup-iters 1 --exit-signal-handler"
)


def test_sbatch_pretrains_across_two_nodes_and_saves_when_preempted(slurm_cluster, tmp_path):
    """examples/slurm/pretrain.sbatch, unchanged, on the two-node cluster with a CPU config:
    after a few iterations Slurm sends SIGTERM to every task (as --signal does before the time
    limit); the ranks finish their step, save, say so in one line and exit 0: the job completes."""
    data = tmp_path / "corpus.txt"
    data.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    save = tmp_path / "ckpt"
    env = dict(
        slurm_cluster.env,
        PYTHON=sys.executable,
        MEGAPIPE_DIR=str(REPO),
        NPROC_PER_NODE="2",
        PRETRAIN_ARGS=f"{CPU_PRETRAIN_ARGS} --data-path {data} --save {save} --load {save}",
    )
    job_id, output = submit(slurm_cluster, SBATCH_SCRIPT, env)
    _wait(lambda: "iter 3/" in _output(output), 150, "iteration 3 in the job output",
          slurm_cluster)
    done = slurm_cluster.run("scancel", "--signal=TERM", job_id)
    assert done.returncode == 0, done.stderr
    state = wait_for_end(slurm_cluster, job_id, output, 120)
    log = _output(output)
    report = f"job state {state}; job output:\n{log}\n{slurm_cluster.logs()}"
    assert state == "COMPLETED", report
    assert "placement: 2 host(s): n1: ranks 0,1; n2: ranks 2,3" in log, report
    exits = [line for line in log.splitlines() if line.startswith("exiting after iteration")]
    assert len(exits) == 1 and "SIGTERM received; saved checkpoint" in exits[0], report
    stopped = int(exits[0].split()[3].rstrip(":"))
    assert stopped >= 3 and f"iter {stopped + 1}/" not in log, report
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(stopped), report
    shards = list((save / f"iter_{stopped:07d}").glob("*.distcp"))
    assert len(shards) == 4, f"one shard per rank expected, found {shards}\n{report}"
    assert "Traceback" not in log, report
