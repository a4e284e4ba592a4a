"""``benchmarks/host_cost.py``: the layer pair it times runs the real engine, and its combined
run leaves the same gradients as its plain run (so its per-node figures compare like with like)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from host_cost import _Pair, _uniform, main  # noqa: E402
from megapipe.overlap import make_streams  # noqa: E402
from overlap_replay import ReplaySettings  # noqa: E402


def _grads(pair: _Pair, label: str) -> dict:
    torch.manual_seed(0)
    pair.generator.manual_seed(0)
    getattr(pair, label)(*pair.prepare())
    grads = {n: p.grad.clone() for n, p in pair.stage.named_parameters() if p.grad is not None}
    pair.stage.zero_grad(set_to_none=True)
    return grads


def test_the_combined_pair_equals_the_plain_pair_bitwise():
    with make_streams("cpu") as streams:
        pair = _Pair(ReplaySettings("", (), moe_layers=2), 2, streams, _uniform(0.0))
        assert pair.nodes == 2 * 2 * 8  # F and B of 2 MoE layers in 2 waves, 8 nodes each
        plain, combined = _grads(pair, "plain"), _grads(pair, "combined")
    assert plain.keys() == combined.keys() and plain
    for name, grad in plain.items():
        assert torch.equal(grad, combined[name]), name


def test_it_prints_the_figures_per_node(capsys):
    assert main(["--moe-layers", "1", "--rounds", "1", "--node-ms", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "10 F+B nodes" in out and "combined / plain CPU" in out
    assert out.count("host cost") == 2


def test_the_megatron_comparison_runs_both_engines_and_ends_with_the_ratio(capsys):
    pytest.importorskip("megatron.core")
    assert main(["--megatron", "--rounds", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = {line.split()[0]: line for line in lines[1:-1]}
    assert set(rows) == {"megatron", "megapipe", "megapipe-gpt"}
    assert all("ms per layer pair" in row for row in rows.values())
    assert lines[-1].startswith("host ratio megapipe/megatron: ")
    assert float(lines[-1].split(": ")[1].split()[0]) > 0


def test_the_engine_alone_prints_its_host_time_per_node(capsys):
    assert main(["--engine", "--rounds", "3"]) == 0
    out = capsys.readouterr().out
    assert "40 F+B nodes" in out and out.count("us/node") == 3
    assert out.strip().splitlines()[-1].startswith("engine's own host time per node: plain ")
