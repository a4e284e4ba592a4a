"""Actions timed node by node from a profile, in the engine's issue order (``sim/programs``)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from megapipe.schedule import build_schedule
from megapipe.schedule.ir import Action, Kind
from megapipe.schedule.p2p.early_sends import EACH, WHOLE
from megapipe.sim import Costs, simulate
from megapipe.sim.costs import AT_END, NodeCosts
from megapipe.sim.pick import choose_a2a_waves
from megapipe.sim.profile import NodeProfile, role_of
from megapipe.sim.programs import half_ends, node_ops, op_times

PROFILE_FILE = Path(__file__).resolve().parents[2] / "benchmarks/profiles/deepseek_v3_h800.json"
DEEPSEEK = NodeProfile.load(PROFILE_FILE)
PAIR = Action.overlap(Action(1, Kind.F, 1), Action(1, Kind.B, 0))


def span(ops) -> float:
    return max(end for _, end in op_times(ops, 0.0))


def test_the_profile_of_the_issue_and_its_errors():
    assert DEEPSEEK.time("attn", "B") == 9.5 and DEEPSEEK.time("combine", "F") == 8.7
    assert DEEPSEEK.time("mlp", "F", waves=2) == 2.3 and DEEPSEEK.time("attn", "F", 2) == 4.1
    assert DEEPSEEK.time("head", "F") == 0.0  # optional parts absent: no time
    data = json.loads(PROFILE_FILE.read_text())
    with pytest.raises(
        ValueError, match=r"compute.mlp_W must be a finite number of ms >= 0, got -1"
    ):
        NodeProfile.from_dict({**data, "compute": {**data["compute"], "mlp_W": -1}})
    del data["comm"]["combine_B"]
    with pytest.raises(ValueError, match="profile 'comm' lacks combine_B"):
        NodeProfile.from_dict(data)


def test_node_names_map_to_profile_roles():
    names = ["layer3.attention", "layer3.dispatch1", "layer3.experts", "layer0.combine0",
             "layer3.finish", "embedding", "head", "layer2"]
    assert [role_of(n) for n in names] == [
        "attn", "dispatch", "mlp", "combine", "finish", "embedding", "head", "dense_layer"]


def test_the_steady_state_pair_of_four_deepseek_layers():
    """Sequential 244 ms (4 x (F 24.1 + B 36.9)); the dataflow pair with deferred weight
    gradients split by count 135.2 ms (1.80x: the plan's head runs 2 of a layer's 3 deferred
    GEMMs before the backward attention), by time 130.9 ms (1.86x, the issue's estimate),
    without deferral 147.6 ms."""
    deferred = node_ops(PAIR, NodeCosts(DEEPSEEK, 3, 4, defer_wgrad=True))
    inline = node_ops(PAIR, NodeCosts(DEEPSEEK, 3, 4))
    for ops in (deferred, inline):
        assert sum(op.duration for op in ops) == pytest.approx(244.0)
    assert span(deferred) == pytest.approx(135.2, abs=0.05)
    assert span(inline) == pytest.approx(147.6, abs=0.05)
    # a CPU host (the compute stream is the host thread) loses nothing in a MoE pair
    cpu = node_ops(PAIR, NodeCosts(DEEPSEEK, 3, 4, defer_wgrad=True, host_runs_compute=True))
    assert span(cpu) == pytest.approx(span(deferred))
    # split by time (the nodes carry their times): one GEMM in each of the three compute gaps
    for host in (False, True):
        timed = NodeCosts(DEEPSEEK, 3, 4, defer_wgrad=True, host_runs_compute=host,
                          wgrad_by_time=True)
        ops = node_ops(PAIR, timed)
        assert sum(op.duration for op in ops) == pytest.approx(244.0)
        assert span(ops) == pytest.approx(130.93, abs=0.01)


def test_a_program_keeps_each_stream_in_order_and_each_node_after_its_inputs():
    for waves in (1, 3):
        nodes = NodeCosts(DEEPSEEK, 2, 2, a2a_waves=waves, defer_wgrad=True)
        for action in (PAIR, Action(0, Kind.F, 0), Action(1, Kind.B, 0)):
            ops = node_ops(action, nodes)
            times = op_times(ops, 5.0)
            last_end = {"compute": 5.0, "comm": 5.0}
            for op, (begin, end) in zip(ops, times):
                assert begin >= last_end[op.stream] - 1e-9
                assert all(begin >= times[d][1] - 1e-9 for d in op.needs)
                last_end[op.stream] = end


def test_chunks_pipeline_a_lone_forward():
    plain = span(node_ops(Action(1, Kind.F, 0), NodeCosts(DEEPSEEK, 3, 4)))
    waved = span(node_ops(Action(1, Kind.F, 0), NodeCosts(DEEPSEEK, 3, 4, a2a_waves=2)))
    assert plain == pytest.approx(4 * DEEPSEEK.layer_time("F"))
    # two waves: each layer is attention + its comm chain (the experts hide): 4 x 19.5
    assert waved == pytest.approx(78.0)


def test_a_plain_run_is_its_nodes_in_sequence():
    schedule = build_schedule("1f1b", 1, 3)
    nodes = NodeCosts(DEEPSEEK, 1, 2, combined=False)
    per_mb = 2 * sum(DEEPSEEK.layer_time(d) for d in "FBW")
    assert simulate(schedule, Costs(nodes=nodes)).makespan == pytest.approx(3 * per_mb)


def test_the_chunk_default_comes_from_the_costs():
    schedule = build_schedule("interleaved-1f1b", 2, 8, vpp=2, overlap=True)
    nodes = NodeCosts(DEEPSEEK, schedule.num_stages, 2, defer_wgrad=True)
    assert choose_a2a_waves(schedule, nodes) == 2  # 3 and 4 gain under 1% more
    assert choose_a2a_waves(schedule, nodes, max_waves=1) == 1
    free_comm = NodeProfile({k: v for k, v in DEEPSEEK.times.items() if k[0] in ("attn", "mlp")})
    assert choose_a2a_waves(schedule, replace(nodes, profile=free_comm)) == 1


def test_the_combined_schedule_hides_most_of_the_all_to_all():
    plain = build_schedule("interleaved-1f1b", 2, 16, vpp=2)
    paired = build_schedule("interleaved-1f1b", 2, 16, vpp=2, overlap=True)
    before = simulate(plain, Costs(nodes=NodeCosts(DEEPSEEK, 4, 4, combined=False)))
    after = simulate(paired, Costs(nodes=NodeCosts(DEEPSEEK, 4, 4, 2, defer_wgrad=True)))
    assert before.exposed_comm_fraction == 1.0
    assert before.makespan / after.makespan > 1.6
    assert after.exposed_comm_fraction < 0.15


def test_early_sends_hand_each_half_on_at_its_last_node():
    nodes = NodeCosts(DEEPSEEK, 3, 4, defer_wgrad=True)
    ops = node_ops(PAIR, nodes)
    times = op_times(ops, 0.0)
    forward, backward = half_ends(ops, times, EACH)
    assert ops[-1].part == "wgrad" and backward < times[-1][1]  # before the held W tail
    last_f = max(i for i, op in enumerate(ops) if op.action.kind is Kind.F)
    assert forward == times[last_f][1] and ops[last_f].part == "finish"
    assert half_ends(ops, times, WHOLE) == (max(forward, backward),) * 2
    assert half_ends(ops, times, AT_END) == (times[-1][1],) * 2
    # in a run: never later than at the end, and sooner where a peer waits for it
    schedule = build_schedule("dualpipev", 2, 8, overlap=True)
    spans = {rule: simulate(schedule, Costs(nodes=replace(
        nodes, num_stages=schedule.stages_per_pipeline, early_sends=rule))).makespan
        for rule in (EACH, WHOLE, AT_END)}
    assert spans[EACH] <= spans[WHOLE] < spans[AT_END]
    with pytest.raises(ValueError, match="early_sends='soon' is not one of"):
        NodeCosts(DEEPSEEK, 3, 4, early_sends="soon")


def test_a_host_cost_lengthens_every_f_and_b_node_but_not_the_weight_gradients():
    forward = node_ops(Action(1, Kind.F, 0), NodeCosts(DEEPSEEK, 3, 4, host_cost=0.5))
    assert span(forward) == pytest.approx(4 * (DEEPSEEK.layer_time("F") + 5 * 0.5))  # a chain
    pair = node_ops(PAIR, NodeCosts(DEEPSEEK, 3, 4, defer_wgrad=True, host_cost=0.5))
    assert sum(op.duration for op in pair) == pytest.approx(244.0 + 40 * 0.5)  # 40 F/B nodes
    with pytest.raises(ValueError, match="host_cost must be >= 0, got -1"):
        NodeCosts(DEEPSEEK, 3, 4, host_cost=-1)
