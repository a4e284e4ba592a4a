"""The executor's combined step (issue 5): bitwise, order, real concurrency, the warning.

Multi-process parts run in the session's 8-rank gloo pool, many configurations per task
(``combined_cases``); the comparisons happen on the ranks, which return verdicts.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from support.combined_cases import (
    bitwise_cases,
    concurrency_run,
    front_end_run,
    graph_cases,
    non_node_stage,
    traced_run,
)
from support.pipeline_cases import Case
from support.rank_pool import results_by_case

# every combined schedule; ep in {1, 2, 4}, pp in {1, 2, 4}, vpp in {1, 2}; CONFIG's first
# layer is dense (dense-first); world = pp * dp <= 8 with ep | dp. At least one case per family
# runs the modern model (rope, GQA, QK norm, kv_channels; embeddings tied across the first and
# last stage), the others the reference model. Untied: DualPipe (it refuses tied weights) and a
# model of one stage, where the tied weight's two uses (embedding, head) are in one stage: the
# plain backward (one autograd call) sums them before adding to the gradient, the combined one
# (node by node) adds them one at a time, so the last bits differ (docs/architecture.md).
BITWISE_CASES = [
    Case("1f1b", 1, ep=4, dp=4, model="modern_untied"),  # no pipelining
    Case("1f1b", 2, ep=2, dp=2, model="modern"),
    Case("1f1b", 2, ep=4, dp=4),
    Case("1f1b", 4),
    Case("interleaved-1f1b", 2, vpp=2, ep=2, dp=2, model="modern"),
    Case("interleaved-1f1b", 4, vpp=2, ep=2, dp=2, microbatches=8),
    Case("zb1p", 2, ep=2, dp=2, model="modern"),
    Case("zbv", 2, vpp=2, ep=2, dp=2, model="modern"),
    Case("dualpipev", 2, vpp=2, ep=2, dp=2, model="modern"),
    Case("dualpipe", 2, vpp=2, ep=2, dp=2, model="modern_untied"),
]
# bf16 runs the same layouts with the reference model: each family meets both models
BF16_CASES = [dataclasses.replace(case, model="reference") for case in BITWISE_CASES]

GRAPH_CASES = [Case("1f1b", 2, ep=2, dp=2), Case("zbv", 2, vpp=2, ep=2, dp=2),
               Case("1f1b", 2, ep=2, dp=2, model="rank_capacity")]  # MoE layers graphed whole


@pytest.fixture(scope="module")
def graph_verdicts(rank_pools):
    per_rank = rank_pools(8).run(graph_cases, GRAPH_CASES)
    return results_by_case(per_rank, GRAPH_CASES)


@pytest.mark.parametrize("case", GRAPH_CASES, ids=str)
def test_cuda_graphs_keep_plain_and_combined_bitwise(graph_verdicts, case):
    """bf16, the static nodes captured (the CPU stand-in of ``torch.cuda`` graphs): every
    schedule's losses and fp32 main gradients are those of the plain schedule without graphs."""
    for rank, problems in enumerate(graph_verdicts[case]):
        assert problems == [], f"graphs {case} rank {rank}: {problems[:4]}"


# the four pairings inside a steady-state MoE layer: (comm stream node, compute stream node)
FOUR_PAIRS = {
    (("B", "combine"), ("F", "attention")),
    (("F", "dispatch"), ("B", "experts")),
    (("B", "dispatch"), ("F", "experts")),
    (("F", "combine"), ("B", "attention")),
}


@pytest.fixture(scope="module")
def verdicts(rank_pools):
    per_rank = rank_pools(8).run(bitwise_cases, BITWISE_CASES)
    return results_by_case(per_rank, BITWISE_CASES)


@pytest.mark.parametrize("case", BITWISE_CASES, ids=str)
def test_combined_schedule_is_bitwise_the_plain_one(verdicts, case):
    for rank, problems in enumerate(verdicts[case]):
        assert problems == [], f"{case} rank {rank}: {problems[:4]}"


@pytest.fixture(scope="module")
def bf16_verdicts(rank_pools):
    per_rank = rank_pools(8).run(bitwise_cases, BF16_CASES, bf16=True)
    return results_by_case(per_rank, BF16_CASES)


