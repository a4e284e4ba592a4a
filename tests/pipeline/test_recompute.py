"""Recompute composed with the overlap, bitwise the same losses and gradients as no recompute,
in the plain and the combined version of every combined schedule: selective (the attention core
and the experts' activation re-run inside their node's backward) and full, node by node (every
compute node of a recomputed layer keeps its inputs only and re-runs inside its own backward;
uniform: every layer of a chunk, in groups of 1 or 2 layers, block: the first layer of each
chunk)."""

from __future__ import annotations

import pytest

from support.rank_pool import results_by_case
from support.combined_cases import recompute_cases
from test_combined_step import BITWISE_CASES

SETTINGS = {
    "selective": {"recompute_modules": ("core_attn", "moe_act")},
    "full-uniform": {"recompute_method": "uniform", "recompute_num_layers": 1},
    "full-block": {"recompute_method": "block", "recompute_num_layers": 1},
    "full-uniform-2": {"recompute_method": "uniform", "recompute_num_layers": 2},
}


@pytest.fixture(scope="module")
def verdicts(rank_pools):
    per_rank = rank_pools(8).run(recompute_cases, BITWISE_CASES, SETTINGS)
    return results_by_case(per_rank, BITWISE_CASES)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("case", BITWISE_CASES, ids=str)
def test_recompute_is_bitwise_no_recompute(verdicts, case, setting):
    for rank, per_setting in enumerate(verdicts[case]):
        problems = per_setting[setting]
        assert problems == [], f"{case} {setting} rank {rank}: {problems[:4]}"
