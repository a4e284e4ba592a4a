"""env: the device, its clocks and memory, the software versions, and the measured ceilings
(device-to-device copy bandwidth, bf16 matrix-multiply TFLOP/s) the other sections compare with."""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess

import torch

from gpu_sections.measure import copy_gbs, matmul_tflops

SMI_FIELDS = ("driver_version", "clocks.sm", "clocks.max.sm", "clocks.mem", "clocks.max.mem",
              "power.limit")


def run(ctx, result) -> None:  # noqa: ANN001
    _versions(result)
    if ctx.gpu_or_skip(result, "device properties and nvidia-smi clocks"):
        _device(ctx, result)
        _clocks(result)
    else:
        result.figure("device", f"CPU ({platform.processor() or platform.machine()})",
                      headline=True)
    result.figure("cpus", os.cpu_count() or 0)
    copy_bytes, gemm_n = (2**30, 8192) if ctx.cuda else (2**24, 256)
    result.figure("copy_gbs", copy_gbs(ctx.device, copy_bytes), "GB/s",
                  f"copy bandwidth ({copy_bytes >> 20} MiB, read + write)", headline=True)
    result.figure("bf16_tflops", matmul_tflops(ctx.device, gemm_n, torch.bfloat16), "TFLOP/s",
                  f"bf16 GEMM {gemm_n}^3", headline=True)
    if ctx.cuda:
        precision = torch.get_float32_matmul_precision()
        result.figure("fp32_tflops", matmul_tflops(ctx.device, 4096, torch.float32), "TFLOP/s",
                      f"fp32 GEMM 4096^3 (float32 matmul precision {precision!r})")


def _versions(result) -> None:  # noqa: ANN001
    result.figure("torch", torch.__version__, headline=True)
    result.figure("cuda", torch.version.cuda or "none (CPU build)")
    triton = "not installed"
    if importlib.util.find_spec("triton") is not None:
        import triton

        triton = triton.__version__
    result.figure("triton", triton)
    result.figure("python", platform.python_version())
    try:
        version = torch.cuda.nccl.version()
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    except (AttributeError, RuntimeError) as err:
        nccl = f"unavailable ({type(err).__name__})"
    result.figure("nccl", nccl)


def _device(ctx, result) -> None:  # noqa: ANN001
    props = torch.cuda.get_device_properties(ctx.device)
    result.figure("device", props.name, headline=True)
    result.figure("capability", f"{props.major}.{props.minor}")
    result.figure("sms", props.multi_processor_count, "", "multiprocessors")
    result.figure("memory_gib", props.total_memory / 2**30, "GiB", "memory")
    l2 = getattr(props, "L2_cache_size", None)
    if l2 is not None:
        result.figure("l2_mib", l2 / 2**20, "MiB", "L2 cache")


def _clocks(result) -> None:  # noqa: ANN001
    smi = shutil.which("nvidia-smi")
    if smi is None:
        result.skip("clocks and driver", "nvidia-smi is not on the PATH")
        return
    query = [smi, f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"]
    done = subprocess.run(query, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        result.skip("clocks and driver", f"nvidia-smi failed: {done.stderr.strip()[:200]}")
        return
    values = [v.strip() for v in done.stdout.splitlines()[0].split(",")]
    units = {"clocks": "MHz", "power": "W"}
    for field, value in zip(SMI_FIELDS, values):
        result.figure(field.replace(".", "_"), value, units.get(field.split(".")[0], ""), field)
