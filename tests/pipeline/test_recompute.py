"""Selective recompute composed with the overlap: the attention core and the experts'
activation re-run inside their node's backward, with bitwise the same losses and gradients as
no recompute, in the plain and the combined version of every combined schedule."""

from __future__ import annotations

import pytest

from support.rank_pool import results_by_case
from support.combined_cases import recompute_cases
from test_combined_step import BITWISE_CASES

MODULES = ("core_attn", "moe_act")


@pytest.fixture(scope="module")
def verdicts(rank_pools):
    per_rank = rank_pools(8).run(recompute_cases, BITWISE_CASES, MODULES)
    return results_by_case(per_rank, BITWISE_CASES)


@pytest.mark.parametrize("case", BITWISE_CASES, ids=str)
def test_recompute_is_bitwise_no_recompute(verdicts, case):
    for rank, problems in enumerate(verdicts[case]):
        assert problems == [], f"{case} rank {rank}: {problems[:4]}"
