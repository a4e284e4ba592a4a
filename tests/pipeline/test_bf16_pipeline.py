"""bf16 pipelines against the single-process bf16 model (gloo, CPU, the 8-rank pool).

Both sides train two SGD steps the way ``--bf16`` does: bf16 parameters and activations (the
p2p buffers are bf16), float32 ``main_grad`` accumulated over the microbatches and reduced over
DP / expert-DP in float32, float32 main weights. The stated bf16 tolerance:

- where the summation order is the reference's (one DP rank, no EP, no mirrored halves;
  ``bitwise_expected``), losses and gradients are bitwise equal, as in float32;
- otherwise losses agree to 2e-3 relative and each gradient to 2e-2 of its largest entry.
  The float32 DP reduction only reorders float32 sums (~1e-7), but with EP an expert's weight
  gradient is one bf16 GEMM over the rows of all its EP ranks instead of one per rank, which
  rounds differently by a few bf16 units (2^-8 = 3.9e-3): measured 6.2e-3 at most.
"""

from __future__ import annotations

import pytest
import torch

from support.pipeline_cases import Case, bitwise_expected, expected_grad, run_cases
from support.rank_pool import results_by_case

STEPS = 2
LOSS_RTOL = 2e-3
GRAD_TOL = 2e-2  # of the gradient's largest entry
CASES = [
    Case("1f1b", 2, bf16=True),
    Case("1f1b", 4, ep=2, dp=2, microbatches=8, bf16=True),
    Case("interleaved-1f1b", 2, vpp=2, ep=2, dp=2, bf16=True),
    Case("interleaved-1f1b", 2, vpp=2, ep=2, dp=2, overlap=True, bf16=True),
    Case("zb1p", 2, vpp=2, dp=2, bf16=True),
    Case("zbv", 2, vpp=2, ep=2, dp=2, overlap=True, bf16=True),
    Case("dualpipev", 2, vpp=2, overlap=True, bf16=True),
    Case("dualpipe", 2, vpp=2, dp=2, bf16=True),
]


@pytest.fixture(scope="module")
def results(rank_pools):
    per_rank = rank_pools(8).run(run_cases, CASES, STEPS)
    return results_by_case(per_rank, CASES)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_bf16_pipeline_matches_the_bf16_single_process_model(results, case):
    ranks = results[case]
    reference = ranks[0]["reference"]
    bitwise = bitwise_expected(case)
    for result in ranks:
        for step, (losses, grads) in enumerate(result["steps"]):
            ref_losses, ref_grads = reference[step]
            for i, loss in losses.items():
                want = ref_losses[result["dp_rank"] * case.microbatches + i]
                if bitwise:
                    assert loss == want, f"{case} step {step} microbatch {i}: {loss} != {want}"
                else:
                    assert abs(loss - want) <= LOSS_RTOL * abs(want), (case, step, i, loss, want)
            for (stage, name), grad in grads.items():
                want = expected_grad(case, result, name, (stage, name), ref_grads)
                assert grad.dtype == torch.float32, f"{name}: main_grad is {grad.dtype}"
                what = f"{case} step {step} stage {stage} {name}"
                if bitwise:
                    assert torch.equal(grad, want), f"{what}: {(grad - want).abs().max():.3e}"
                else:
                    worst = (grad - want).abs().max().item()
                    assert worst <= GRAD_TOL * want.abs().max().item(), f"{what}: {worst:.3e}"
