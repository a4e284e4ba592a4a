"""The machine's ceilings: copy bandwidth and matrix-multiply throughput, measured."""

from __future__ import annotations

import torch

from gpu_sections.gpu_timing import median_ms


def copy_gbs(device: torch.device, num_bytes: int, reps: int = 5) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read and written."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, reps=reps, warmup=2).device_ms
    return 2 * src.numel() * 4 / (ms * 1e6)


def matmul_tflops(device: torch.device, n: int, dtype: torch.dtype, reps: int = 5) -> float:
    """TFLOP/s of an n x n x n matrix product on random data."""
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    ms = median_ms(lambda: a @ b, device, reps=reps, warmup=2).device_ms
    return 2 * n**3 / (ms * 1e9)
