"""The pair order: the issue order the combined step carries out and the simulator models."""

import pytest

from megapipe.pairing.order import (
    COMM,
    COMPUTE,
    FILL,
    HEAD,
    REST,
    TAIL,
    IssueOrder,
    format_pair_table,
    issue_order,
    pair_slots,
    queuing_positions,
)
from megapipe.pairing.slots import COMM_READS_HOST
from megapipe.pairing.timing import NodeTimes, time_issues

# attention, dispatch, experts, combine, finish
MOE = ["compute", "comm", "compute", "comm", "compute"]
NAMES = ["attention", "dispatch", "experts", "combine", "finish"]
DENSE = ["compute"]


def _label(issue):
    if issue.side == "W":
        return f"W{issue.layer}.{issue.share}"
    return f"{issue.side}{issue.layer}.{NAMES[issue.node] if issue.node < 5 else issue.node}"


def test_two_moe_layers_give_megatrons_four_pairs():
    slots = pair_slots(MOE, MOE)
    named = [tuple(" ".join(f"{side} {NAMES[n]}" for side, n in refs) or None for refs in slot)
             for slot in slots]
    assert named == [
        (None, "B finish"),
        ("B combine", "F attention"),
        ("F dispatch", "B experts"),
        ("B dispatch", "F experts"),
        ("F combine", "B attention"),
        (None, "F finish"),
    ]


def test_step_plan_order_waits_and_weight_gradients():
    issues = issue_order([MOE, MOE], [MOE, MOE], defer_wgrad=True)
    comm = [_label(i) for i in issues if i.stream == COMM]
    assert comm == ["B1.combine", "F0.dispatch", "B1.dispatch", "F0.combine",
                    "B0.combine", "F1.dispatch", "B0.dispatch", "F1.combine"]
    compute = [_label(i) for i in issues if i.stream == COMPUTE]
    assert compute == [
        "B1.finish", "F0.attention", "B1.experts", "F0.experts", "W1.head", "B1.attention",
        "F0.finish", "B0.finish", "F1.attention", "W1.tail", "B0.experts", "F1.experts",
        "W0.head", "B0.attention", "F1.finish", "W0.tail", "W-1.rest",
    ]
    # host order on CPU: a queued comm node is never held back by weight gradients
    host = [_label(i) for i in issues]
    assert host.index("F0.combine") < host.index("W1.head")
    assert host.index("F1.dispatch") < host.index("W1.tail")
    # each node waits (an event) only for the previous node of its side, when that ran on the
    # other stream; weight gradients wait for nothing on the other stream
    last = {}
    for issue in issues:
        if issue.side == "W":
            assert issue.needs == ()
            continue
        previous = last.get(issue.side)
        expected = () if previous is None or previous.stream == issue.stream else (previous.name,)
        assert issue.needs == expected, _label(issue)
        last[issue.side] = issue
    # the W head shares the slot of its layer's B dispatch, the tail that of the next B combine
    slot_of = {_label(i): i.slot for i in issues}
    assert slot_of["W1.head"] == slot_of["B1.dispatch"]
    assert slot_of["W1.tail"] == slot_of["B0.combine"]


@pytest.mark.parametrize("forward,backward", [
    ([DENSE, MOE, MOE, DENSE], [DENSE, MOE, DENSE]),   # embedding/dense/head around MoE layers
    ([MOE], [MOE, MOE, MOE]),                          # leftover backward layers
    ([MOE, MOE, MOE], [MOE]),                          # leftover forward layers
    ([MOE, MOE], []),                                  # a forward alone
    ([["compute", "comm"], ["comm", "compute", "comm"]],
     [["comm"], ["compute", "comm", "compute"]]),
])
@pytest.mark.parametrize("defer", [False, True])
def test_every_node_is_issued_once_in_its_sides_order(forward, backward, defer):
    issues = issue_order(forward, backward, defer_wgrad=defer)
    f_nodes = [(i.layer, i.node) for i in issues if i.side == "F"]
    b_nodes = [(i.layer, i.node) for i in issues if i.side == "B"]
    assert f_nodes == [(k, n) for k, kinds in enumerate(forward) for n in range(len(kinds))]
    assert b_nodes == [(b, n) for b in reversed(range(len(backward)))
                       for n in reversed(range(len(backward[b])))]
    kinds = {("F", k, n): kind for k, layer in enumerate(forward) for n, kind in enumerate(layer)}
    kinds.update({("B", b, n): kind
                  for b, layer in enumerate(backward) for n, kind in enumerate(layer)})
    for issue in issues:
        if issue.side != "W":
            assert issue.stream == kinds[(issue.side, issue.layer, issue.node)]
    position = {i.name: n for n, i in enumerate(issues) if i.side != "W"}
    for n, issue in enumerate(issues):
        assert all(position[need] < n for need in issue.needs)
    w = [(i.layer, i.share) for i in issues if i.side == "W"]
    moe_backward = [b for b, kinds in enumerate(backward) if COMM in kinds]
    if defer and backward:
        assert sorted(w) == sorted([(b, HEAD) for b in moe_backward]
                                   + [(b, TAIL) for b in moe_backward] + [(-1, REST)])
    else:
        assert w == []


