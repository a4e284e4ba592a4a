"""The Triton kernels compiled for sm_90 (and sm_100) on this CPU through the stand-in driver
(``megapipe.kernels.standin_driver``): they compile at the shapes users run, spill no register
up to 256 experts and top-8, launch with FP fusion pinned off, and the routing rows and the
RMSNorm weight gradient fill an H100's 132 SMs at 4096 tokens. The default run compiles the
kernels this concerns at one shape each (the router at its worst: 256 experts, top-8, bf16,
sigmoid and softmax renormalised); ``heavy`` (``MEGAPIPE_HEAVY=1``) compiles
every kernel at every shape of ``benchmarks/kernel_registers.py`` for both architectures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import kernel_registers as KR  # noqa: E402
from megapipe.kernels.standin_driver import compiling_for  # noqa: E402

H100_SMS = 132


def _assert_lean(rows: list[KR.Row]) -> None:
    for row in rows:
        launch = row.launch
        assert launch.stack_bytes == 0, f"{launch.kernel} {row.shape} spills: {launch}"
        assert launch.registers < 255, f"{launch.kernel} {row.shape} at the register limit"
        assert not launch.fp_fusion, f"{launch.kernel} {row.shape} compiled with FP fusion"


def test_the_reworked_kernels_compile_for_sm90_without_spills_and_fill_an_h100():
    from megapipe.kernels import triton_norm as TN, triton_router as TR

    tokens = 4096
    x, w = torch.empty(tokens, 1024, dtype=torch.bfloat16), torch.empty(1024, dtype=torch.bfloat16)
    rstd = torch.empty(tokens)
    shapes = [(f"E=256 k=8 {mode} {i}", call)
              for mode in ("sigmoid", "renormalised")
              for i, call in enumerate(KR.router_launches(tokens, 256, 8,
                                                          *KR.ROUTER_MODES[mode]))]
    shapes += [("E=8 k=2 rows", KR.rows_launches(tokens, 8, 2)[0]),
               ("h=1024 norm backward", lambda: TN.rms_norm_backward(x, x, w, rstd, None))]
    rows = KR.compile_all(90, shapes)
    _assert_lean(rows)
    *routers, rows_launch, norm = (row.launch for row in rows)
    kernels = ["_router_kernel", "_router_backward_kernel"] * 2
    assert [launch.kernel for launch in routers] == kernels
    # the routing rows: experts x parts programs; the norm: dweight column programs, then one
    # per row
    grid = rows_launch.grid
    assert rows_launch.kernel == "_rows_kernel" and grid[0] * grid[1] >= H100_SMS
    assert norm.grid[0] - tokens == 1024 // TN.dweight_columns(1024) >= H100_SMS
    assert TR.rows_parts(tokens * 2, 8) == (32, 256)


def test_the_stand_in_driver_leaves_triton_as_it_found_it():
    from triton.runtime.driver import driver

    # a kernel compiled before (Triton keeps it, with its launcher) is recorded again
    for _ in range(2):
        assert [row.launch.kernel for row in
                KR.compile_all(90, [("rows", KR.rows_launches(64, 8, 2)[0])])] == ["_rows_kernel"]

    before = driver._active
    with pytest.raises(ZeroDivisionError):
        with compiling_for(90):
            raise ZeroDivisionError
    assert driver._active is before
    with pytest.raises(ValueError, match="arch=75"):
        with compiling_for(75):
            pass


@pytest.mark.heavy
@pytest.mark.parametrize("arch", [90, 100])
def test_every_kernel_compiles_at_every_real_shape_without_spills(arch):
    rows = KR.compile_all(arch, KR.cases())
    assert len(rows) == len(KR.HIDDEN) * 7 + len(KR.EXPERTS) * (len(KR.TOP_K) * 6 + 2)
    _assert_lean(rows)
