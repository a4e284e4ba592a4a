"""The long-run benchmark's probes (``benchmarks/long_run.py``) on this process: a tensor made
between two samples shows in the live-tensor bytes, the C heap and the resident bytes, and the
slope over the last half of a run is the growth per iteration."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from long_run import FIELDS, _libc, sample, summarize  # noqa: E402

MIB = 2**20


def test_a_new_tensor_shows_in_every_probe() -> None:
    libc = _libc()
    before = dict(zip(FIELDS, sample(libc)))
    # 64 MiB of float32, written: above glibc's largest mmap threshold (32 MiB), so fresh pages
    # whatever free heap the process kept before (a smaller block may reuse resident pages)
    kept = torch.ones(64 * MIB // 4)
    after = dict(zip(FIELDS, sample(libc)))
    assert after["tensors"] - before["tensors"] == 64 * MIB
    assert after["heap_used"] - before["heap_used"] >= 64 * MIB
    assert after["rss"] - before["rss"] >= 60 * MIB  # the pages written
    assert after["objects"] >= before["objects"]
    del kept


def test_the_slope_is_over_the_last_half() -> None:
    # flat for 10 samples (warm-up: 1 MiB per iteration), then +100 bytes per iteration
    rows = [(i * 10, 50 * MIB + min(i, 5) * 10 * MIB + max(i - 5, 0) * 1000, 0, 0, 0, 0)
            for i in range(10)]
    end, per_iteration = summarize(rows)["rss"]
    assert end == rows[-1][1] and per_iteration == 100.0
