"""Tiny layers that follow the node protocol, for the overlap engine's tests.

``ToyMoE``: attention (compute) -> dispatch (comm: all_to_all over a gloo group, or a row roll
without one) -> experts (compute) -> combine (comm) -> finish (compute), with the residual passed
through every node explicitly. ``ToyDense``: one compute node. ``ToyOpaque``: no node_plan.
A comm node may sleep after its collective to emulate a slow link.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from megapipe.moe.grouped_gemm import grouped_matmul
from megapipe.overlap.plan import LayerState, Node, NodeKind


class AllToAll(torch.autograd.Function):
    """Equal-split all_to_all over ``group``; its backward is the reverse all_to_all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, sleep_s: float) -> torch.Tensor:
        ctx.group, ctx.sleep_s = group, sleep_s
        return _all_to_all(x, group, sleep_s)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad.contiguous(), ctx.group, ctx.sleep_s), None, None


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup | None, sleep_s: float) -> torch.Tensor:
    if group is None:
        out = torch.roll(x, 1, dims=0)
    else:
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
    if sleep_s:
        time.sleep(sleep_s)
    return out


def _roll(x: torch.Tensor, sleep_s: float) -> torch.Tensor:
    out = torch.roll(x, 1, dims=0)
    if sleep_s:
        time.sleep(sleep_s)
    return out


def exchange(x: torch.Tensor, group: dist.ProcessGroup | None, sleep_s: float) -> torch.Tensor:
    if group is None:
        return _Roll.apply(x, sleep_s)
    return AllToAll.apply(x, group, sleep_s)


class _Roll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, sleep_s: float) -> torch.Tensor:
        ctx.sleep_s = sleep_s
        return _roll(x, sleep_s)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = torch.roll(grad, -1, dims=0)
        if ctx.sleep_s:
            time.sleep(ctx.sleep_s)
        return out, None


class Sleep(torch.autograd.Function):
    """Identity that sleeps in forward and in backward: compute of a known duration."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.seconds)
        return grad.clone(), None


class ToyMoE(nn.Module):
    """A MoE-shaped layer of five nodes on ``x [t, h]`` (t divisible by the group size)."""

    def __init__(
        self,
        hidden: int,
        experts: int = 2,
        group: dist.ProcessGroup | None = None,
        seed: int = 0,
        sleep_s: float = 0.0,
        compute_repeats: int = 1,
        compute_sleep_s: float = 0.0,
    ) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.attn = nn.Parameter(torch.randn(hidden, hidden, generator=g) * 0.3)
        self.w_in = nn.Parameter(torch.randn(experts, hidden, 2 * hidden, generator=g) * 0.3)
        self.w_out = nn.Parameter(torch.randn(experts, 2 * hidden, hidden, generator=g) * 0.3)
        self.scale = nn.Parameter(torch.ones(hidden) + 0.1 * torch.randn(hidden, generator=g))
        self.group = group
        self.sleep_s = sleep_s
        self.compute_repeats = compute_repeats  # extra matmuls so compute takes measurable time
        self.compute_sleep_s = compute_sleep_s  # attention and experts last this long (F and B)

    def node_plan(self) -> list[Node]:
        return [
            Node("attention", NodeKind.COMPUTE, self._attention),
            Node("dispatch", NodeKind.COMM, self._dispatch, group=self.group),
            Node("experts", NodeKind.COMPUTE, self._experts),
            Node("combine", NodeKind.COMM, self._combine, group=self.group),
            Node("finish", NodeKind.COMPUTE, self._finish),
        ]

    def _burn(self, y: torch.Tensor) -> torch.Tensor:
        for _ in range(self.compute_repeats - 1):
            y = torch.tanh(y @ self.attn) * 0.5 + y * 0.5
        if self.compute_sleep_s:
            y = Sleep.apply(y, self.compute_sleep_s)
        return y

    def _attention(
        self, state: LayerState, t: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...]:
        (x,) = t
        y = torch.tanh(x @ self.attn)
        return (x, self._burn(y))

    def _dispatch(self, state: LayerState, t: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x, y = t
        return (x, exchange(y, self.group, self.sleep_s))

    def _experts(self, state: LayerState, t: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x, z = t
        n = z.shape[0]
        counts = (
            [n // 2, n - n // 2]
            if self.w_in.shape[0] == 2
            else [n] + [0] * (self.w_in.shape[0] - 1)
        )
        h = torch.relu(grouped_matmul(z, counts, self.w_in, state))
        return (x, self._burn(grouped_matmul(h, counts, self.w_out, state)))

    def _combine(self, state: LayerState, t: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x, z = t
        return (x, exchange(z, self.group, self.sleep_s))

    def _finish(self, state: LayerState, t: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x, u = t
        return (x + u * self.scale,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megapipe.overlap.plan import run_nodes

        return run_nodes(self.node_plan(), (x,))[0]


class ToyDense(nn.Module):
    """One compute node: ``x + tanh(x @ w)``."""

    def __init__(self, hidden: int, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed + 1000)
        self.w = nn.Parameter(torch.randn(hidden, hidden, generator=g) * 0.3)

    def node_plan(self) -> list[Node]:
        return [Node("dense", NodeKind.COMPUTE, self._dense)]

    def _dense(self, state: LayerState, t: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        (x,) = t
        return (x + torch.tanh(x @ self.w),)


class ToyOpaque(nn.Module):
    """A layer without a node plan (runs only as a whole)."""

    def __init__(self, hidden: int, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed + 2000)
        self.w = nn.Parameter(torch.randn(hidden, hidden, generator=g) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sin(x @ self.w)


def toy_stack(
    kinds: str, hidden: int = 8, group: dist.ProcessGroup | None = None, seed: int = 0, **moe_kwargs
) -> nn.ModuleList:
    """Layers from a string: 'm' ToyMoE, 'd' ToyDense, 'o' ToyOpaque (e.g. 'dmm')."""
    layers = []
    for i, k in enumerate(kinds):
        if k == "m":
            layers.append(ToyMoE(hidden, group=group, seed=seed + i, **moe_kwargs))
        elif k == "d":
            layers.append(ToyDense(hidden, seed=seed + i))
        elif k == "o":
            layers.append(ToyOpaque(hidden, seed=seed + i))
        else:
            raise ValueError(f"unknown layer kind {k!r} in {kinds!r}")
    return nn.ModuleList(layers)
