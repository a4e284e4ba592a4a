"""A rank killed mid-step: named by the local launcher; resumed by itself under torchrun.

Both runs start real processes (tests/support/fault_entry.py injects the fault), so they are
the slowest tests of the failure suite; each starts its ranks once.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from megapipe.train.checkpoint.files import LATEST_FILE, select_checkpoint
from support.pretrain_flags import TINY

ENTRY = str(Path(__file__).resolve().parents[1] / "support" / "fault_entry.py")
COMMON = TINY + ["--eval-interval", "0", "--log-interval", "1"]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **extra)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def test_a_killed_rank_is_named_and_the_others_stop(tmp_path):
    """2 local ranks (pp 2); rank 1 SIGKILLs itself in the middle of iteration 2's step."""
    save = tmp_path / "ckpt"
    done = subprocess.run(
        [sys.executable, ENTRY, *COMMON, "--expert-model-parallel-size", "1", "--train-iters",
         "4", "--save", str(save), "--save-interval", "1", "--distributed-timeout-minutes", "1"],
        capture_output=True, text=True, timeout=300, env=_env(MEGAPIPE_FAULT="kill:1:2"),
    )
    report = f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.returncode == 1, report
    assert done.stderr.strip() == (
        "megapipe pretrain: error: rank 1 was killed by SIGKILL (it left no report: crashed "
        "or killed)"), report
    assert "iter 1/4" in done.stdout and "iter 2/4" not in done.stdout, report
    assert select_checkpoint(save).chosen.iteration == 1  # what was saved is intact


def test_torchrun_restarts_a_killed_job_and_it_ends_bitwise_as_if_uninterrupted(tmp_path):
    """torchrun --max-restarts 1, --load == --save, 2 ranks (pp 2, vpp 2, overlap on): rank 1
    is SIGKILLed mid-step in iteration 3 of the first attempt; the second attempt resumes from
    iteration 2 and finishes. The same processes first trained the run uninterrupted."""
    save, losses = tmp_path / "ckpt", tmp_path / "losses"
    losses.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
         "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.2", ENTRY, *COMMON,
         "--expert-model-parallel-size", "1", "--train-iters", "4", "--save", str(save),
         "--load", str(save), "--save-interval", "2", "--distributed-timeout-minutes", "1"],
        capture_output=True, text=True, timeout=400,
        env=_env(MEGAPIPE_FAULT="kill:1:3:0", MEGAPIPE_LOSSES=str(losses), MEGAPIPE_REFERENCE="1"),
    )
    report = f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr[-6000:]}"
    assert done.returncode == 0, report
    assert not list(losses.glob("attempt0-*")), report  # the first attempt never finished
    for rank in range(2):
        reference = json.loads((losses / f"reference-rank{rank}.json").read_text())["losses"]
        second = json.loads((losses / f"attempt1-rank{rank}.json").read_text())
        assert len(reference) == 4 and second["first"] == 2, report
        assert second["losses"] == reference[2:], report  # bitwise (the floats' repr)
    assert "resumed from" in done.stdout and "iteration 2" in done.stdout, report
    assert (save / LATEST_FILE).read_text() == "4\n"