@pytest.mark.parametrize("case", BF16_CASES, ids=str)
def test_bf16_combined_schedule_is_bitwise_the_plain_one(bf16_verdicts, case):
    """The same matrix with bf16 parameters and activations and float32 main gradients."""
    for rank, problems in enumerate(bf16_verdicts[case]):
        assert problems == [], f"bf16 {case} rank {rank}: {problems[:4]}"


def _four_pairs_per_layer(pairs) -> int:
    """How many times the full set of four pairings appears in order (attention-combine first)."""
    found, want = 0, [
        (("B", "combine"), ("F", "attention")),
        (("F", "dispatch"), ("B", "experts")),
        (("B", "dispatch"), ("F", "experts")),
        (("F", "combine"), ("B", "attention")),
    ]
    for start in range(len(pairs) - 3):
        if list(pairs[start:start + 4]) == want:
            found += 1
    return found


def test_trace_shows_the_four_pairs_in_every_steady_state_moe_layer(rank_pools):
    # 1F1B, pp = 2, ep = 2: each rank holds stages with MoE layers only after the dense one
    case = Case("1f1b", 2, ep=2, dp=2, microbatches=6)
    results = [r for r in rank_pools(8).run(traced_run, case) if r is not None]
    for rank, result in enumerate(results):
        pairs = result["pairs"]
        assert set(pairs) == FOUR_PAIRS, (rank, set(pairs) - FOUR_PAIRS)
        # every pair belongs to a complete layer: the pairs come in runs of four, in order
        assert len(pairs) % 4 == 0 and _four_pairs_per_layer(pairs) == len(pairs) // 4, pairs
        assert result["wgrad_beside_dispatch"], "deferred wgrad never ran beside B dispatch"
        assert 0.0 <= result["fraction"] <= 1.0 and result["a2a"] > 0


def test_combined_step_really_runs_comm_and_compute_at_once(rank_pools):
    # no pipelining, ep = 2, an emulated link of a few ms per all-to-all (a sleep, which needs
    # no CPU): inside the executor's combined steps part of the comm time runs while a compute
    # node runs (the trace's spans; a test of concurrency, not a benchmark of its speed).
    case = Case("1f1b", 1, ep=2, dp=2, microbatches=4)
    results = [r for r in rank_pools(8).run(concurrency_run, case, 0.003) if r is not None]
    for result in results:
        # the paired slots' nodes overlap in time: a slot lasts less than its two nodes summed
        # (by at least a third of one emulated all-to-all in all; with no concurrency the wall
        # would be at least the sum). Not the exposed fraction: that is a speed, and on a
        # loaded machine the comm thread's wake-ups stretch it.
        assert result["paired_sum"] > 0, result
        assert result["paired_wall"] < result["paired_sum"] - 0.001, result


def test_front_end_flags_pick_the_combined_schedule_with_the_same_bits(rank_pools):
    case = Case("interleaved-1f1b", 2, vpp=2, ep=2, dp=2)
    results = [r for r in rank_pools(8).run(front_end_run, case) if r is not None]
    for result in results:
        assert result["plain_overlaps"] == 0 and result["overlaps"] > 0
        assert result["differences"] == []
        assert set(result["pairs"]) == FOUR_PAIRS
        assert result["runner_restored"]


def test_stage_without_node_protocol_runs_f_then_b_with_one_warning():
    messages, losses, grad = non_node_stage(overlap=True)
    named = [m for m in messages if "_PlainBlock" in m]
    assert len(named) == 1 and "node protocol" in named[0], messages
    plain_messages, plain_losses, plain_grad = non_node_stage(overlap=False)
    assert not [m for m in plain_messages if "_PlainBlock" in m]
    assert losses == plain_losses
    assert torch.equal(grad, plain_grad)


def test_delay_wgrad_compute_needs_a_combined_schedule():
    from megapipe.pipeline.executor import PipelineExecutor
    from megapipe.pipeline.executor_options import ExecutorOptions
    from megapipe.schedule import build_schedule

    with pytest.raises(ValueError, match="delay_wgrad_compute"):
        PipelineExecutor(
            build_schedule("1f1b", 1, 2), {0: torch.nn.Linear(2, 2)},
            ExecutorOptions(loss_fn=lambda o, t: o.sum(), delay_wgrad_compute=True),
        )
