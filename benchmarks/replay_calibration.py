"""The replay's host cost per node, measured by a calibration replay (``overlap.py --replay``).

A replayed node sleeps until its profile time has passed since it started, so its own real
work is hidden inside that time; what is not hidden is the engine's work *around* each node
(the tape's boundaries, autograd's start and end, thread hand-offs, the deferred-W bookkeeping),
and nodes the profile gives no time (a MoE layer's ``finish``). On 4 processes sharing 2 cores
this comes to a fraction of a millisecond per node, which the simulator does not see.

The calibration measures it on this machine, now, separately from the measured run: the same
schedule and engine replay a *uniform* profile (every node ``CALIBRATION_MS``, times the time
scale: long enough to hide each node's own work), one plain and one combined step, and the host
cost is the per-node time ``h`` (``NodeCosts.host_cost``, added to every F and B node) for which
the simulator's step equals the measured one, solved separately for plain and combined runs
(their engines differ: autograd over the stage vs the tape on two streams). The simulator then
predicts the real profile's steps with that ``h``. Nothing of the measured run goes into ``h``;
the figures with ``h = 0`` are printed beside.
"""

from __future__ import annotations

from collections.abc import Callable

import overlap_replay as replay

CALIBRATION_MS = 3.0  # every node's time in the calibration profile, before --time-scale


def uniform_profile(s: replay.ReplaySettings):
    """Every F, B and W time ``CALIBRATION_MS`` (times the time scale)."""
    from megapipe.sim.profile import COMM_KEYS, COMPUTE_KEYS, NodeProfile

    ms = CALIBRATION_MS * s.time_scale
    return NodeProfile.from_dict({"compute": dict.fromkeys(COMPUTE_KEYS, ms),
                                  "comm": dict.fromkeys(COMM_KEYS, ms)})


def solve_host_cost(simulated: Callable[[float], float], measured: float,
                    tolerance: float = 1e-3) -> float:
    """The ``h >= 0`` (ms) with ``simulated(h) == measured`` (bisection: ``simulated`` does not
    fall as ``h`` grows); 0 when the model without host cost is not faster than the run."""
    if simulated(0.0) >= measured:
        return 0.0
    low, high = 0.0, 1.0
    while simulated(high) < measured:
        low, high = high, 2 * high
    while high - low > tolerance:
        middle = (low + high) / 2
        low, high = (middle, high) if simulated(middle) < measured else (low, middle)
    return (low + high) / 2


def calibrate(s: replay.ReplaySettings, groups, name: str, chunks: int) -> dict:
    """Replay ``name`` on the uniform profile (one round, every rank); return this rank's
    ``{"plain": h, "combined": h, "measured": the calibration steps}``, h in ms per node."""
    profile = uniform_profile(s)
    runs = replay._ReplayRuns(s, groups, name, chunks)
    try:
        runs.set_profile(profile)
        measured = replay._measure(runs, 1)
    finally:
        runs.close()
    costs = {"measured": measured}
    for label, overlap, k in (("plain", False, 1), ("combined", True, chunks)):
        early = measured["early"] if overlap else None

        def simulated(h: float) -> float:
            return replay.predict(s, name, overlap, k, early, h, profile)[0]

        costs[label] = solve_host_cost(simulated, measured[label])
    return costs


def calibration_line(costs: dict, name: str) -> str:
    m = costs["measured"]
    return (f"calibration ({name}, every node {CALIBRATION_MS:g} ms x time scale): plain "
            f"{m['plain']:.1f} ms, combined {m['combined']:.1f} ms measured -> host cost per "
            f"node: plain {costs['plain']:.3f} ms, combined {costs['combined']:.3f} ms")
