"""Recompute composed with the overlap, bitwise the same losses and gradients as no recompute,
in the plain and the combined version of every combined schedule: selective (the attention core
and the experts' activation re-run inside their node's backward) and full, node by node (every
compute node of a recomputed layer keeps its inputs only and re-runs inside its own backward;
uniform: every layer of a chunk, in groups of 1 layer everywhere and of 2 layers where chunks
hold several layers; block: the first layer of each chunk, there too)."""

from __future__ import annotations

import pytest
from test_combined_step import BITWISE_CASES

from support.combined_cases import recompute_cases
from support.rank_pool import results_by_case

SETTINGS = {
    "selective": {"recompute_modules": ("core_attn", "moe_act")},
    "full-uniform": {"recompute_method": "uniform", "recompute_num_layers": 1},
    "full-block": {"recompute_method": "block", "recompute_num_layers": 1},
    "full-uniform-2": {"recompute_method": "uniform", "recompute_num_layers": 2},
}
# selective and full uniform in every combined schedule; block and groups of two layers (which
# only change which nodes re-run, not how the schedule pairs them) where chunks have several
# layers and the pairs cross chunks: interleaved 1F1B and DualPipeV
EVERYWHERE = ("selective", "full-uniform")
CHUNKED = {c for c in BITWISE_CASES if c.schedule in ("interleaved-1f1b", "dualpipev")
           and c.pp == 2}
CASE_SETTINGS = [(case, setting) for case in BITWISE_CASES for setting in SETTINGS
        if setting in EVERYWHERE or case in CHUNKED]


@pytest.fixture(scope="module")
def verdicts(rank_pools):
    """Per case, run on demand (one pool call per case: each well inside the pool's timeout)."""
    found: dict = {}

    def of(case):
        if case not in found:
            settings = {name: SETTINGS[name] for c, name in CASE_SETTINGS if c == case}
            # plain recompute differs from combined only in who calls the nodes: full recompute
            # is checked plain where chunks hold several layers, combined everywhere
            combined_only = () if case in CHUNKED else ("full-uniform",)
            per_rank = rank_pools(8).run(recompute_cases, [case], settings, combined_only)
            found[case] = results_by_case(per_rank, [case])[case]
        return found[case]

    return of


@pytest.mark.parametrize("case,setting", CASE_SETTINGS,
                         ids=lambda v: v if isinstance(v, str) else str(v))
def test_recompute_is_bitwise_no_recompute(verdicts, case, setting):
    for rank, per_setting in enumerate(verdicts(case)):
        problems = per_setting[setting]
        assert problems == [], f"{case} {setting} rank {rank}: {problems[:4]}"
