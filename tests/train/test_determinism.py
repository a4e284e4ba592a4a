"""``deterministic_kernels``: torch's deterministic settings inside the block, the previous ones
after; the non-strict form routes attention to the math backend."""

import os

import pytest
import torch
import torch.nn.functional as F

from megapipe.train.determinism import CUBLAS_WORKSPACE_CONFIG, deterministic_kernels


@pytest.mark.parametrize("strict", [True, False])
def test_settings_hold_inside_and_are_restored_after(strict, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.backends.cudnn.benchmark = True
    try:
        with deterministic_kernels(strict=strict):
            assert torch.are_deterministic_algorithms_enabled()
            assert torch.is_deterministic_algorithms_warn_only_enabled() == (not strict)
            assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
            assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE_CONFIG
            assert torch.backends.cuda.flash_sdp_enabled() == strict
            assert torch.backends.cuda.math_sdp_enabled()
        assert not torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.benchmark and not torch.backends.cudnn.deterministic
        assert torch.backends.cuda.flash_sdp_enabled()
    finally:
        torch.backends.cudnn.benchmark = False


def test_a_users_cublas_setting_is_kept(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    with deterministic_kernels():
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_restored_even_when_the_block_raises():
    with pytest.raises(ValueError), deterministic_kernels():
        raise ValueError("boom")
    assert not torch.are_deterministic_algorithms_enabled()


def test_math_attention_inside_agrees_with_the_default_on_cpu():
    q, k, v = (torch.randn(2, 2, 16, 8, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    outside = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with deterministic_kernels(strict=False):
        inside = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(inside, outside, atol=1e-6)
