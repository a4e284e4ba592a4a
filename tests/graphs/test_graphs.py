"""CUDA graphs of static nodes (``megapipe.graphs.nodes``), on CPU with the graph stand-in.

``tests.support.fake_graphs.FakeGraphApi`` records each captured function and replays it on
the static buffers (a capture's results are garbage until replayed, host syncs are refused), so
what the capture logic decides runs here: what is captured, the static buffers, which instance
replays, the state writes, the gradients, the refusals.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

import pytest
import torch

from megapipe.graphs.nodes import Graphable, NodeGraphs, node_graphs
from megapipe.graphs.rules import (
    GRAPH_IMPLS,
    GRAPH_MODULES,
    MOE_NOT_STATIC,
    coverage_problem,
    settings_problem,
)
from megapipe.models import GPTConfig, build_stage
from megapipe.models.gpt import gpt_loss, graph_holders
from megapipe.moe.grouped_gemm import grouped_matmul
from megapipe.moe.layer import MoEState, set_sync_free
from megapipe.overlap import combined_step, make_streams, record_forward, run_backward
from megapipe.overlap.plan import LayerState, Node, NodeKind, Plan, run_nodes
from megapipe.overlap.wgrad import WeightGradQueue
from megapipe.precision.main_grad import accumulated_grad, attach_main_grads
from megapipe.train.config import flag_checks as flags
from megapipe.train.optim.mixed_precision import cast_to_bf16
from support.fake_graphs import FakeGraphApi

CONFIG = GPTConfig(hidden_size=32, num_layers=3, num_heads=2, seq_length=16, ffn_hidden_size=64,
                   num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32, first_k_dense_layers=1,
                   moe_aux_loss_coeff=0.01)
MODULES = ("attn", "moe_router", "mlp")


def _batches(count: int, seq: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    ids = torch.randint(0, 256, (count, 2, seq + 1), generator=torch.Generator().manual_seed(3))
    return [(row[:, :-1], row[:, 1:]) for row in ids]


def _stage(bf16: bool = False, config: GPTConfig = CONFIG):  # noqa: ANN202
    stage = build_stage(config, 0, 1)
    if bf16:
        cast_to_bf16([stage], list(stage.parameters()))
    return stage


def _grads(stage) -> list[torch.Tensor | None]:  # noqa: ANN001
    return [accumulated_grad(p) for p in stage.parameters()]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is not None and y is not None and torch.equal(x, y)
                                    for x, y in zip(a, b))


def _tape_run(stage, graphs: NodeGraphs | None, batches, in_flight: int = 1):  # noqa: ANN001
    """Forward ``in_flight`` microbatches on tapes, then their backwards, repeatedly."""
    plans = stage.layer_plans() if graphs is None else [graphs.plan(p) for p in
                                                        stage.layer_plans()]
    losses = []
    for start in range(0, len(batches), in_flight):
        held = []
        for ids, labels in batches[start:start + in_flight]:
            (out,), tape = record_forward(plans, (ids,))
            loss = gpt_loss(out, labels)
            held.append((out, tape, loss))
            losses.append(loss.detach())
        for out, tape, loss in held:
            (grad,) = torch.autograd.grad(loss, out)
            run_backward(tape, (grad,))
    return losses


def _plain_run(stage, graphs: NodeGraphs | None, batches):  # noqa: ANN001
    stage.node_runner = None if graphs is None else graphs.runner()
    try:
        losses = []
        for ids, labels in batches:
            loss = gpt_loss(stage(ids), labels)
            loss.backward()
            losses.append(loss.detach())
        return losses
    finally:
        stage.node_runner = None


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("path", ["plain", "tape"])
def test_graphs_give_the_eager_bits_and_capture_each_node_once(path: str, bf16: bool) -> None:
    batches = _batches(3)
    run = _plain_run if path == "plain" else _tape_run
    eager = _stage(bf16)
    eager_losses = run(eager, None, batches)
    stage, api = _stage(bf16), FakeGraphApi()
    graphs = NodeGraphs(MODULES, api)
    losses = run(stage, graphs, batches)
    assert _same(eager_losses, losses) and _same(_grads(eager), _grads(stage))
    # a dense node and two MoE attention nodes, each captured once (forward and backward) and
    # replayed once per microbatch each way; one instance each: every backward ran before the
    # next forward
    assert graphs.captured == 3 and api.count("capture") == 6
    assert api.count("replay") == 2 * 3 * len(batches)
    assert graphs.bytes > 0


def test_forwards_in_flight_get_their_own_instances_and_new_shapes_their_own_graphs() -> None:
    eager, stage = _stage(), _stage()
    graphs = NodeGraphs(MODULES, FakeGraphApi())
    batches = _batches(4) + _batches(2, seq=8)
    assert _same(_tape_run(eager, None, batches, in_flight=2),
                 _tape_run(stage, graphs, batches, in_flight=2))
    assert _same(_grads(eager), _grads(stage))
    # two forwards before their backwards: two instances per node; seq 8: two more each
    assert graphs.captured == 3 * 2 + 3 * 2


def test_a_combined_step_replays_its_graphs_on_the_compute_stream() -> None:
    batches = _batches(2)
    results = []
    for graphs in (None, NodeGraphs(MODULES, FakeGraphApi())):
        stage, out_f = _pair(CONFIG, graphs, batches)
        results.append((out_f, _grads(stage)))
        if graphs is not None:  # the comm stream's worker never ran a graph
            threads = {stream for kind, _, stream in graphs.api.events if kind == "replay"}
            assert threads == {threading.current_thread().name}
            assert graphs.captured == 6  # the pair holds two microbatches of every node
    assert torch.equal(results[0][0], results[1][0]) and _same(results[0][1], results[1][1])


RANK_CAPACITY = replace(CONFIG, moe_expert_rank_capacity_factor=2.0)
WHOLE = ("attn", "moe", "mlp")  # the MoE layers graphed whole


def _pair(config: GPTConfig, graphs: NodeGraphs | None, batches):  # noqa: ANN001, ANN202
    """A combined step (F of microbatch 1 beside B of microbatch 0, deferred W) on a stage."""
    stage = _stage(config=config)
    plans = stage.layer_plans() if graphs is None else [graphs.plan(p) for p in
                                                        stage.layer_plans()]
    (out_b,), tape_b = record_forward(plans, (batches[0][0],))
    (grad,) = torch.autograd.grad(gpt_loss(out_b, batches[0][1]), out_b)
    with make_streams("cpu") as streams:
        (out_f,), _, _ = combined_step(plans, (batches[1][0],), tape_b, (grad,), streams,
                                       delay_wgrad_compute=True)
    return stage, out_f


def test_moe_layers_graphed_whole_with_a_rank_capacity_keep_the_eager_bits() -> None:
    batches = _batches(4)
    eager, out_eager = _pair(RANK_CAPACITY, None, batches)
    graphs = NodeGraphs(WHOLE, FakeGraphApi())
    stage, out = _pair(RANK_CAPACITY, graphs, batches)
    assert torch.equal(out, out_eager) and _same(_grads(eager), _grads(stage))
    # a dense node and each MoE layer's attention, experts and finish: replayed for both
    # forwards and the one backward (microbatch 1's forward reuses the instances whose
    # backward ran before it); the all-to-all nodes run eager (no NCCL here)
    assert graphs.api.count("replay") == 3 * (1 + 2 * 3) and graphs.stats.eager == {}
    assert 1 + 2 * 3 < graphs.captured < 2 * (1 + 2 * 3)
    replayed = {stream for kind, _, stream in graphs.api.events if kind == "replay"}
    assert replayed == {threading.current_thread().name}  # the compute stream only
    eager, stage = _stage(config=RANK_CAPACITY), _stage(config=RANK_CAPACITY)
    graphs = NodeGraphs(WHOLE, FakeGraphApi())
    assert _same(_tape_run(eager, None, batches, in_flight=2),
                 _tape_run(stage, graphs, batches, in_flight=2))
    assert _same(_grads(eager), _grads(stage)) and graphs.captured == 2 * 7


def test_moe_nodes_whose_shapes_follow_the_routing_run_eager_and_say_why() -> None:
    batches = _batches(2)
    eager, stage = _stage(), _stage()  # dropless: no rank capacity
    graphs = NodeGraphs(WHOLE, FakeGraphApi())
    assert _same(_tape_run(eager, None, batches), _tape_run(stage, graphs, batches))
    assert _same(_grads(eager), _grads(stage)) and graphs.captured == 3
    assert "experts eager: dropless without --moe-expert-rank-capacity-factor" in \
        graphs.describe()
    tight = replace(CONFIG, moe_expert_rank_capacity_factor=0.5)  # its lanes overflow
    eager, stage = _stage(config=tight), _stage(config=tight)
    graphs = NodeGraphs(WHOLE, FakeGraphApi())
    assert _same(_tape_run(eager, None, batches[:1]), _tape_run(stage, graphs, batches[:1]))
    assert int(stage.layers["1"].moe.rank_overflow) == 1
    for module in (eager, stage):  # a step run again without the capacity (an overflow)
        set_sync_free([module], False)
    assert _same(_tape_run(eager, None, batches), _tape_run(stage, graphs, batches))
    assert _same(_grads(eager), _grads(stage))
    assert graphs.stats.eager["finish"].startswith("a step run again dropless")
    # the attention nodes' instances: one with the rank capacity, one without (its route
    # places the sends only with it), beside the dense node's and the first run's MoE nodes'
    assert graphs.captured == 1 + 2 * 3 + 2


def test_state_writes_and_the_aux_loss_log_follow_each_replay() -> None:
    stage = _stage()
    graphs = NodeGraphs(MODULES, FakeGraphApi())
    plan = graphs.plan(stage.layer_plans()[2])  # layer 1: MoE
    moe = stage.layers["1"].moe
    eager_plan = stage.layer_plans()[2]
    x = torch.randn(2, 16, 32, requires_grad=True)
    for scale in (0.5, 0.5, 0.25):  # a new scale (Graphable.key) captures a new instance
        moe.aux_loss_scale = scale
        out_eager = run_nodes(eager_plan, (x,))[0]
        (g_eager,) = torch.autograd.grad(out_eager.sum(), x)
        eager_log = moe.aux_loss_log.pop_all()
        state = MoEState()
        out = run_nodes(plan, (x,), state)[0]
        (g,) = torch.autograd.grad(out.sum(), x)
        log = moe.aux_loss_log.pop_all()
        assert torch.equal(out, out_eager) and torch.equal(g, g_eager)
        assert len(log) == len(eager_log) == 1 and torch.equal(log[0], eager_log[0])
        assert torch.equal(state.row_choice, _route_state(stage, x).row_choice)
    assert graphs.captured == 2


def _route_state(stage, x: torch.Tensor) -> MoEState:  # noqa: ANN001
    state = MoEState()
    with torch.no_grad():
        stage.layer_plans()[2][0].fn(state, (x,))
    stage.layers["1"].moe.aux_loss_log.pop_all()
    return state


def test_what_is_captured_follows_the_modules() -> None:
    stage = _stage()
    plans = stage.layer_plans()
    for modules, captured in ((("attn", "mlp"), ["layer0"]),
                              (("attn", "moe_preprocess"), ["layer1.attention",
                                                            "layer2.attention"])):
        graphs = NodeGraphs(modules, FakeGraphApi())
        names = [n.name for p in plans for n, w in zip(p, graphs.plan(p))
                 if isinstance(n, Node) and w.fn is not n.fn]
        assert names == captured
    # comm nodes and host-reading nodes are never wrapped, even when they declare modules
    graphs = NodeGraphs(("attn",), FakeGraphApi())
    spec = Graphable(("attn",), ())
    for node in (Node("a2a", NodeKind.COMM, lambda s, t: t, graphable=spec),
                 Node("reads", NodeKind.COMPUTE, lambda s, t: t, reads_host=True,
                      graphable=spec)):
        with pytest.raises(ValueError, match=f"node '{node.name}' .* can never be captured"):
            graphs.plan(Plan([node]))


def _one_node(fn, params=(), **spec) -> tuple[Plan, NodeGraphs, FakeGraphApi]:  # noqa: ANN001
    api = FakeGraphApi()
    graphs = NodeGraphs(("attn",), api)
    node = Node("n", NodeKind.COMPUTE, fn, graphable=Graphable(("attn",), tuple(params), **spec))
    return graphs.plan(Plan([node], LayerState)), graphs, api


@dataclass(eq=False, slots=True)
class _ScaleState(LayerState):
    scale: torch.Tensor | None = None


def test_state_tensors_are_refilled_before_each_replay_and_weight_grads_run_in_the_graph(
) -> None:
    x = torch.randn(4, 8, requires_grad=True)
    plan, graphs, api = _one_node(lambda s, t: (t[0] * s.scale,))
    for scale in (torch.full((8,), 2.0), torch.arange(8.0)):  # one instance, refilled
        (y,) = run_nodes(plan, (x,), _ScaleState(scale=scale))
        assert torch.equal(y, x * scale)
        y.sum().backward()
        del y  # its output buffer free again
    assert graphs.captured == 1 and api.count("replay") == 4
    (y,) = run_nodes(plan, (x,), _ScaleState(scale=torch.ones(4, 1, 8)))  # another shape
    assert torch.equal(y, x * torch.ones(4, 1, 8)) and graphs.captured == 2
    with pytest.raises(RuntimeError, match=r"reads state\.scale, a tensor that needs a grad"):
        run_nodes(plan, (x,), _ScaleState(scale=torch.ones(8, requires_grad=True)))
    weight = torch.randn(2, 8, 8, requires_grad=True)

    def deferring(state: LayerState, tensors: tuple) -> tuple:
        return (grouped_matmul(tensors[0], (2, 2), weight, state=state),)

    (want,) = torch.autograd.grad(run_nodes([Node("n", NodeKind.COMPUTE, deferring)], (x,))[0]
                                  .sum(), weight)
    plan, _, _ = _one_node(deferring, [weight])
    (out,), tape = record_forward([plan], (x,))
    queue = WeightGradQueue()
    run_backward(tape, (torch.ones_like(out),), wgrad=queue)
    assert len(queue) == 0 and torch.equal(weight.grad, want)  # computed in the graph


def test_a_captured_node_writing_an_undeclared_state_field_is_refused() -> None:
    x = torch.randn(4, 8, requires_grad=True)

    def writes(state: LayerState, tensors: tuple) -> tuple:
        state.scale = tensors[0].sum()
        return (tensors[0] * 2,)

    plan, _, _ = _one_node(writes)
    with pytest.raises(AttributeError, match="LayerState declares no field 'scale'"):
        run_nodes(plan, (x,))
    state = _ScaleState()
    assert torch.equal(run_nodes(plan, (x,), state)[0], x * 2)  # declared: written at replay
    assert torch.equal(state.scale, x.sum())


def test_undeclared_parameters_host_syncs_and_moved_storage_are_refused() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(8, 8, requires_grad=True)
    plan, _, _ = _one_node(lambda s, t: (t[0] @ weight,))
    with pytest.raises(RuntimeError, match=r"shape \(8, 8\) that needs a gradient but is "
                                           "neither its input nor in Graphable.params"):
        run_nodes(plan, (x,))
    plan, _, _ = _one_node(lambda s, t: (t[0] * t[0].sum().item(),))
    with pytest.raises(RuntimeError, match=r"host sync \(item\) inside a CUDA graph capture"):
        run_nodes(plan, (x,))
    plan, _, _ = _one_node(lambda s, t: (t[0] @ weight,), [weight])
    run_nodes(plan, (x,))[0].sum().backward()
    weight.data = weight.data.clone()
    with pytest.raises(RuntimeError, match="a parameter's or buffer's storage moved"):
        run_nodes(plan, (x,))
    # a main_grad the backward graph adds into, replaced after the capture
    weight = torch.randn(8, 8, requires_grad=True)
    attach_main_grads([weight])
    plan, _, _ = _one_node(lambda s, t: (t[0] @ weight,), [weight])
    run_nodes(plan, (x,))[0].sum().backward()
    assert weight.grad is None and torch.equal(weight.main_grad, x.detach().t() @ torch.ones(4, 8))
    weight.main_grad = torch.zeros(8, 8)
    with pytest.raises(RuntimeError, match="a parameter's main_grad moved since its graphs"):
        run_nodes(plan, (x,))


def test_a_second_backward_and_a_missing_output_gradient_are_refused() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    plan, _, _ = _one_node(lambda s, t: (t[0] * 2, t[0] * 3))
    a, b = run_nodes(plan, (x,))
    with pytest.raises(RuntimeError, match="output got no gradient"):
        a.sum().backward()
    a, b = run_nodes(plan, (x,))
    (a.sum() + b.sum()).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice on one forward"):
        (a.sum() + b.sum()).backward()


def test_a_capture_warms_up_then_captures_both_graphs_in_one_pool_then_replays() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    plan, graphs, api = _one_node(lambda s, t: (torch.tanh(t[0]),))
    out = run_nodes(plan, (x,))[0]
    assert [e[:2] for e in api.events] == [("warm", -1), ("capture", 1), ("capture", 1),
                                           ("replay", 1)]
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert [e[:2] for e in api.events[4:]] == [("replay", 1)]
    (eager,) = torch.autograd.grad(torch.tanh(x).sum(), x)
    assert torch.equal(out, torch.tanh(x)) and torch.equal(grad, eager)
    # once nothing views its output the instance is free again; a second forward in flight
    # captures a second instance, in a pool of its own
    del out
    a, b = run_nodes(plan, (x,))[0], run_nodes(plan, (x * 2,))[0]
    assert [e[:2] for e in api.events[5:]] == [("replay", 1), ("warm", -1), ("capture", 2),
                                               ("capture", 2), ("replay", 2)]
    assert torch.equal(a, torch.tanh(x)) and torch.equal(b, torch.tanh(x * 2))


def test_an_instance_is_reused_only_when_nothing_views_its_outputs() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    plan, graphs, _ = _one_node(lambda s, t: (t[0] * 2,))
    kept = run_nodes(plan, (x,))[0]
    kept.sum().backward()  # its forward's record is gone, but ``kept`` still views the buffer
    second = run_nodes(plan, (x * 3,))[0]
    assert graphs.captured == 2 and torch.equal(kept, x * 2) and torch.equal(second, x * 6)
    del kept
    second.sum().backward()
    run_nodes(plan, (x,))
    assert graphs.captured == 2


def test_evaluation_runs_eager() -> None:
    stage = _stage()
    graphs = NodeGraphs(MODULES, FakeGraphApi())
    stage.node_runner = graphs.runner()
    with torch.no_grad():
        stage(_batches(1)[0][0])
    assert graphs.captured == 0


def test_recomputing_nodes_inside_a_captured_node_keep_the_bits() -> None:
    config = GPTConfig(**{**CONFIG.__dict__, "recompute_modules": ("core_attn", "moe_act")})
    batches = _batches(2)
    eager, stage = _stage(config=config), _stage(config=config)
    graphs = NodeGraphs(MODULES, FakeGraphApi())
    assert _same(_tape_run(eager, None, batches), _tape_run(stage, graphs, batches))
    assert _same(_grads(eager), _grads(stage)) and graphs.captured == 3


def test_the_settings_rules_name_what_does_not_fit() -> None:
    assert settings_problem("none", ()) is None
    assert settings_problem("local", ("attn", "moe_router")) is None
    assert "TransformerEngine" in settings_problem("transformer_engine", ("attn",))
    assert "needs --cuda-graph-impl local" in settings_problem("none", ("attn",))
    assert "captures whole layers" in settings_problem("local", ())
    assert settings_problem("local", ("attn", "moe")) is None
    for refused in ("shared_experts", "mamba", "full_iteration", "mlp_fc1"):
        assert settings_problem("local", ("attn", refused)).startswith(
            f"--cuda-graph-modules {refused}: ")
    holders = graph_holders(CONFIG)
    assert coverage_problem(("attn", "moe_router", "mlp"), holders) is None
    assert "also holds moe_router moe_preprocess" in coverage_problem(("attn",), holders)
    assert "also holds mlp" in coverage_problem(("attn", "moe_preprocess"), holders)
    # the whole MoE layer: static only with a rank capacity; it takes the router's node along
    assert coverage_problem(("attn", "moe", "mlp"), holders) == MOE_NOT_STATIC
    static = graph_holders(replace(CONFIG, moe_expert_rank_capacity_factor=2.0))
    assert coverage_problem(("attn", "moe", "mlp"), static) is None
    assert "also holds attn" in coverage_problem(("moe", "mlp"), static)
    moe_only = graph_holders(GPTConfig(first_k_dense_layers=0))
    assert "the model has no dense layer" in coverage_problem(("attn", "moe_router", "mlp"),
                                                              moe_only)
    assert (flags.GRAPH_IMPLS, flags.GRAPH_MODULES) == (GRAPH_IMPLS, GRAPH_MODULES)


def test_without_cuda_the_graphs_are_off_and_say_so() -> None:
    graphs, note = node_graphs("local", ("attn", "moe_router"), torch.device("cpu"))
    assert graphs is None
    assert note == ("--cuda-graph-impl local (attn moe_router): CUDA graphs need CUDA; this run "
                    "is on cpu, so every node runs eager")
    assert node_graphs("none", (), torch.device("cpu")) == (None, None)
    with pytest.raises(ValueError, match="TransformerEngine"):
        node_graphs("transformer_engine", ("attn",), torch.device("cpu"))


@pytest.mark.parametrize("path", ["plain", "tape"])
def test_captured_parameters_accumulate_on_the_stream_the_reduction_waits_on(path: str) -> None:
    """Autograd binds a parameter's accumulation to the stream current when its node is made
    (``support.accumulator_streams``); the warm-up and capture run on the graphs' side stream,
    but every accumulation, in the step that captures and after, runs on the compute stream
    (here the calling thread), the one the data-parallel reduction waits on: autograd's for
    the parameters without ``main_grad`` (fp32), the backward replays' own for those with one
    (bf16: added into ``main_grad`` inside the graph; autograd accumulates none of them, and
    ``NodeGraphs.after_backward`` is told of each, for the data-parallel bucket counts)."""
    from support.accumulator_streams import AccumulatorStreams

    run = _plain_run if path == "plain" else _tape_run
    for bf16 in (False, True):
        stage, api = _stage(bf16=bf16), FakeGraphApi()
        graphs = NodeGraphs(MODULES, api)
        told: list[int] = []  # what the data-parallel sync would count (grad_added)
        graphs.after_backward.append(lambda param, into=told: into.append(id(param)))
        with AccumulatorStreams(api.stream_of) as streams:
            run(stage, graphs, _batches(2))
        assert graphs.captured == 3 and api.count("warm") == 3
        assert {stream for _, stream in streams.accumulated} == {threading.current_thread().name}
        captured = [p for plan in stage.layer_plans() for n in plan
                    if isinstance(n, Node) and graphs.covers(n) for p in n.graphable.params]
        by_autograd = [streams.leaves.count(id(p)) for p in captured]
        assert captured and by_autograd == [0 if bf16 else 2] * len(captured)  # 2 microbatches
        assert [told.count(id(p)) for p in captured] == [2 if bf16 else 0] * len(captured)
        replayed = {stream for kind, _, stream in api.events if kind == "replay"}
        assert replayed == {threading.current_thread().name}


def test_the_stand_in_replays_only_the_captured_operations_on_the_captured_memory() -> None:
    """What makes ``FakeGraphApi`` as strict as CUDA: a replay runs no Python of the captured
    function (its side effects happened once, at capture) and recomputes from the static
    inputs' current values; a capture's results are garbage until the first replay; memory the
    capture neither made nor took as a static input is refused at capture, a static input
    moved to other memory at replay."""
    api, calls = FakeGraphApi(), []
    x, weight, outside = torch.randn(4, 8), torch.randn(8, 8), torch.randn(8)

    def region() -> tuple[torch.Tensor]:
        calls.append(1)  # a Python side effect: a hook, a counter
        return (torch.tanh(x @ weight) * 2,)

    graph, (out,) = api.capture(region, None, "thread_local", (x, weight))
    assert calls == [1] and out.isnan().all()
    x.copy_(torch.randn(4, 8))
    api.replay(graph)
    api.replay(graph)
    assert calls == [1] and torch.equal(out, torch.tanh(x @ weight) * 2)
    with pytest.raises(RuntimeError, match=r"aten.add.Tensor inside a CUDA graph capture reads "
                                           r"or writes a tensor of shape \(8,\)"):
        api.capture(lambda: (x @ weight + outside,), None, "thread_local", (x, weight))
    weight.data = weight.data.clone()
    with pytest.raises(RuntimeError, match=r"static input of shape \(8, 8\) moved"):
        api.replay(graph)
