"""kernels: every fused operator of ``megapipe.kernels`` (``fused_ops.py``: permute,
sum_choices, unpermute_backward, rms_norm and its backward, swiglu and its backward, router and
its backward, routing_rows) at one real shape, each with:

- **GPU ms** per call (median of CUDA-event timings) and **GB/s**, the bytes it must move at
  least (every tensor read and written once) over that time;
- **share of HBM bandwidth**: those GB/s over the copy bandwidth measured here (read + write);
- **host us per launch**: the host's time to issue one call, ``n`` calls back to back without a
  sync over ``n`` (the launch queue never fills at these kernel lengths), beside the same for one
  aten op (``torch.add`` of two small tensors): what a host-bound step pays per fused operator;
- the first call's host seconds (a Triton compile, or a load from the check's Triton cache).

On CPU (a dry run) each operator runs once on tiny inputs, so the cases are checked, and its
three figures are reported as skipped with the reason. Target (issue 12, reported, never
asserted): the permute and unpermute operators at least 70 % of the copy bandwidth.
"""

from __future__ import annotations

import time

import torch

from gpu_sections.fused_ops import DRY, OPERATORS, REAL, cases
from gpu_sections.gpu_timing import median_ms, synchronize, time_ms
from gpu_sections.measure import copy_gbs
from megapipe.kernels import HAS_TRITON

LAUNCHES = 200  # calls per host-time measurement
PERMUTATION = ("permute", "sum_choices", "unpermute_backward")
COLUMNS = ["operator", "GPU ms", "GB moved", "GB/s", "share of HBM bandwidth",
           "host us per launch", "first call s"]


def host_us_per_launch(fn, device: torch.device, launches: int = LAUNCHES) -> float:  # noqa: ANN001
    """Host microseconds per call of ``fn`` issued ``launches`` times without a sync."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(launches):
        fn()
    elapsed = time.perf_counter() - start
    synchronize(device)
    return elapsed / launches * 1e6


def run(ctx, result) -> None:  # noqa: ANN001
    shape = REAL if ctx.cuda else DRY
    result.figure("shape", shape.describe())
    made = cases(shape, ctx.device)
    assert tuple(c.operator for c in made) == OPERATORS, "a fused operator without a case"
    if not ctx.cuda:
        rows = []
        for case in made:
            outputs = case.call()
            rows.append([case.operator, case.moved_bytes(outputs)])
            result.skip(f"{case.operator}: GPU ms, share of HBM bandwidth, host us per launch",
                        ctx.no_gpu)
        result.table("fused operators (ran once on the CPU)", ["operator", "bytes moved"], rows)
        return
    if not HAS_TRITON:
        result.note("Triton is not installed: each operator runs its plain-torch reference "
                    "(several kernels), not its one Triton kernel")
    copy = copy_gbs(ctx.device, 2**30)
    result.figure("copy_gbs", copy, "GB/s", "copy bandwidth (read + write), the HBM ceiling")
    small = torch.ones(16, device=ctx.device)
    aten_us = host_us_per_launch(lambda: torch.add(small, small), ctx.device)
    result.figure("aten_host_us", aten_us, "us", "host us per launch of one aten op (torch.add)")
    rows, shares, hosts = [], {}, {}
    for case in made:
        if not ctx.enough_time(result, f"{case.operator} timings", 3.0):
            break
        first = time_ms(case.call, ctx.device)
        outputs = case.call()
        moved = case.moved_bytes(outputs)
        timed = median_ms(case.call, ctx.device, reps=5, warmup=1)
        gbs = moved / (timed.device_ms * 1e6)
        shares[case.operator] = gbs / copy
        hosts[case.operator] = host_us_per_launch(case.call, ctx.device)
        rows.append([case.operator, timed.device_ms, moved / 1e9, gbs, shares[case.operator],
                     hosts[case.operator], first.host_ms / 1e3])
        result.table(f"fused operators, bf16, {shape.describe()}", COLUMNS, rows)
    if not shares:
        return
    slowest = min(shares, key=shares.get)
    result.figure("worst_share", shares[slowest] * 100, "%",
                  f"lowest share of HBM bandwidth ({slowest})", headline=True)
    costly = max(hosts, key=hosts.get)
    result.figure("worst_host_us", hosts[costly], "us",
                  f"highest host us per launch ({costly}; aten op {aten_us:.1f})", headline=True)
    permutation = [shares[op] for op in PERMUTATION if op in shares]
    if permutation:
        share = min(permutation) * 100
        result.target("permute / unpermute operators, slowest, share of copy bandwidth", share,
                      ">= 70 %", share >= 70)
