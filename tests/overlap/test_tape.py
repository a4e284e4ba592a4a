"""The tape: node-by-node forward/backward gives the bits of plain autograd over run_nodes."""

import copy
import dataclasses

import pytest
import torch

from megapipe.overlap.plan import LayerState, Node, NodeKind, Plan, UndeclaredState, run_nodes
from megapipe.overlap.sequential import TapeRunner, record_forward, run_backward
from megapipe.overlap.tape import Tape
from megapipe.overlap.wgrad import WeightGradQueue
from support.overlap_asserts import assert_same_tensors
from support.overlap_toys import toy_stack


def _plain(layers, x, grad_out):
    x = x.clone().requires_grad_(True)
    out = x
    for layer in layers:
        out = run_nodes(layer.node_plan(), (out,))[0]
    out.backward(grad_out)
    return out.detach(), x.grad


def _grads(module):
    return [p.grad.clone() if p.grad is not None else None for p in module.parameters()]


@pytest.mark.parametrize("kinds", ["m", "dmm", "mdm"])
@pytest.mark.parametrize("defer", [False, True])
def test_tape_matches_plain_autograd_bitwise(kinds, defer):
    ref = toy_stack(kinds, hidden=8)
    layers = copy.deepcopy(ref)
    torch.manual_seed(0)
    for _ in range(2):  # two microbatches: gradients accumulate
        x = torch.randn(6, 8)
        g = torch.randn(6, 8)
        out_ref, gx_ref = _plain(ref, x, g)
        x_in = x.clone().requires_grad_(True)
        outs, tape = record_forward([layer.node_plan() for layer in layers], (x_in,))
        assert torch.equal(outs[0], out_ref)
        queue = WeightGradQueue() if defer else None
        (gx,) = run_backward(tape, (g,), wgrad=queue)
        if defer:
            assert len(queue) == 2 * kinds.count("m")  # two grouped matmuls per MoE layer
            queue.run()
        assert x_in.grad is None  # record_forward leaves the caller's tensor alone
        assert torch.equal(gx, gx_ref)
        assert tape.live_tensors() == 0 and tape.live_nodes() == 0
    assert_same_tensors(_grads(layers), _grads(ref))


def test_tape_frees_each_node_as_its_backward_runs():
    layers = toy_stack("mm", hidden=8)
    outs, tape = record_forward(
        [layer.node_plan() for layer in layers], (torch.randn(4, 8, requires_grad=True),)
    )
    assert tape.live_nodes() == 10
    live = [tape.live_tensors()]
    tape.begin_layer_backward((torch.ones(4, 8),))
    layer = tape.layers[-1]
    for index in reversed(range(len(layer.nodes))):
        tape.backward_node(layer, index)
        live.append(tape.live_tensors())
    assert all(a > b for a, b in zip(live, live[1:]))  # strictly decreasing
    assert tape.live_nodes() == 5
    run_backward(tape)
    assert tape.live_tensors() == 0


def _split_node(state, t):
    (x,) = t
    return (x, torch.arange(x.shape[0]), (x * 2).detach(), x * 3)


def _join_node(state, t):
    x, idx, frozen, y = t
    return (x[idx] + frozen + y * y,)  # x reaches the output twice: passed through, then used


def test_passthrough_int_and_no_grad_outputs_and_unused_outputs():
    plan = [
        Node("split", NodeKind.COMPUTE, _split_node),
        Node("join", NodeKind.COMPUTE, _join_node),
    ]
    x = torch.randn(5, 3)
    ref = x.clone().requires_grad_(True)
    run_nodes(plan, (ref,))[0].sum().backward()
    x_in = x.clone().requires_grad_(True)
    outs, tape = record_forward([plan], (x_in,))
    outs[0].sum().backward()  # loss on the returned leaves, then grads read from their .grad
    (gx,) = run_backward(tape)
    assert torch.equal(gx, ref.grad)


def test_int_stage_input_has_no_grad():
    emb = torch.nn.Embedding(10, 4)
    plan = [Node("embed", NodeKind.COMPUTE, lambda s, t: (emb(t[0]),))]
    tokens = torch.tensor([1, 2, 3])
    outs, tape = record_forward([plan], (tokens,))
    (gt,) = run_backward(tape, (torch.ones(3, 4),))
    assert gt is None
    assert torch.equal(emb.weight.grad.sum(0), torch.full((4,), 3.0))


