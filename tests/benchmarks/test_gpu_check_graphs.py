"""The GPU check's ``graphs`` section on CPU with the graph stand-in: the graph rows a dry run
leaves out (no CUDA) run here, on the live executor, whole-layer graphs beside partial ones."""

import sys
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from gpu_sections.child import Context  # noqa: E402
from gpu_sections.result import SectionResult  # noqa: E402
from gpu_sections.sec_executor import DRY  # noqa: E402
from gpu_sections.sec_graphs import MODES, RANK_CAPACITY, WAYS, graph_times  # noqa: E402
from support.fake_graphs import FakeGraphApi  # noqa: E402


def test_whole_layer_graphs_are_timed_beside_partial_graphs_and_eager(tmp_path):
    config, micro_batch = DRY
    config = replace(config, moe_expert_rank_capacity_factor=RANK_CAPACITY)
    ctx = Context("graphs", True, tmp_path, tmp_path, float("inf"), torch.device("cpu"))
    result = SectionResult("graphs", None)
    times = graph_times(ctx, result, config, micro_batch, graph_api=FakeGraphApi())
    assert set(times) == {(mode, way) for mode in MODES for way in WAYS}
    (table,) = result.data["tables"]
    rows = {row[0]: row for row in table["rows"]}
    assert list(rows) == ["eager", "partial", "whole"]
    # instances of the combined executor (two microbatches in flight): the dense layer and
    # the MoE layer's attention node, then its experts and finish too
    assert rows["eager"][6] is None and rows["partial"][6] == 2 * 2
    assert rows["whole"][6] == 2 * (2 + 2) and rows["whole"][7] > rows["partial"][7] > 0
    figures = result.data["figures"]
    for way in WAYS:
        for other in ("partial", "eager"):
            assert figures[f"h32_{way}_whole_vs_{other}"]["value"] > 0
    assert figures["h32_overflowed_steps"]["value"] == 0
