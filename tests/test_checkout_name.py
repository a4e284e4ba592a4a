"""The suite's path-sensitive helpers work from a checkout in a folder named ``megapipe`` (what
``git clone`` makes): they tell library code by its module, not by a path fragment.

A copy of the files they need (the package, ``tests/support``, ``benchmarks/gpu_sections``) in
``<tmp>/megapipe`` runs them in a fresh process: ``HostSyncs`` charges a host read to the
megapipe function that made it (not to itself, whose path holds ``/megapipe/`` there), the
GPU check's ``site_of`` names the megapipe line, and ``ActionPath``'s root is the copy."""

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import os
import torch
import megapipe
from megapipe.moe.dispatcher import HostCounts
from support.host_syncs import HostSyncs
from support.call_tree import ROOT
from gpu_sections.sync_sites import site_of

checkout = os.getcwd()
assert os.path.basename(checkout) == "megapipe"
assert megapipe.__file__ == os.path.join(checkout, "megapipe", "__init__.py"), megapipe.__file__
assert ROOT == os.path.join(checkout, "megapipe"), ROOT

with HostSyncs() as syncs:
    HostCounts(torch.arange(3)).wait()
    torch.ones(2).tolist()  # this script is no library code
print([e.where for e in syncs.events])
assert [e.where for e in syncs.events] == [
    "megapipe/moe/dispatcher.py:HostCounts.wait", "outside megapipe"], syncs.events

# a megapipe frame under a test helper's frame (innermost last), as sync warnings give them
stack = [(os.path.join(checkout, "megapipe", "moe", "dispatcher.py"), 84),
         (os.path.join(checkout, "tests", "support", "host_syncs.py"), 150)]
assert site_of(stack, ("megapipe",), checkout) == "megapipe/moe/dispatcher.py:84"
print("ok")
"""


def test_the_path_sensitive_helpers_run_from_a_checkout_named_megapipe(tmp_path):
    checkout = tmp_path / "megapipe"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "megapipe", checkout / "megapipe", ignore=skip)
    shutil.copytree(REPO / "tests" / "support", checkout / "tests" / "support", ignore=skip)
    shutil.copytree(REPO / "benchmarks" / "gpu_sections", checkout / "benchmarks" / "gpu_sections",
                    ignore=skip)
    path = [str(checkout), str(checkout / "tests"), str(checkout / "benchmarks")]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
