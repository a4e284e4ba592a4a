"""All-to-alls in waves in the executor: bitwise the plain schedule; lone actions pipeline waves."""

import pytest

from support.combined_cases import wave_cases
from support.pipeline_cases import Case
from support.rank_pool import results_by_case

FOUR_PAIRS = {frozenset(p) for p in [
    {("B", "combine"), ("F", "attention")}, {("F", "dispatch"), ("B", "experts")},
    {("B", "dispatch"), ("F", "experts")}, {("F", "combine"), ("B", "attention")},
]}

# ep = 2 (two of CONFIG's four experts per rank: waves of one expert each)
CASES = [
    Case("1f1b", 1, ep=2, dp=2),
    Case("interleaved-1f1b", 2, vpp=2, ep=2, dp=2),
    Case("zbv", 2, vpp=2, ep=2, dp=2),  # F;I pairs: the I keeps its waved weight gradients
]


@pytest.fixture(scope="module")
def verdicts(rank_pools):
    per_rank = rank_pools(8).run(wave_cases, CASES)
    return results_by_case(per_rank, CASES)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_chunked_combined_schedule_is_bitwise_the_plain_one(verdicts, case):
    for rank, result in enumerate(verdicts[case]):
        assert result["problems"] == [], f"{case} rank {rank}: {result['problems'][:4]}"


@pytest.mark.parametrize("case", CASES, ids=str)
def test_lone_steps_overlap_their_own_chunks_and_pairs_keep_the_four_pairs(verdicts, case):
    for result in verdicts[case]:
        # a lone action: one wave's dispatch or combine beside the other wave's experts
        kinds = {tuple(n.rstrip("01") for n in nodes) for nodes in result["same_microbatch"]}
        assert ("dispatch", "experts") in kinds and ("combine", "experts") in kinds, kinds
        # a pair: the four pairings between the two microbatches, each wave group together
        assert result["pairings"] == FOUR_PAIRS, result["pairings"]
