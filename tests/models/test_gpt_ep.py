"""The MoE GPT with experts spread over 2 ranks equals the single-process model (gloo, CPU)."""

import torch
import torch.distributed as dist

from megapipe.models.config import GPTConfig
from megapipe.models.gpt import gpt_loss
from megapipe.models.split import build_stage

CONFIG = GPTConfig(num_layers=3, first_k_dense_layers=1, moe_top_k=2)


def _batch(rank):
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, CONFIG.vocab_size, (2 + rank, CONFIG.seq_length + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _loss_and_grads(model, rank):
    tokens, labels = _batch(rank)
    loss = gpt_loss(model(tokens), labels)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _ep_vs_local():
    """On each rank: the ep=2 model on this rank's batch, and the ep=1 model on every batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sharded = build_stage(CONFIG, 0, 1, ep_group=dist.group.WORLD)
    loss, grads = _loss_and_grads(sharded, rank)
    reference = [_loss_and_grads(build_stage(CONFIG, 0, 1), r) for r in range(world)]
    params = dict(sharded.named_parameters())
    return (
        rank,
        loss,
        grads,
        {n: getattr(p, "expert_parallel", False) for n, p in params.items()},
        reference,
    )


def test_ep2_model_equals_single_process_model(rank_pools):
    local_experts = CONFIG.num_experts // 2
    for rank, loss, grads, is_expert, reference in rank_pools(2).run(_ep_vs_local):
        ref_loss, ref_grads = reference[rank]
        assert loss == ref_loss
        assert any(is_expert.values())
        for name, grad in grads.items():
            if not is_expert[name]:
                # dense and router parameters see only this rank's tokens
                torch.testing.assert_close(grad, ref_grads[name], rtol=1e-6, atol=1e-7, msg=name)
                continue
            # this rank's experts [rank*L, (rank+1)*L) get gradients from both ranks' tokens
            full = sum(ref[1][name] for ref in reference)[
                rank * local_experts : (rank + 1) * local_experts
            ]
            torch.testing.assert_close(grad, full, rtol=1e-5, atol=1e-7, msg=name)