def test_a_queuing_host_issues_a_host_reading_comm_node_after_its_slots_compute():
    """On CUDA the host issues comm nodes first (a ready all-to-all is not queued behind the
    compute beside it), except a comm node that reads the host (a dropless dispatch): it goes
    after its slot's compute, so the host has queued that compute before it blocks. Each stream
    keeps its sequence and every issue comes after what it waits for."""
    moe = ["compute", COMM_READS_HOST, "compute", "comm", "compute"]
    issues = issue_order([DENSE, moe, moe], [moe, moe, DENSE], defer_wgrad=True)
    order = queuing_positions(issues)
    assert sorted(order) == list(range(len(issues)))
    reordered = [issues[n] for n in order]
    for stream in (COMPUTE, COMM):
        assert [i for i in reordered if i.stream == stream] == \
            [i for i in issues if i.stream == stream]
    at = {issues[n].name: k for k, n in enumerate(order) if issues[n].side != "W"}
    for issue in issues:  # what an issue waits for was issued before it
        assert all(at[need] < at[issue.name] for need in issue.needs)
    labels = [_label(issues[n]) for n in order]
    assert labels.index("B1.combine") < labels.index("F1.attention")  # a ready combine first
    assert labels.index("B1.experts") < labels.index("F1.dispatch")  # the read after compute
    assert labels.index("F1.combine") < labels.index("B1.attention")
    assert [i.reads_host for i in issues if i.node == 1 and i.side != "W"] == [True, False] * 2
    plain = issue_order([DENSE, MOE, MOE], [MOE, MOE, DENSE], defer_wgrad=True)
    assert queuing_positions(plain) == list(range(len(plain)))  # nothing reads the host


def test_a_pair_of_layer_shapes_is_planned_once():
    """The pair order places a layer pair (``layer_pair``, cached by the layers' walks) into
    every combined step: two of the same shape work nothing out again and give equal issues."""
    from megapipe.pairing.layer_pair import layer_pair

    first = issue_order([MOE, DENSE], [DENSE, MOE], defer_wgrad=True)
    before = layer_pair.cache_info()
    second = issue_order([MOE, DENSE], [DENSE, MOE], defer_wgrad=True)
    after = layer_pair.cache_info()
    assert first == second
    assert after.misses == before.misses and after.hits > before.hits


# DeepSeek-V3 on H800, per MoE layer (ms), with the attention's weight gradient inside B and the
# experts' weight gradient (6.4 ms) deferred as three equal GEMMs
DEEPSEEK = {("F", 0): 4.1, ("F", 1): 6.7, ("F", 2): 4.6, ("F", 3): 8.7, ("F", 4): 0.0,
            ("B", 0): 11.9, ("B", 1): 7.5, ("B", 2): 5.3, ("B", 3): 5.8, ("B", 4): 0.0}


def _duration(issue):
    if issue.side == "W":
        return {HEAD: 2 * 6.4 / 3, TAIL: 6.4 / 3, REST: 0.0}[issue.share]
    return DEEPSEEK[(issue.side, issue.node)]


def test_plan_hides_the_all_to_all_of_a_deepseek_like_pair_of_four_layers():
    # a model check of the plan, not a timing of the code: four layer pairs take 244 ms in
    # sequence; the old slot order with joins took 141.6 ms (1.72x)
    issues = issue_order([MOE] * 4, [MOE] * 4, defer_wgrad=True)
    sequential = 4 * (sum(DEEPSEEK.values()) + 6.4)
    gpu = max(end for _, end in time_issues(issues, _duration))
    cpu = max(end for _, end in time_issues(issues, _duration, host_runs_compute=True))
    assert sequential == pytest.approx(244.0)
    assert sequential / gpu > 1.8, gpu
    assert sequential / cpu > 1.8, cpu


def _timed_plan(layers):
    """The time rule on DeepSeek's pair: each node's times, the experts' W as 3 items."""
    times = [NodeTimes(DEEPSEEK[("F", n)], DEEPSEEK[("B", n)], (6.4 / 3,) * 3 if n == 2 else ())
             for n in range(5)]
    order = IssueOrder([MOE] * layers, defer_wgrad=True, backward_times=[times] * layers)
    for _ in range(layers):
        order.forward_layer(MOE, times)
    order.finish()
    return order.issues


def _timed_duration(issues):
    placed = sum(i.count for i in issues if i.share == FILL)

    def duration(issue):
        if issue.side == "W":  # REST: the items no FILL took
            return (issue.count if issue.share == FILL else 12 - placed) * 6.4 / 3
        return DEEPSEEK[(issue.side, issue.node)]

    return duration


