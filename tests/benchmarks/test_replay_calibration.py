"""The host-cost calibration's solver (``benchmarks/replay_calibration.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from replay_calibration import solve_host_cost  # noqa: E402


def test_the_host_cost_makes_the_simulated_step_the_measured_one():
    def simulated(h):  # 300 nodes on the critical path, then (beyond 1 ms) a longer path
        return 1000.0 + 300 * h + max(0.0, h - 1.0) * 100

    assert solve_host_cost(simulated, 1150.0) == pytest.approx(0.5, abs=1e-3)
    assert solve_host_cost(simulated, 1000.0 + 300 * 3 + 200) == pytest.approx(3.0, abs=1e-3)
    assert solve_host_cost(simulated, 900.0) == 0.0  # the run beat the model: no host cost
