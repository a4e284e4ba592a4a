"""Bucketed data parallelism on CUDA (skipped without CUDA; one GPU, so one rank).

One GPU holds one rank: there is no data-parallel peer, so these checks run the reductions'
stream machinery with no collective (the buffers' group is None; ``dp=2`` still makes every
bucket's division run on the DP stream): the DP stream waits for the backward through an
event, the compute stream waits for the DP stream, no host sync in the step (CUDA's sync debug
mode raises on one), and the results are bitwise the plain path's. A large first layer makes
the backward slow, so a missing wait would divide gradients not yet written.
"""

import os

import pytest
import torch
from torch import nn

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from megapipe.pipeline.grad_sync import is_expert_param  # noqa: E402
from megapipe.train.optim.dp_sync import DataParallelSync  # noqa: E402
from megapipe.train.optim.flat_adamw import FlatAdamW  # noqa: E402
from megapipe.train.optim.grad_buffers import stage_buffers  # noqa: E402


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2048, 2048), nn.Tanh(), nn.Linear(2048, 256), nn.Tanh(),
                         nn.Linear(256, 64)).cuda()


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(step)
    return model(torch.randn(512, 2048, device="cuda", generator=g)).square().mean()


@pytest.mark.parametrize("sharded", [False, True])
def test_overlapped_reduction_and_flat_adamw_on_cuda_are_the_plain_path(sharded):
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        model, reference = _model(0), _model(0)
        buffers = {0: stage_buffers(model, None, None, 300_000, sharded, is_expert_param)}
        sync = DataParallelSync({0: model}, buffers, 2, torch.device("cuda"), overlap=True,
                                overlap_param_gather=sharded)
        optimizer = FlatAdamW(buffers, sync, lr=1e-3, weight_decay=0.01)
        groups = [{"params": [p for p in reference.parameters() if p.ndim >= 2],
                   "weight_decay": 0.01},
                  {"params": [p for p in reference.parameters() if p.ndim < 2],
                   "weight_decay": 0.0}]
        torch_adamw = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)
        for step in range(4):
            optimizer.zero_grad()
            torch_adamw.zero_grad()
            if step >= 1:  # the first step learns the gradient counts (one host read)
                torch.cuda.set_sync_debug_mode("error")
            try:
                sync.step_started([0])
                sync.before_last_backward(0)
                _loss(model, step).backward()
                sync.after_last_backward(0)
                sync.stage_grads_final(0)
                sync.step_finished()
                sync.finish_grad_sync()
                optimizer.step()
                sync.start_param_gather()
            finally:
                torch.cuda.set_sync_debug_mode(0)
            _loss(reference, step).backward()
            for p in reference.parameters():
                p.grad.div_(2)  # what the reduction does with dp = 2 and no peer
            torch_adamw.step()
        sync.finish_param_gather()
        for got, want in zip(model.parameters(), reference.parameters()):
            assert torch.equal(got, want)
        assert len(buffers[0][0].buckets) > 1
        sync.close()
    finally:
        torch.use_deterministic_algorithms(False)