def test_time_rule_fills_the_three_compute_gaps_of_each_layer_pair():
    # the count rule's head (2 of 3 GEMMs, 4.3 ms) overran the 2.9 ms gap after the F experts:
    # 135.2 ms; by time one GEMM goes into each gap: after the B experts, after the F experts,
    # beside the next B combine (after the F attention): 130.9 ms, 1.86x
    issues = _timed_plan(4)
    labels = [_label(i) if i.side != "W" else i.label() for i in issues]
    for b in (3, 2, 1):
        f = 3 - b
        experts, f_experts = labels.index(f"B{b}.experts"), labels.index(f"F{f}.experts")
        assert labels[experts + 2: f_experts] == [f"W{b}.fill1"]  # after B dispatch, this W
        assert labels[f_experts + 2] == f"W{b}.fill1"  # after the F combine is queued
        assert labels[labels.index(f"F{f + 1}.attention") + 2] == f"W{b}.fill1"
    assert all(i.share in (FILL, REST) for i in issues if i.side == "W")
    assert sum(i.count for i in issues if i.share == FILL) <= 12
    span = max(end for _, end in time_issues(issues, _timed_duration(issues)))
    assert span == pytest.approx(130.93, abs=0.01)
    assert 244.0 / span > 1.86


def test_time_rule_needs_times_for_every_node_of_the_backward():
    with pytest.raises(ValueError, match="node times per layer"):
        IssueOrder([MOE], defer_wgrad=True, backward_times=[[NodeTimes(1.0, 1.0)] * 4])
    # without deferral there is nothing to place: the times are not used
    assert IssueOrder([MOE], backward_times=[[NodeTimes(1.0, 1.0)] * 5]).clock is None


MOE2 = ["compute", (("comm", "compute", "comm"),) * 2, "compute"]  # a MoE layer in 2 waves
# nodes: 0 attention, 1-3 wave 0 (dispatch, experts, combine), 4-6 wave 1, 7 finish
CHUNK_NAMES = ["attention", "dispatch0", "experts0", "combine0", "dispatch1", "experts1",
               "combine1", "finish"]


def _slot_names(slots):
    return [tuple(" ".join(f"{side} {CHUNK_NAMES[n]}" for side, n in refs) or None for refs in slot)
            for slot in slots]


def test_a_lone_chunked_layer_pipelines_its_chunks():
    assert _slot_names(pair_slots(MOE2, None)) == [
        (None, "F attention"),
        ("F dispatch0", None),
        ("F dispatch1", "F experts0"),
        ("F combine0", "F experts1"),
        ("F combine1", None),
        (None, "F finish"),
    ]
    assert _slot_names(pair_slots(None, MOE2)) == [
        (None, "B finish"),
        ("B combine0", None),
        ("B combine1", "B experts0"),
        ("B dispatch0", "B experts1"),
        ("B dispatch1", None),
        (None, "B attention"),
    ]
    issues = issue_order([MOE2], [])
    by_node = {i.node: i for i in issues}
    assert by_node[2].needs == (("F", 0, 1),)  # experts 0 waits for dispatch 0 only
    assert by_node[7].needs == (("F", 0, 3), ("F", 0, 6))  # finish waits for both combines


def test_a_chunked_layer_beside_a_partner_keeps_the_four_pairs_grouped():
    assert _slot_names(pair_slots(MOE2, MOE2)) == [
        (None, "B finish"),
        ("B combine0 B combine1", "F attention"),
        ("F dispatch0 F dispatch1", "B experts0 B experts1"),
        ("B dispatch0 B dispatch1", "F experts0 F experts1"),
        ("F combine0 F combine1", "B attention"),
        (None, "F finish"),
    ]


@pytest.mark.parametrize("forward,backward", [([MOE2, MOE2], [MOE2, MOE2]), ([MOE2], [MOE, MOE2]),
                                              ([DENSE, MOE2], [MOE2, DENSE, MOE2])])
def test_every_node_of_chunked_layers_is_issued_once_after_its_inputs(forward, backward):
    issues = issue_order(forward, backward, defer_wgrad=True)
    done = set()
    for issue in issues:
        assert all(need in done for need in issue.needs)
        if issue.side != "W":
            key = (issue.side, issue.layer, issue.node)
            assert key not in done
            done.add(key)
    sizes = {"F": [8 if shape is MOE2 else len(shape) for shape in forward],
             "B": [8 if shape is MOE2 else len(shape) for shape in backward]}
    assert len(done) == sum(sizes["F"]) + sum(sizes["B"])


def _table_rows(text: str) -> list[list[str]]:
    """The cells of the first markdown table in ``text`` with a 'slot' header, spaces trimmed."""
    start = text.index("| slot")
    rows = []
    for line in text[start:].splitlines():
        if not line.startswith("|"):
            break
        if not set(line) <= set("|- "):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def test_the_pair_table_of_the_docs_and_the_docstring_is_the_order_itself():
    from pathlib import Path

    from megapipe.pairing import order as pair_order

    table = _table_rows(format_pair_table(MOE, MOE, NAMES, defer_wgrad=True))
    assert table[1:3] == [["1", "", "B finish"],
                          ["2", "B combine", "F attention, then W tail of the previous B layer"]]
    doc = Path(__file__).resolve().parents[2] / "docs" / "combined-step.md"
    assert _table_rows(doc.read_text()) == table
    assert _table_rows(pair_order.__doc__) == table
