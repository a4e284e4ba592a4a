"""The fused operators (``megapipe.kernels``): their plain-torch references against the unfused
definitions (forwards bitwise, hand-written backwards against autograd), and the Triton kernels
against the references under TRITON_INTERPRET=1 on CPU (float32 and float16 here; bf16 at the
shapes users run in test_kernel_shapes.py; tests/gpu runs the same comparison compiled, with
bf16). Triton reads TRITON_INTERPRET when a kernel module is first imported, so the interpreter
check runs this file as a script in a fresh process."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from megapipe.kernels import reference_fused as R, rms_norm, rms_norm_residual, swiglu
from megapipe.moe.permutation import sort_by_expert
from megapipe.moe.router import load_balancing_loss, z_loss


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_rms_norm_is_nn_rmsnorm_forward_bitwise_and_its_gradients(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    norm = torch.nn.RMSNorm(24, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.add_(0.3 * torch.randn(24, generator=gen).to(dtype))
    x = torch.randn(3, 5, 24, generator=gen).to(dtype).requires_grad_()
    grad, residual = (torch.randn(3, 5, 24, generator=gen).to(dtype) for _ in range(2))
    expected = norm(x)
    (dx, dw) = torch.autograd.grad(expected, (x, norm.weight), grad)
    weight = norm.weight.detach().requires_grad_()
    y = rms_norm(x, weight, 1e-5)
    assert torch.equal(y, expected)
    got_dx, got_dw = torch.autograd.grad(y, (x, weight), grad)
    _close(got_dx, dx, tol)
    _close(got_dw, dw, tol)
    # the residual branch's gradient is added by the norm's own backward
    normed, passed = rms_norm_residual(x, weight, 1e-5)
    assert torch.equal(normed, expected) and torch.equal(passed, x)
    res_dx, res_dw = torch.autograd.grad((normed, passed), (x, weight), (grad, residual))
    _close(res_dx, dx + residual, tol)
    _close(res_dw, dw, tol)


def test_swiglu_is_the_per_expert_activation_bitwise_with_autograd_gradients():
    gen = torch.Generator().manual_seed(1)
    gate, up, grad = (torch.randn(11, 7, generator=gen) for _ in range(3))
    counts = [4, 0, 7]
    gate.requires_grad_(), up.requires_grad_()
    expected = torch.cat([F.silu(g) * u for g, u in zip(gate.split(counts), up.split(counts))])
    out = swiglu(gate, up, counts)
    assert torch.equal(out, expected)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(out, (gate, up), grad),
                                                 torch.autograd.grad(expected, (gate, up), grad)))


def _definition(logits, top_k, sigmoid, coeffs, renormalize=False):
    """The router's losses as the unfused code wrote them: probs, lb, z (differentiable);
    ``renormalize``: softmax's top-k probabilities divided by their sum."""
    x = logits.float()
    if sigmoid:
        scores = torch.sigmoid(x)
        top, indices = torch.topk(scores, top_k, dim=-1)
        probs = top / top.sum(-1, keepdim=True)
        balance = scores / scores.sum(-1, keepdim=True)
    else:
        scores = torch.softmax(x, dim=-1)
        probs, indices = torch.topk(scores, top_k, dim=-1)
        if renormalize:
            probs = probs / probs.sum(-1, keepdim=True)
        balance = scores
    lb = load_balancing_loss(balance, indices, x.shape[1])
    return probs, indices, coeffs[0] * lb + coeffs[1] * z_loss(x)


@pytest.mark.parametrize("sigmoid,renormalize", [(False, False), (True, False), (False, True)],
                         ids=["softmax", "sigmoid", "softmax-renormalised"])
@pytest.mark.parametrize("with_labels", [False, True])
def test_router_reference_against_the_unfused_router(sigmoid, renormalize, with_labels):
    gen = torch.Generator().manual_seed(2)
    t, num_experts, top_k, coeffs = 70, 6, 2, (0.3, 0.05)
    logits = torch.randn(t, num_experts, generator=gen, dtype=torch.float32).requires_grad_()
    grad_probs = torch.randn(t, top_k, generator=gen)
    probs, indices, aux = _definition(logits, top_k, sigmoid, coeffs, renormalize)
    got_probs, got_indices, partials = R.router(logits.detach(), top_k, sigmoid, renormalize)
    assert torch.equal(got_probs, probs) and torch.equal(got_indices, indices)
    labels = torch.randperm(num_experts, generator=gen) if with_labels else None
    plan_of = got_indices if labels is None else labels[got_indices]
    counts = R.routing_rows(plan_of, num_experts, -1)[2]
    # the loss value from the statistics (summed in another order: within rounding)
    from megapipe.moe.aux_loss import AuxStatistics

    value = AuxStatistics(partials, counts, labels, t, top_k, *coeffs).value()
    _close(value, aux.detach(), 1e-6)
    # backward: d probs plus 0.5 x the losses' gradient
    (expected,) = torch.autograd.grad((probs * grad_probs).sum() + 0.5 * aux, logits)
    got = R.router_backward(grad_probs, logits.detach(), counts, labels, top_k, sigmoid,
                            0.5 * coeffs[0], 0.5 * coeffs[1], renormalize)
    _close(got, expected, 1e-6)


def test_routing_plan_reference_is_order_by_expert():
    gen = torch.Generator().manual_seed(3)
    indices = torch.stack([torch.randperm(5, generator=gen)[:2] for _ in range(23)])
    for capacity in (None, 4):
        row_choice, choice_rows, counts = R.routing_rows(indices, 5, -1 if capacity is None
                                                         else capacity)
        flat = indices.reshape(-1)
        assert counts.tolist() == [int((flat == e).sum()) for e in range(5)]
        expected = sort_by_expert(indices, 5, capacity)
        assert torch.equal(row_choice, expected[0]) and torch.equal(choice_rows, expected[1])
        rows = row_choice[row_choice >= 0]  # expert-major, token order within an expert
        assert torch.equal(flat[rows], flat[rows].sort(stable=True).values)


