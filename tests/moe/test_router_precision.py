"""The router in a bf16 model: logits in bf16 (default) or fp32/fp64 (``router_dtype``,
Megatron's --moe-router-dtype); softmax/sigmoid, top-k and the auxiliary losses in fp32."""

import pytest
import torch

from megapipe.moe import MoEConfig, MoELayer, Router
from megapipe.moe.router import load_balancing_loss, z_loss

H, E, K = 16, 8, 2


def _router(router_dtype=None, score_function="softmax") -> Router:
    router = Router(H, E, K, score_function, seed=3, init_std=0.5, router_dtype=router_dtype)
    return router.to(torch.bfloat16)


def _tokens() -> torch.Tensor:
    return torch.randn(64, H, generator=torch.Generator().manual_seed(0)).bfloat16()


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_bf16_logits_with_fp32_scores_top_k_and_losses(score_function):
    router, tokens = _router(score_function=score_function), _tokens()
    out = router.reference(tokens)
    logits = torch.nn.functional.linear(tokens, router.weight)  # bf16 GEMM
    assert logits.dtype == torch.bfloat16 and out.probs.dtype == torch.bfloat16
    exact = logits.float()
    if score_function == "softmax":
        scores = torch.softmax(exact, dim=-1)
        probs, indices = torch.topk(scores, K, dim=-1)
        balance = scores
    else:
        scores = torch.sigmoid(exact)
        top, indices = torch.topk(scores, K, dim=-1)
        probs = top / top.sum(-1, keepdim=True)
        balance = scores / scores.sum(-1, keepdim=True)
    assert torch.equal(out.indices, indices)  # top-k of fp32 scores: no ties made by rounding
    assert torch.equal(out.probs, probs.bfloat16())
    assert out.load_balancing_loss.dtype == out.z_loss.dtype == torch.float32
    assert torch.equal(out.load_balancing_loss, load_balancing_loss(balance, indices, E))
    assert torch.equal(out.z_loss, z_loss(exact))
    routed = router(tokens)  # the fused path the layer takes: the same probs and choices
    assert torch.equal(routed.probs, out.probs) and torch.equal(routed.indices, out.indices)


@pytest.mark.parametrize("router_dtype,dtype", [("fp32", torch.float32), ("fp64", torch.float64)])
def test_router_dtype_computes_the_logits_in_that_precision(router_dtype, dtype):
    router, tokens = _router(router_dtype), _tokens()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # must not pull the GEMM back to bf16
        out = router.reference(tokens)
        routed = router(tokens)  # the fused path the layer takes: the same probs and choices
    assert torch.equal(routed.probs, out.probs) and torch.equal(routed.indices, out.indices)
    exact = torch.nn.functional.linear(tokens.to(dtype), router.weight.to(dtype))
    assert out.probs.dtype == dtype
    assert torch.equal(out.z_loss, z_loss(exact))
    assert torch.equal(out.indices, torch.topk(torch.softmax(exact, -1), K, -1).indices)


def test_bad_router_dtype_is_named():
    with pytest.raises(ValueError, match="router_dtype='bf16' is not one of"):
        MoEConfig(hidden_size=H, num_experts=E, top_k=K, ffn_hidden_size=8, router_dtype="bf16")


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_bf16_moe_layer_stays_close_to_fp32(capacity_factor):
    config = MoEConfig(hidden_size=H, num_experts=E, top_k=K, ffn_hidden_size=16, init_std=0.2,
                       aux_loss_coeff=0.1, capacity_factor=capacity_factor)
    fp32 = MoELayer(config, layer_index=1, seed=5)
    bf16 = MoELayer(config, layer_index=1, seed=5).to(torch.bfloat16)
    x = torch.randn(2, 32, H, generator=torch.Generator().manual_seed(1))
    y32, y16 = fp32(x), bf16(x.bfloat16())
    assert y16.dtype == torch.bfloat16
    # routing picks the same experts here, so only bf16 rounding separates the outputs
    torch.testing.assert_close(y16.float(), y32, rtol=3e-2, atol=3e-2 * y32.abs().max().item())
    y16.float().square().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in bf16.parameters())
