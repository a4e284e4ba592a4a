"""A tiny replay (``benchmarks/overlap.py --replay``): the real engine, every node sleeping out
its profile time, run plain and combined on 4 gloo processes beside the simulator's prediction
for the same profile and issue order. The test checks that the replay runs and reports what the
benchmark prints (times, the exposed share, the early-send rule) and what the simulator
predicts; how the measured times compare with the prediction is the benchmark's to print
(docs/performance.md), never a test's to assert."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from overlap_replay import ReplaySettings, predict  # noqa: E402
from support.replay_case import replay_run  # noqa: E402

PROFILE = BENCHMARKS / "profiles" / "deepseek_v3_h800.json"


def test_a_tiny_replay_runs_beside_the_simulators_prediction(rank_pools):
    settings = ReplaySettings(str(PROFILE), ("interleaved-1f1b",), microbatches=4, moe_layers=1,
                              rounds=1, a2a_waves=2)
    measured = rank_pools(4).run(replay_run, asdict(settings), "interleaved-1f1b", 2)[0]
    plain_sim, _ = predict(settings, "interleaved-1f1b", False, 1)
    combined_sim, _ = predict(settings, "interleaved-1f1b", True, 2, measured["early"])
    assert combined_sim < 0.8 * plain_sim  # the profile leaves something to hide
    assert measured["plain"] > 0 and measured["combined"] > 0, measured
    assert 0.0 <= measured["exposed"] <= 1.0, measured
