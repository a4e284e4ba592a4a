"""replay: the DeepSeek-V3 replay (``overlap.py --replay``) on the device machine's cores.

The replay runs the real engine in four gloo processes whose every node sleeps out its profile
time, so it measures the engine's issue order, not a GPU. On the 2-core development machine the
four processes' host threads and comm workers share two cores, and the combined step's measured
host cost per node was about twice the one the model assumes; on the device machine (16 cores,
a core per thread) the same run settles whether the targets of the replay (a layer pair 1.8x,
interleaved 1F1B 1.85x) are reached. The section runs the replay's default command as a
subprocess and records its schedule lines and speedup; a dry run replays a short profile.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

PROFILE = "benchmarks/profiles/deepseek_v3_h800.json"
_SPEEDUP = re.compile(r"^speedup: ([0-9.]+)$", re.M)


def command(dry_run: bool) -> list[str]:
    cmd = [sys.executable, "benchmarks/overlap.py", "--replay", PROFILE]
    if dry_run:  # the CPU dry run: the same code, short
        cmd += ["--schedules", "1f1b", "--rounds", "1", "--microbatches", "2", "--moe-layers",
                "1", "--time-scale", "0.1", "--no-calibration", "--no-pair"]
    return cmd


def run(ctx, result) -> None:  # noqa: ANN001
    cmd = command(ctx.dry_run)
    result.figure("cores", os.cpu_count() or 1, "cores", headline=True)
    result.figure("command", " ".join(cmd[1:]))
    try:
        done = subprocess.run(cmd, cwd=ctx.repo, capture_output=True, text=True,
                              timeout=max(ctx.time_left() - 3, 5))
    except subprocess.TimeoutExpired:
        result.fail("the replay did not finish in the section's time")
        return
    text = done.stdout + done.stderr
    print(text, flush=True)
    if done.returncode != 0:
        result.fail(f"the replay exited {done.returncode}: {text.strip().splitlines()[-1:]}")
        return
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    result.table("replay output", ["line"], [[line] for line in lines])
    match = _SPEEDUP.search(done.stdout)
    if match is None:
        result.fail("the replay printed no speedup line")
        return
    result.figure("speedup", float(match.group(1)), "x", "the headline schedule, combined / "
                  "plain", headline=True)
