"""Rank-side code of the data-parallel tests: ``DataParallelSync`` driven by hand on toy
modules, and pretrain jobs whose optimizer state is measured."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megapipe.pipeline.grad_sync import is_expert_param
from megapipe.train.optim.dp_sync import DataParallelSync
from megapipe.train.optim.grad_buffers import stage_buffers


def _toy(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4))


def _backward(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(3, 8, generator=g)).square().sum().backward()


def early_reduction_case(sharded: bool) -> dict[str, Any]:
    """Two steps of a toy stage, each one backward in the stage's last-backward phase. Returns
    how many buckets had started before ``stage_grads_final`` in each step, whether the reduced
    gradients equal a plain all-reduce average, and the error a second backward in the phase
    raises in step 3."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _toy(0)
    reference = _toy(0)
    buffers = {0: stage_buffers(model, dist.group.WORLD, None, 64 * world, sharded,
                                is_expert_param)}
    sync = DataParallelSync({0: model}, buffers, world, torch.device("cpu"), overlap=True)
    out: dict[str, Any] = {"started_early": []}
    try:
        for step in range(2):
            buffers[0][0].zero_grad()
            reference.zero_grad()
            sync.step_started([0])
            sync.before_last_backward(0)
            _backward(model, 10 * step + rank)
            out["started_early"].append(sync._next[id(buffers[0][0])])
            sync.stage_grads_final(0)
            sync.step_finished()
            sync.finish_grad_sync()
            _backward(reference, 10 * step + rank)
        grads = [p.grad for p in reference.parameters()]
        for grad in grads:
            dist.all_reduce(grad)
            grad.div_(world)
        buffer = buffers[0][0]
        equal = True
        for piece in buffer.pieces():
            want = dict(zip(map(id, model.parameters()), grads))[id(piece.param)]
            got = buffer.grad[piece.start:piece.end]
            equal &= torch.equal(got, want.reshape(-1)[piece.lo:piece.hi])
        out["equal"] = bool(equal)
        out["buckets"] = len(buffer.buckets)
        sync.step_started([0])
        sync.before_last_backward(0)
        _backward(model, 99)
        try:
            _backward(model, 98)  # a second gradient for buckets already being reduced
        except RuntimeError as error:
            out["error"] = str(error)
        sync.finish_grad_sync()
    finally:
        sync.close()
    return out


class _UsesChildWeight(nn.Module):
    """A module that reads its child's weight without calling the child."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.outer = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(F.linear(x, self.inner.weight, self.inner.bias))


def gather_outside_forward_case() -> str:
    """--overlap-param-gather with a parameter used outside its module's forward: one clear
    error at the end of the stage's last backward."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = _UsesChildWeight()
    buffers = {0: stage_buffers(model, dist.group.WORLD, None, 64 * world, True, is_expert_param)}
    sync = DataParallelSync({0: model}, buffers, world, torch.device("cpu"), overlap=True,
                            overlap_param_gather=True)
    try:
        for _ in range(2):
            buffers[0][0].zero_grad()
            sync.step_started([0])
            model(torch.randn(2, 4)).sum().backward()
            sync.before_last_backward(0)
            try:
                sync.stage_grads_final(0)
            except RuntimeError as error:
                return str(error)
            sync.step_finished()
            sync.finish_grad_sync()
            sync.start_param_gather()
        return "no error"
    finally:
        sync.finish_param_gather()
        sync.close()


def optimizer_state_bytes(argv: list[str]) -> int:
    """Bytes of optimizer state on this rank for the job the flags build."""
    from megapipe.train.checkpoint.state import ensure_optimizer_state
    from megapipe.train.config.parse import parse_pretrain_args
    from megapipe.train.job import build_job
    from megapipe.train.optim.adamw import optimizer_state_bytes

    job = build_job(parse_pretrain_args(argv, env={}))
    try:
        ensure_optimizer_state(job.optimizer)  # what a torch AdamW makes at its first step
        return optimizer_state_bytes(job.optimizer)
    finally:
        job.close()


def graph_replay_losses(argv: list[str]) -> Any:
    """pretrain's losses with ``--cuda-graph-impl local`` through the CPU graph stand-in (which
    replays like CUDA: no module hook runs at a replay)."""
    import megapipe.pipeline.executor as executor_module
    from megapipe.train.config.parse import parse_pretrain_args
    from megapipe.train.loop import train
    from support.fake_graphs import FakeGraphApi

    real = executor_module.node_graphs

    def with_stand_in(impl: str, modules: Any, device: Any, api: Any = None) -> Any:
        return real(impl, modules, device, FakeGraphApi() if impl != "none" else api)

    executor_module.node_graphs = with_stand_in
    try:
        return train(parse_pretrain_args(argv, env={}), write=lambda line: None).losses
    finally:
        executor_module.node_graphs = real
