"""Rank side of the activation meter's two-rank test: a toy pipeline measured exactly."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megapipe.pipeline.executor import PipelineExecutor
from megapipe.pipeline.executor_options import ExecutorOptions
from megapipe.pipeline.p2p import TensorSpec
from megapipe.schedule import build_schedule


class Toy(nn.Module):
    """``sin(x) * w``: saves x and sin(x) (and w, a parameter, not counted)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * self.w


def toy_pipeline_peak(n: int, microbatches: int) -> int:
    """GPipe over this pool's 2 ranks, one Toy stage each: this rank's measured peak."""
    rank = dist.get_rank()
    schedule = build_schedule("gpipe", 2, microbatches)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(n, generator=gen) for _ in range(microbatches)]
    targets = [torch.randn(n, generator=gen) for _ in range(microbatches)]
    with PipelineExecutor(schedule, {rank: Toy(n)},
                          ExecutorOptions(spec=TensorSpec((n,), torch.float32),
                                          loss_fn=lambda o, t: (o * t).sum(),
                                          measure_activations=True, timeout=30.0)) as executor:
        result = executor.step(inputs if rank == 0 else None, targets if rank == 1 else None)
    assert result.activation_bytes is not None
    return result.activation_bytes
