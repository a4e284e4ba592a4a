"""The PNG timeline and the Chrome trace of a simulated run."""

import json

from megapipe.schedule.registry import build_schedule
from megapipe.sim.costs import Costs
from megapipe.sim.draw import draw_timeline
from megapipe.sim.simulate import simulate
from megapipe.sim.trace import write_trace

COSTS = Costs(1, 2, 1, dispatch=0.25, combine=0.25, moe_layers=2)


def test_trace_has_a_process_per_rank_and_every_action(tmp_path):
    schedule = build_schedule("interleaved-1f1b", 2, 4, vpp=2, overlap=True)
    result = simulate(schedule, COSTS)
    path = tmp_path / "trace.json"
    write_trace(result, str(path))
    document = json.loads(path.read_text())
    events = document["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}
    threads = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert threads == {"compute", "comm"}
    slices = [e for e in events if e["ph"] == "X"]
    actions = {(e["pid"], e["name"]) for e in slices if e["tid"] == 0}
    for rank, row in enumerate(schedule.actions):
        for action in row:
            assert (rank, str(action)) in actions
    comm = [e for e in slices if e["tid"] == 1]
    assert comm and all(e["name"].endswith(("dispatch", "combine")) for e in comm)
    assert sum(e["dur"] for e in comm) == sum(result.comm) * 1000
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)
    # Nested pieces stay inside their action on the compute track (Perfetto needs that).
    parents = [e for e in slices if e["tid"] == 0 and e["name"] == e["name"].split(" ")[0]]
    for child in (e for e in slices if e["tid"] == 0 and " " in e["name"]):
        assert any(p["pid"] == child["pid"] and p["ts"] <= child["ts"]
                   and child["ts"] + child["dur"] <= p["ts"] + p["dur"] + 1e-6 for p in parents)


def test_png_is_written(tmp_path):
    """One picture with every element: OVERLAP halves, two chunks per rank, all-to-all strip."""
    schedule = build_schedule("interleaved-1f1b", 4, 8, vpp=2, overlap=True)
    path = tmp_path / "timeline.png"
    draw_timeline(simulate(schedule, COSTS), str(path), stage_to_rank=schedule.stage_to_rank)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
