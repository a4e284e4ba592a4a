"""The Triton kernels at the shapes users run, against their references, under Triton's
interpreter on CPU (bf16 included): router logits in bf16 full of ties (the top-k tie rule:
lowest expert index first, ``reference_fused.stable_top_k``), 64 to 256 experts, top-6 and
top-8, softmax (its top-k renormalised or not) and sigmoid, routing rows longer than a block
with experts that get no token, RMSNorm over thousands of rows, hidden sizes up to 7168. The
default run takes a few small ones (the interpreter runs a program in Python: thousands of rows
take minutes); the ``heavy`` marker (``MEGAPIPE_HEAVY=1``,
tests/conftest.py) takes them all. Triton reads
TRITON_INTERPRET when a kernel module is first imported, so the checks run this file as a
script in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megapipe.kernels import reference_fused as R


def tied_logits(tokens: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 logits on a grid of 9 values: most tokens tie at their k-th place."""
    return (torch.randint(-4, 5, (tokens, experts), generator=gen) * 0.25).to(torch.bfloat16)


def idle_routing(tokens: int, top_k: int, experts: int, idle: int,
                 gen: torch.Generator) -> torch.Tensor:
    """Choices ``[tokens, top_k]`` among all experts but ``idle`` of them (no token)."""
    busy = torch.randperm(experts, generator=gen)[idle:]
    picks = torch.stack([torch.randperm(busy.numel(), generator=gen)[:top_k]
                         for _ in range(tokens)])
    return busy[picks]


def test_stable_top_k_puts_the_lowest_expert_first_among_equal_scores():
    gen = torch.Generator().manual_seed(0)
    scores = tied_logits(50, 64, gen).float().sigmoid()
    values, indices = R.stable_top_k(scores, 8)
    for row, picked in zip(scores.tolist(), indices.tolist()):
        expected = sorted(range(64), key=lambda e: (-row[e], e))[:8]
        assert picked == expected
    assert torch.equal(values, torch.gather(scores, 1, indices))
    # the rule matters here: torch.topk orders some of these ties otherwise
    assert not torch.equal(torch.topk(scores, 8, dim=-1).indices, indices)


def _check(failures: list[str], label: str, got: torch.Tensor, want: torch.Tensor,
           tol: float | None) -> None:
    """Exact when ``tol`` is None, else within ``tol`` (relative and absolute)."""
    if got.dtype != want.dtype or got.shape != want.shape:
        failures.append(f"{label}: {got.dtype}{tuple(got.shape)} vs "
                        f"{want.dtype}{tuple(want.shape)}")
    elif tol is None:
        if not torch.equal(got, want):
            wrong = (got != want).reshape(got.shape[0], -1).any(1).sum().item()
            failures.append(f"{label}: {wrong} of {got.shape[0]} rows differ")
    else:
        try:
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
        except AssertionError as err:
            failures.append(f"{label}: {err}")


def router_checks(tokens: int, experts: int, top_k: int, sigmoid: bool,
                  renormalize: bool = False) -> list[str]:
    from megapipe.kernels import triton_router as TR

    failures: list[str] = []
    gen = torch.Generator().manual_seed(experts * 10 + top_k)
    logits = tied_logits(tokens, experts, gen)
    label = (f"router t={tokens} E={experts} k={top_k} sigmoid={sigmoid} "
             f"renormalize={renormalize} bf16")
    scores = logits.float().sigmoid()
    kth = scores.sort(dim=-1, descending=True).values[:, top_k - 1: top_k + 1]
    if (kth[:, 0] == kth[:, 1]).float().mean() < 0.5:  # the case must be full of ties
        failures.append(f"{label}: few ties at the k-th place")
    want = R.router(logits, top_k, sigmoid, renormalize)
    got = TR.router(logits, top_k, sigmoid, renormalize)
    _check(failures, f"{label} indices", got[1], want[1], None)
    _check(failures, f"{label} probs", got[0], want[0], 1e-2)
    _check(failures, f"{label} partials", got[2], want[2], 1e-4)
    counts = torch.bincount(want[1].reshape(-1), minlength=experts)
    grad = torch.randn(tokens, top_k, generator=gen).to(torch.bfloat16)
    args = (grad, logits, counts, None, top_k, sigmoid, 0.01, 0.001, renormalize)
    _check(failures, f"{label} backward", TR.router_backward(*args), R.router_backward(*args),
           1e-2)
    return failures


