"""Token permute/unpermute: the plain-torch reference against a naive loop (float32 and bf16, with
padding rows) and gradcheck, and the Triton kernels against the reference under
TRITON_INTERPRET=1 on CPU (float32, float16; bf16 at the shapes users run in
test_kernel_shapes.py, and on CUDA in tests/gpu).

Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when
``megapipe.kernels.triton_permute`` is first imported; the interpreter check therefore runs in a
fresh subprocess (this file as a script) with the variable set.
"""

import os
import subprocess
import sys

import pytest
import torch

from megapipe.kernels import permute_tokens, reference, unpermute_tokens
from megapipe.moe.dispatcher import sort_by_expert


def routing(num_tokens: int, top_k: int, num_experts: int, capacity: int | None, seed: int):
    gen = torch.Generator().manual_seed(seed)
    indices = torch.stack(
        [torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]
    )
    row_choice, choice_rows, _ = sort_by_expert(indices, num_experts, capacity)
    probs = torch.rand(num_tokens, top_k, generator=gen)
    return row_choice, choice_rows, probs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_naive_loop(dtype):
    row_choice, choice_rows, probs = routing(6, 2, 3, capacity=3, seed=0)
    assert (choice_rows < 0).any() and (row_choice < 0).any()  # drops and padding rows
    tokens = torch.randn(6, 5).to(dtype)
    rows = permute_tokens(tokens, row_choice, choice_rows)
    assert rows.dtype == dtype
    for r, slot in enumerate(row_choice.tolist()):
        expected = torch.zeros(5, dtype=dtype) if slot < 0 else tokens[slot // 2]
        assert torch.equal(rows[r], expected)
    expert_out = torch.randn(rows.shape).to(dtype)
    out = unpermute_tokens(expert_out, probs.to(dtype), row_choice, choice_rows)
    assert out.dtype == dtype
    for t in range(6):
        expected = torch.zeros(5)
        for j in range(2):
            if choice_rows[t, j] >= 0:
                expected += probs.to(dtype)[t, j].float() * expert_out[choice_rows[t, j]].float()
        # float32 sums rounded once to the output dtype
        torch.testing.assert_close(out[t], expected.to(dtype))


def test_reference_gradcheck():
    row_choice, choice_rows, probs = routing(5, 3, 4, capacity=3, seed=1)
    tokens = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(
        lambda x: permute_tokens(x, row_choice, choice_rows), (tokens,)
    )
    rows = torch.randn(row_choice.numel(), 4, dtype=torch.float64, requires_grad=True)
    p = probs.double().requires_grad_()
    torch.autograd.gradcheck(
        lambda x, w: unpermute_tokens(x, w, row_choice, choice_rows), (rows, p)
    )


def compare_triton_with_reference(device: str) -> list[str]:
    """Forward and backward of both Triton kernels against the reference; failure messages."""
    from megapipe.kernels import triton_permute

    failures = []
    # t, k, E, capacity, h; the last walks its rows in two column blocks (h > MAX_BLOCK)
    cases = [(5, 2, 3, 3, 8), (4, 1, 4, None, 130), (3, 4, 4, 2, 16), (3, 2, 4, None, 2100)]
    dtypes = [(torch.float32, 1e-6), (torch.float16, 1e-3)]
    if device == "cuda":  # bf16 on CPU: test_kernel_shapes.py
        dtypes.append((torch.bfloat16, 1e-2))
    for dtype, tol in dtypes:
        for t, k, e, capacity, h in cases:
            row_choice, choice_rows, probs = routing(t, k, e, capacity, seed=t * h)
            row_choice, choice_rows, probs = (
                row_choice.to(device),
                choice_rows.to(device),
                probs.to(device),
            )
            gen = torch.Generator().manual_seed(t * h + 7)  # the same data on every run
            tokens = torch.randn(t, h, generator=gen).to(device, dtype)
            grad_rows = torch.randn(row_choice.numel(), h, generator=gen).to(device, dtype)
            grad_out = torch.randn(t, h, generator=gen).to(device, dtype)
            results = {}
            for name, m in (("triton", triton_permute), ("reference", reference)):
                # each is one operator (one launch on CUDA), forward and backward
                rows = m.permute(tokens, row_choice, k)
                grad_tokens = m.sum_choices(grad_rows, None, choice_rows)
                out = m.sum_choices(rows, probs, choice_rows)
                grad_rows_u, grad_probs = m.unpermute_backward(
                    grad_out, rows, probs, row_choice, choice_rows)
                results[name] = (rows, grad_tokens, out, grad_rows_u, grad_probs)
            labels = (
                "permute",
                "permute grad",
                "unpermute",
                "unpermute grad rows",
                "unpermute grad probs",
            )
            for label, a, b in zip(labels, results["triton"], results["reference"]):
                if a.dtype != b.dtype or a.shape != b.shape:
                    failures.append(
                        f"{dtype} {(t, k, e, capacity, h)} {label}: "
                        f"{a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
                    )
                    continue
                if label == "unpermute grad probs":
                    # A dot product over h features, summed in another order by each side: each
                    # may be off by h * u * sum|grad_out * rows| (u: fp32 unit roundoff, both
                    # accumulate in fp32), so they may differ by twice that, on top of `tol`.
                    rows = results["reference"][0].detach().float()
                    slots = choice_rows.clamp(min=0)
                    abs_dot = (grad_out.float().abs().unsqueeze(1) * rows.abs()[slots]).sum(-1)
                    abs_dot = abs_dot * (choice_rows >= 0)
                    bound = tol + 2 * h * (torch.finfo(torch.float32).eps / 2) * abs_dot
                    worst = ((a.float() - b.float()).abs() - bound).max().item()
                    if worst > 0:
                        failures.append(
                            f"{dtype} {(t, k, e, capacity, h)} {label}: exceeds the dot-product "
                            f"bound by {worst:.3g}"
                        )
                    continue
                try:
                    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
                except AssertionError as err:
                    failures.append(f"{dtype} {(t, k, e, capacity, h)} {label}: {err}")
    return failures


def test_triton_kernels_match_reference_under_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "interpreted: ok" in proc.stdout


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    problems = compare_triton_with_reference("cpu")
    if problems:
        print("\n".join(problems))
        sys.exit(1)
    print("interpreted: ok")