def test_runner_with_glue_between_layers_matches_plain():
    ref = toy_stack("mdm", hidden=8)
    layers = copy.deepcopy(ref)
    x = torch.randn(6, 8)

    def forward(mods, run, x):
        out = x
        for i, layer in enumerate(mods):
            out = run(layer.node_plan(), (out * 1.5 if i == 1 else out,))[0]  # glue before layer 1
        return out

    xr = x.clone().requires_grad_(True)
    forward(ref, lambda p, v: run_nodes(p, v), xr).square().sum().backward()
    runner = TapeRunner()
    xt = x.clone().requires_grad_(True)
    out = forward(layers, runner.run_layer, xt)
    out.square().sum().backward()
    (gx,) = run_backward(runner.tape)
    assert torch.equal(gx, xr.grad)
    assert torch.equal(xt.grad, xr.grad)  # the runner routes input grads on, like autograd
    assert_same_tensors(_grads(layers), _grads(ref))


def test_bad_plans_and_misuse_are_named():
    tape = Tape()
    with pytest.raises(TypeError, match="list of Node"):
        tape.begin_layer([], (torch.ones(1),))
    plan = [Node("bad", NodeKind.COMPUTE, lambda s, t: t[0] * 2)]
    with pytest.raises(TypeError, match="node 'bad' must return a tuple"):
        record_forward([plan], (torch.ones(2),))
    good = [Node("ok", NodeKind.COMPUTE, lambda s, t: (t[0] * 2,))]
    _, tape = record_forward([good], (torch.ones(2, requires_grad=True),))
    with pytest.raises(ValueError, match="1 outputs but got 2 gradients"):
        run_backward(tape, (torch.ones(2), torch.ones(2)))
    run_backward(tape, (torch.ones(2),))
    with pytest.raises(RuntimeError, match="already ran backward"):
        tape.begin_layer_backward((torch.ones(2),))


@dataclasses.dataclass(eq=False, slots=True)
class _RowsState(LayerState):
    rows: int | None = None


def test_state_is_per_layer_and_per_microbatch_and_of_the_plans_state_type():
    seen = []

    def write(state: _RowsState, t):
        state.rows = t[0].shape[0]
        return t

    def read(state: _RowsState, t):
        seen.append(state.rows)
        return (t[0] + 1,)

    plan = Plan([Node("w", NodeKind.COMPUTE, write), Node("r", NodeKind.COMPUTE, read)],
                _RowsState)
    _, tape = record_forward([plan, plan], (torch.ones(3),))
    assert [type(layer.state) for layer in tape.layers] == [_RowsState, _RowsState]
    record_forward([plan], (torch.ones(5),))
    assert seen == [3, 3, 5]
    # a plan declaring LayerState refuses a field of the layer's own; a plain list of nodes
    # (declaring nothing, as before states were declared) gets a state that takes any name
    with pytest.raises(AttributeError, match="rows"):
        record_forward([Plan(list(plan), LayerState)], (torch.ones(3),))
    _, tape = record_forward([list(plan), Plan(list(plan))], (torch.ones(4),))
    assert [type(layer.state) for layer in tape.layers] == [UndeclaredState] * 2
    assert seen[-2:] == [4, 4]


@pytest.mark.parametrize("shared,defer", [(None, False), (12, False), (12, True)])
def test_tape_matches_plain_autograd_on_the_moe_layer(shared, defer):
    from megapipe.moe.layer import MoEConfig, MoELayer

    cfg = MoEConfig(
        hidden_size=8, num_experts=4, top_k=2, ffn_hidden_size=16, aux_loss_coeff=0.01,
        z_loss_coeff=0.001, shared_expert_intermediate_size=shared,
    )
    ref = torch.nn.ModuleList([MoELayer(cfg, layer_index=i, seed=3) for i in range(2)])
    layers = copy.deepcopy(ref)
    torch.manual_seed(1)
    for _ in range(2):
        x = torch.randn(2, 5, 8)
        g = torch.randn(2, 5, 8)
        out_ref, gx_ref = _plain(ref, x, g)
        outs, tape = record_forward(
            [layer.node_plan() for layer in layers], (x.clone().requires_grad_(True),)
        )
        assert torch.equal(outs[0], out_ref)
        queue = WeightGradQueue() if defer else None
        (gx,) = run_backward(tape, (g,), wgrad=queue)
        if defer:
            assert len(queue) == 2 * 3  # gate, up and down of the grouped experts, per layer
            queue.run()
        assert torch.equal(gx, gx_ref)
    assert_same_tensors(_grads(layers), _grads(ref))


def test_gradients_meeting_at_a_residual_used_five_times_sum_in_autograds_order():
    torch.manual_seed(0)
    w1, w2, w3 = (torch.randn(8, 8, requires_grad=True) for _ in range(3))

    def a(state, t):
        (x,) = t
        return (x, torch.sin(x @ w1) + torch.cos(x @ w2))

    def b(state, t):
        x, y = t
        return (x, y * 1.5 + torch.tanh(x @ w3))

    def c(state, t):
        x, y = t
        return (x * 0.3 + y.exp() * x,)

    plan = [
        Node("a", NodeKind.COMPUTE, a),
        Node("b", NodeKind.COMM, b),
        Node("c", NodeKind.COMPUTE, c),
    ]
    for _ in range(10):
        x, g = torch.randn(16, 8), torch.randn(16, 8)
        ref = x.clone().requires_grad_(True)
        run_nodes(plan, (ref,))[0].backward(g)
        (gx,) = run_backward(record_forward([plan], (x.clone().requires_grad_(True),))[1], (g,))
        assert torch.equal(gx, ref.grad)