def rows_checks(tokens: int, experts: int, top_k: int, idle: int) -> list[str]:
    from megapipe.kernels import triton_router as TR

    failures: list[str] = []
    gen = torch.Generator().manual_seed(tokens + experts)
    indices = idle_routing(tokens, top_k, experts, idle, gen)
    n = indices.numel()
    assert n > TR.ROWS_BLOCK, "routing rows longer than one block"
    average = n // experts
    for capacity in (-1, average // 2, 2 * average):  # dropless, drops, padding
        label = f"routing_rows t={tokens} E={experts} k={top_k} capacity={capacity}"
        got = TR.routing_rows(indices, experts, capacity)
        want = R.routing_rows(indices, experts, capacity)
        if (want[2] == 0).sum() != idle:
            failures.append(f"{label}: {(want[2] == 0).sum()} idle experts, not {idle}")
        for name, a, b in zip(("row_choice", "choice_rows", "counts"), got, want):
            _check(failures, f"{label} {name}", a, b, None)
    return failures


def norm_checks(rows: int, hidden: int, forward: bool = True) -> list[str]:
    from megapipe.kernels import triton_norm as TN

    failures: list[str] = []
    gen = torch.Generator().manual_seed(rows + hidden)
    x, grad, residual = (torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
                         for _ in range(3))
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(torch.bfloat16)
    label = f"rms_norm rows={rows} h={hidden} bf16"
    y, rstd = R.rms_norm(x, weight, 1e-5)
    if forward:
        got_y, got_rstd = TN.rms_norm(x, weight, 1e-5)
        _check(failures, f"{label} y", got_y, y, 1e-2)
        _check(failures, f"{label} rstd", got_rstd, rstd, 1e-5)
    got = TN.rms_norm_backward(grad, x, weight, rstd, residual)
    want = R.rms_norm_backward(grad, x, weight, rstd, residual)
    _check(failures, f"{label} dx", got[0], want[0], 2e-2)
    # dweight sums `rows` products in another order: relative to the sum of their sizes
    scale = (grad.float() * x.float() * rstd[:, None]).abs().sum(0)
    if ((got[1].float() - want[1].float()).abs() > 1e-2 * scale + 1e-2).any():
        failures.append(f"{label} dweight: beyond 1% of the sum of |terms|")
    return failures


def permute_checks(tokens: int, hidden: int, experts: int, top_k: int) -> list[str]:
    from megapipe.kernels import reference, triton_permute as TP

    failures: list[str] = []
    gen = torch.Generator().manual_seed(hidden)
    indices = idle_routing(tokens, top_k, experts, 3, gen)
    row_choice, choice_rows, _ = R.routing_rows(indices, experts, -1)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    probs = torch.rand(tokens, top_k, generator=gen).to(torch.bfloat16)
    label = f"permute t={tokens} h={hidden} E={experts} k={top_k} bf16"
    rows = reference.permute(x, row_choice, top_k)
    _check(failures, f"{label} permute", TP.permute(x, row_choice, top_k), rows, None)
    _check(failures, f"{label} sum_choices", TP.sum_choices(rows, probs, choice_rows),
           reference.sum_choices(rows, probs, choice_rows), 1e-2)
    got = TP.unpermute_backward(x, rows, probs, row_choice, choice_rows)
    want = reference.unpermute_backward(x, rows, probs, row_choice, choice_rows)
    _check(failures, f"{label} grad rows", got[0], want[0], 1e-2)
    _check(failures, f"{label} grad probs", got[1], want[1], 5e-2)
    return failures


def shape_checks(every_shape: bool) -> list[str]:
    """Every check at one shape each (``every_shape``: at every shape); failure messages."""
    failures: list[str] = []
    if not every_shape:
        failures += router_checks(40, 64, 6, False, renormalize=True)
        failures += router_checks(40, 128, 8, True)
        failures += rows_checks(180, 8, 6, idle=2)
        failures += norm_checks(300, 128, forward=False)  # dweight programs of two tiles
        return failures
    for experts in (64, 128, 256):
        for top_k in (6, 8):
            for sigmoid, renormalize in ((False, False), (True, False), (False, True)):
                failures += router_checks(100, experts, top_k, sigmoid, renormalize)
    failures += rows_checks(300, 256, 8, idle=17)
    failures += rows_checks(1100, 8, 2, idle=1)
    for rows, hidden in ((2048, 1024), (512, 4096), (256, 7168)):
        failures += norm_checks(rows, hidden)
        failures += permute_checks(64, hidden, 64, 8)
    return failures


def _interpreted(every_shape: bool) -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    args = [sys.executable, __file__] + (["every-shape"] if every_shape else [])
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "interpreted: ok" in proc.stdout


def test_kernels_at_real_shapes_under_interpreter():
    _interpreted(every_shape=False)


@pytest.mark.heavy
def test_kernels_at_every_real_shape_under_interpreter():
    _interpreted(every_shape=True)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    problems = shape_checks(every_shape=sys.argv[1:] == ["every-shape"])
    if problems:
        print("\n".join(problems))
        sys.exit(1)
    print("interpreted: ok")
