"""The GPU check's executor step times with CUDA graphs, run on CPU with the graph stand-in: the
parts a dry run cannot reach (graphs captured, their instances and memory)."""

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from gpu_sections import executor_steps  # noqa: E402
from gpu_sections.child import Context  # noqa: E402
from gpu_sections.result import SectionResult  # noqa: E402
from gpu_sections.sec_executor import DRY  # noqa: E402
from support.fake_graphs import FakeGraphApi  # noqa: E402


def test_the_step_times_report_graphs_on_with_their_instances_and_memory(monkeypatch, tmp_path):
    monkeypatch.setitem(executor_steps.GRAPHS, "graph_api", FakeGraphApi())
    ctx = Context("executor", True, tmp_path, tmp_path, float("inf"), torch.device("cpu"))
    result = SectionResult("executor", None)
    measured = executor_steps.step_times(ctx, result, *DRY, prefix="h32_")
    (table,) = result.data["tables"]
    assert [tuple(r[:2]) for r in table["rows"]] == [
        ("no link", "off"), ("no link", "on"), ("sleep link, comm ~ experts", "off"),
        ("sleep link, comm ~ experts", "on")]
    figures = result.data["figures"]
    # the combined executor: two microbatches in flight, each with its dense and MoE attention
    # node captured
    assert figures["h32_graph_instances"]["value"] == 4 and figures["h32_graph_mib"]["value"] > 0
    for key in ("h32_combined_vs_plain_graphs", "h32_link_combined_vs_plain_graphs",
                "h32_host_combined_vs_plain_graphs"):
        assert figures[key]["value"] > 0
    assert set(measured) == {(link, graphs) for link in ("no link", "sleep link, comm ~ experts")
                             for graphs in (False, True)}


def test_a_captured_node_leaves_only_its_copies_and_accumulations_outside_its_graphs():
    from graph_launches import count

    small, wide = count(hidden=32), count(hidden=128)
    for name, (eager, graphed) in small.items():
        # two replays, the input and output-gradient copies, the auxiliary-loss copy and one
        # main_grad accumulation per parameter stay outside, whatever the node computes
        assert graphed <= 16 and graphed < eager and wide[name][1] == graphed, (name, small)
