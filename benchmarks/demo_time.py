"""The default demo (``megapipe pretrain`` with no flags) of this tree beside another revision's.

    python benchmarks/demo_time.py --base 7965b39 --rounds 3

The base revision is exported (``git archive``) into a temporary folder and run with the same
interpreter; the two demos alternate, base first, ``--rounds`` times, so load from other work
on the machine falls on both alike. Each run prints its wall time (process start to exit: start
of the 4 ranks, data, training, evaluation), the training time of its last line, and the CPU
time of the run and its ranks (user + system: less sensitive than wall time to other work on a
shared machine); the last lines give the ratios of the medians (this tree / base). Extra flags
after ``--`` go to both.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DONE = re.compile(r"done: iterations \d+-\d+ in (\d+) s; loss ([\d.]+) -> ([\d.]+)")


def export(revision: str, into: Path) -> Path:
    """The tree of ``revision`` of this repository, written under ``into``."""
    archive = into / "base.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), revision], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "base", filter="data")
    return into / "base"


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_demo(tree: Path, flags: list[str]) -> tuple[float, int, float, str]:
    """(wall seconds, training seconds, CPU seconds, the loss from -> to) of one demo from
    ``tree``."""
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    cpu = _children_cpu()
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "megapipe.cli", "pretrain", *flags], env=env,
                          cwd=tempfile.gettempdir(), capture_output=True, text=True)
    wall = time.perf_counter() - start
    cpu = _children_cpu() - cpu
    if done.returncode != 0:
        raise SystemExit(f"the demo of {tree} failed ({done.returncode}): {done.stderr[-500:]}")
    match = DONE.search(done.stdout)
    if match is None:
        raise SystemExit(f"no 'done:' line in the demo of {tree}")
    return wall, int(match.group(1)), cpu, f"{match.group(2)} -> {match.group(3)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the revision to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("flags", nargs="*", help="flags for both demos (after --)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        trees = {"base": export(args.base, Path(scratch)), "this": ROOT}
        runs: dict[str, list[tuple[float, int, float]]] = {"base": [], "this": []}
        for round_ in range(1, args.rounds + 1):
            for name, tree in trees.items():
                wall, training, cpu, loss = run_demo(tree, args.flags)
                runs[name].append((wall, training, cpu))
                print(f"round {round_} {name:4s}: wall {wall:6.1f} s, training {training:4d} s, "
                      f"CPU {cpu:6.1f} s, loss {loss}", flush=True)
    for index, what in ((0, "wall"), (1, "training"), (2, "CPU")):
        base = statistics.median(r[index] for r in runs["base"])
        this = statistics.median(r[index] for r in runs["this"])
        print(f"median {what}: base {base:.1f} s, this tree {this:.1f} s, ratio {this / base:.2f}")


if __name__ == "__main__":
    main()