def _forked_plan(w: torch.Tensor) -> list:
    """head -> (x, a, b); two branches (comm: roll, compute: tanh @ w); join: x + a' * b'."""
    head = Node("head", NodeKind.COMPUTE, lambda s, t: (t[0], t[0] @ w, torch.sin(t[0])))

    def branch(c):
        return (Node(f"roll{c}", NodeKind.COMM, lambda s, t: (torch.roll(t[0], 1, 0),)),
                Node(f"mix{c}", NodeKind.COMPUTE, lambda s, t: (torch.tanh(t[0] @ w),)))

    from megapipe.overlap.plan import Fork

    join = Node("join", NodeKind.COMPUTE, lambda s, t: (t[0] + t[1] * t[2],))
    return [head, Fork((branch(0), branch(1))), join]


def test_a_forked_layer_on_the_tape_gives_the_bits_of_plain_autograd():
    gen = torch.Generator().manual_seed(2)
    w_ref = torch.randn(8, 8, generator=gen).requires_grad_()
    w = w_ref.detach().clone().requires_grad_()
    x, g = torch.randn(5, 8, generator=gen), torch.randn(5, 8, generator=gen)
    x_ref = x.clone().requires_grad_()
    out_ref = run_nodes(_forked_plan(w_ref), (x_ref,))[0]
    out_ref.backward(g)
    x_in = x.clone().requires_grad_()
    outs, tape = record_forward([_forked_plan(w)], (x_in,))
    layer = tape.layers[0]
    assert [r.sources for r in layer.nodes][-1][0] == (0, slice(None, -2))  # x goes around
    (gx,) = run_backward(tape, (g,))
    assert torch.equal(outs[0], out_ref) and torch.equal(gx, x_ref.grad)
    assert torch.equal(w.grad, w_ref.grad)
    assert tape.live_tensors() == 0


def test_a_node_whose_output_gradients_are_incomplete_cannot_run_backward():
    w = torch.randn(8, 8, requires_grad=True)
    _, tape = record_forward([_forked_plan(w)], (torch.randn(5, 8, requires_grad=True),))
    layer = tape.begin_layer_backward((torch.ones(5, 8),))
    tape.backward_node(layer, 5)  # the join
    tape.backward_node(layer, 2)  # branch 0 (roll, mix): its last node
    tape.backward_node(layer, 1)
    with pytest.raises(
        RuntimeError, match="'head': the gradients of its outputs are not all known"
    ):
        tape.backward_node(layer, 0)  # branch 1 has not run backward yet


def test_a_node_that_hands_its_inputs_on_hands_the_gradients_on_without_autograd(monkeypatch):
    """A comm node with nothing to exchange (expert parallelism 1) returns its input leaves: its
    backward gives its outputs' gradients as its inputs' (the same tensors, no copy into the
    leaf's ``.grad``) and calls autograd's engine once less; the bits are plain autograd's."""
    import megapipe.overlap.tape as tape_module

    w = torch.nn.Parameter(torch.randn(8, 8))
    plan = Plan([Node("split", NodeKind.COMPUTE, lambda state, t: (t[0] @ w, t[0] + 1.0)),
                 Node("exchange", NodeKind.COMM, lambda state, t: t),
                 Node("join", NodeKind.COMPUTE, lambda state, t: (t[0] @ w, t[1] * 2.0))])
    x, g0, g1 = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)

    leaf = x.clone().requires_grad_(True)
    torch.autograd.backward(list(run_nodes(plan, (leaf,))), [g0, g1])
    want_x, want_w = leaf.grad, w.grad.clone()
    w.grad = None

    calls, given = [], {}
    engine, deliver = tape_module._run_backward, tape_module._deliver
    monkeypatch.setattr(tape_module, "_run_backward", lambda *a: calls.append(1) or engine(*a))

    def delivered(record, part, grads):  # the gradients each node's readers give it
        given[record.node.name] = list(grads)
        deliver(record, part, grads)

    monkeypatch.setattr(tape_module, "_deliver", delivered)
    _, tape = record_forward([plan], (x.clone().requires_grad_(True),))
    (gx,) = run_backward(tape, (g0, g1))
    assert torch.equal(gx, want_x) and torch.equal(w.grad, want_w)
    assert len(calls) == 2  # split and join; the exchange needed none
    # what the exchange gave "split" is what "join" gave the exchange: the same tensors
    assert all(s is e for s, e in zip(given["split"], given["exchange"], strict=True))