def compare_triton_with_reference(device: str) -> list[str]:
    """Every fused Triton kernel against its reference; failure messages."""
    from megapipe.kernels import triton_norm as TN, triton_router as TR

    failures: list[str] = []

    def check(label: str, a: torch.Tensor, b: torch.Tensor, tol: float, exact: bool = False):
        if a.dtype != b.dtype or a.shape != b.shape:
            failures.append(f"{label}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
        elif exact and not torch.equal(a, b):
            failures.append(f"{label}: not equal")
        elif not exact:
            try:
                _close(a, b, tol)
            except AssertionError as err:
                failures.append(f"{label}: {err}")

    gen = torch.Generator().manual_seed(4)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    dtypes = [(torch.float32, 1e-5), (torch.float16, 2e-3)]
    if device == "cuda":
        dtypes.append((torch.bfloat16, 2e-2))
    for dtype, tol in dtypes:
        # the second walks two column blocks (slow under the interpreter: float32 only)
        for rows, hidden in ((37, 70),) + (((2, 4100),) if dtype == torch.float32 else ()):
            x, grad, residual = (randn(rows, hidden, dtype=dtype) for _ in range(3))
            weight = (1 + 0.1 * randn(hidden)).to(dtype)
            y, rstd = R.rms_norm(x, weight, 1e-5)
            got_y, got_rstd = TN.rms_norm(x, weight, 1e-5)
            check(f"rms_norm {dtype} {hidden}", got_y, y, tol)
            check(f"rms_norm rstd {dtype} {hidden}", got_rstd, rstd, 1e-5)
            for res in (None, residual):
                for name, a, b in zip(("dx", "dweight"),
                                      TN.rms_norm_backward(grad, x, weight, rstd, res),
                                      R.rms_norm_backward(grad, x, weight, rstd, res)):
                    check(f"rms_norm {name} {dtype} {hidden} residual={res is not None}", a, b,
                          10 * tol)
        gate, up, dy = (randn(20, 9, dtype=dtype) for _ in range(3))
        check(f"swiglu {dtype}", TN.swiglu(gate, up, [20]), R.swiglu(gate, up, [20]), tol)
        for name, a, b in zip(("d gate", "d up"), TN.swiglu_backward(dy, gate, up, [20]),
                              R.swiglu_backward(dy, gate, up, [20])):
            check(f"swiglu {name} {dtype}", a, b, tol)
    for sigmoid, renormalize in ((False, False), (True, False), (False, True)):
        # the second takes two tiles of 16 tokens per block of 32 (experts padded to 256)
        for t, num_experts, top_k in ((45, 8, 2), (40, 200, 8), (40, 6, 1)):
            logits = randn(t, num_experts)
            label = f"router sigmoid={sigmoid} renormalize={renormalize} {(t, num_experts, top_k)}"
            probs, indices, partials = R.router(logits, top_k, sigmoid, renormalize)
            got = TR.router(logits, top_k, sigmoid, renormalize)
            check(f"{label} indices", got[1], indices, 0, exact=True)
            check(f"{label} probs", got[0], probs, 1e-6)
            check(f"{label} partials", got[2], partials, 1e-5)
            counts = torch.randint(0, 20, (num_experts,), generator=gen).to(device)
            labels = torch.randperm(num_experts, generator=gen).to(device)
            grad_probs = randn(t, top_k)
            cases = ((grad_probs, None, 0.0), (grad_probs, labels, 0.3), (None, None, 0.2))
            for g, lab, z in cases:
                args = (g, logits, counts, lab, top_k, sigmoid, 0.7, z, renormalize)
                check(f"{label} backward grad={g is not None} labels={lab is not None} z={z}",
                      TR.router_backward(*args), R.router_backward(*args), 1e-5)
    for capacity in (-1, 3, 50):
        indices = torch.stack([torch.randperm(7, generator=gen)[:2] for _ in range(40)]).to(device)
        for name, a, b in zip(("row_choice", "choice_rows", "counts"),
                              TR.routing_rows(indices, 7, capacity),
                              R.routing_rows(indices, 7, capacity)):
            check(f"routing_rows capacity={capacity} {name}", a, b, 0, exact=True)
    return failures


def test_triton_kernels_match_reference_under_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600
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


def test_the_triton_functions_take_every_argument_of_their_operators():
    """The CUDA registration calls the Triton function with every argument of the operator's
    schema (defaults filled in), so each takes them all, by the same names."""
    pytest.importorskip("triton")
    import megapipe.kernels as K
    from megapipe.kernels import triton_norm as TN, triton_permute as TP, triton_router as TR

    ops = [(K.router_op, TR.router), (K.router_backward_op, TR.router_backward),
           (K.routing_rows_op, TR.routing_rows), (K.rms_norm_op, TN.rms_norm),
           (K.rms_norm_backward_op, TN.rms_norm_backward), (K.swiglu_op, TN.swiglu),
           (K.swiglu_backward_op, TN.swiglu_backward), (K.permute_op, TP.permute),
           (K.sum_choices_op, TP.sum_choices), (K.unpermute_backward_op, TP.unpermute_backward)]
    for op, function in ops:
        schema = [argument.name for argument in op._schema.arguments]
        assert list(inspect.signature(function).parameters) == schema, op
