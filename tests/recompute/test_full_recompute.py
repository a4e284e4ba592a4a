"""Full recompute node by node (``recompute.full``): a compute node keeps its inputs
only and runs again inside its own backward, comm nodes never run again, the results are
bitwise those without recompute (on the tape, with all-to-alls in waves, in bf16 with deferred
expert weight gradients), and the re-run is marked on the layer state so once-per-forward side
effects happen once."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megapipe.models.config import GPTConfig
from megapipe.models.gpt import gpt_loss
from megapipe.models.split import build_stage
from megapipe.moe.layer import MoEState
from megapipe.overlap.plan import (
    Fork,
    LayerState,
    Node,
    NodeKind,
    WarnOnce,
    node_plan_of,
    run_nodes,
)
from megapipe.overlap.sequential import record_forward, run_backward
from megapipe.overlap.wgrad import WeightGradQueue
from megapipe.precision.main_grad import accumulated_grad
from megapipe.recompute.full import recompute_plan
from megapipe.recompute.layer_groups import GroupState
from megapipe.train.optim.mixed_precision import cast_to_bf16


def _toy(weight: torch.Tensor, calls: list[tuple[str, bool]]) -> list[Node]:
    def first(state: LayerState, inputs: tuple) -> tuple:
        calls.append(("first", state.recomputing))
        (x,) = inputs
        return (x, torch.tanh(x @ weight))

    def comm(state: LayerState, inputs: tuple) -> tuple:
        calls.append(("comm", state.recomputing))
        x, y = inputs
        return (x, torch.roll(y, 1, dims=0))

    def last(state: LayerState, inputs: tuple) -> tuple:
        calls.append(("last", state.recomputing))
        x, y = inputs
        return (x + torch.sigmoid(y) * y,)

    return [Node("first", NodeKind.COMPUTE, first), Node("comm", NodeKind.COMM, comm),
            Node("last", NodeKind.COMPUTE, last)]


def _toy_step(recompute: bool):
    weight = torch.randn(4, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    calls: list[tuple[str, bool]] = []
    plan = _toy(weight, calls)
    if recompute:
        plan = recompute_plan(plan, [weight])
    (out,), tape = record_forward([plan, plan], (x.requires_grad_(),))
    grads = run_backward(tape, (torch.ones_like(out),))
    return out, grads[0], weight.grad, calls


def test_compute_nodes_rerun_in_their_backward_comm_nodes_never():
    out, grad_x, grad_w, calls = _toy_step(recompute=False)
    out_r, grad_x_r, grad_w_r, calls_r = _toy_step(recompute=True)
    assert torch.equal(out, out_r) and torch.equal(grad_x, grad_x_r)
    assert torch.equal(grad_w, grad_w_r)
    forward = [("first", False), ("comm", False), ("last", False)] * 2
    assert calls == forward
    # backward walks the layers and nodes last first: each compute node runs again, marked
    assert calls_r == forward + [("last", True), ("first", True)] * 2


def _gpt_step(config: GPTConfig, waves: int):
    model = build_stage(config, 0, 1)
    ids = torch.randint(0, config.vocab_size, (2, config.seq_length),
                        generator=torch.Generator().manual_seed(3))
    plans = [node_plan_of(p, WarnOnce(), waves) for p in model.layer_plans()]
    (logits,), tape = record_forward(plans, (ids,))
    run_backward(tape, (torch.ones_like(logits),))
    return logits, [p.grad for p in model.parameters()], plans


@pytest.mark.parametrize("method, layers", [("uniform", 1), ("uniform", 2), ("block", 2)])
def test_gpt_on_the_tape_with_chunked_all_to_alls_is_bitwise(method, layers):
    config = GPTConfig()
    logits, grads, _ = _gpt_step(config, waves=2)
    recomputed = dataclasses.replace(config, recompute_method=method, recompute_num_layers=layers)
    logits_r, grads_r, plans_r = _gpt_step(recomputed, waves=2)
    assert torch.equal(logits, logits_r)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_r))
    # the wave form of a recomputed MoE layer wraps its fork's expert nodes too
    grouped = method == "uniform" and layers == 2  # layers 0 (dense) and 1 (MoE): one plan
    moe = plans_r[1] if grouped else plans_r[2]  # after the embedding's plan
    fork = next(item for item in moe if isinstance(item, Fork))
    dispatch, experts, combine = fork.branches[0]
    assert _wrapped(experts) and _wrapped(moe[0]) and _wrapped(moe[-1])
    assert not _wrapped(dispatch) and not _wrapped(combine)  # all-to-alls: never run again


def _wrapped(node: Node) -> bool:
    return node.fn.__qualname__.startswith("recompute_node.")


@pytest.mark.parametrize("fields, message", [
    ({"recompute_method": "selective"},
     "recompute method 'selective' is not one of uniform, block"),
    ({"recompute_method": "block", "recompute_num_layers": 0},
     "recompute num_layers=0 must be an int >= 1"),
    ({"recompute_method": "uniform", "recompute_modules": ("core_attn",)},
     "cannot go with recompute_method='uniform'"),
])
def test_bad_full_recompute_settings_are_named(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GPTConfig(**fields)


def test_a_group_of_layers_is_one_plan_joining_compute_nodes_across_layers():
    config = GPTConfig(num_layers=4, first_k_dense_layers=2, recompute_method="uniform",
                       recompute_num_layers=2)
    model = build_stage(config, 0, 1)
    plans = model.layer_plans()
    names = [[n.name for n in plan.graph.nodes] for plan in plans]
    assert names[1] == ["layer0+layer1"]  # two dense layers: one node, keeping the group input
    assert names[2] == [
        "layer2.attention", "layer2.dispatch", "layer2.experts", "layer2.combine",
        "layer2.finish+layer3.attention", "layer3.dispatch", "layer3.experts",
        "layer3.combine", "layer3.finish",
    ]
    # each layer of a group keeps its own routing metadata on a state of its own, of its kind
    assert plans[2].state_type is GroupState
    state = GroupState()
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    hidden = model.embedding(ids)
    run_nodes(plans[2], (hidden,), state)
    parts = state.parts
    assert set(parts) == {0, 1} and all(type(p) is MoEState for p in parts.values())
    assert parts[0].row_choice is not parts[1].row_choice
    state.wgrad_queue = "queue"
    assert parts[1].wgrad_queue == "queue" and not parts[0].recomputing


def _bf16_step(config: GPTConfig, wgrad: WeightGradQueue | None):
    model = build_stage(config, 0, 1)
    cast_to_bf16([model], list(model.parameters()))
    ids = torch.randint(0, config.vocab_size, (2, config.seq_length),
                        generator=torch.Generator().manual_seed(4))
    (logits,), tape = record_forward(model.layer_plans(), (ids,))
    loss = gpt_loss(logits, ids)
    (grad,) = torch.autograd.grad(loss, logits)
    run_backward(tape, (grad,), wgrad=wgrad)
    if wgrad is not None:
        wgrad.run()
    return loss, [accumulated_grad(p).clone() for p in model.parameters()]


@pytest.mark.parametrize("defer", [False, True], ids=["wgrad-now", "wgrad-deferred"])
def test_bf16_main_grads_are_bitwise_with_deferred_expert_weight_gradients(defer):
    config = GPTConfig()
    loss, grads = _bf16_step(config, WeightGradQueue() if defer else None)
    recomputed = dataclasses.replace(config, recompute_method="uniform", recompute_num_layers=2)
    loss_r, grads_r = _bf16_step(recomputed, WeightGradQueue() if defer else None)
    assert torch.equal(loss, loss_r)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_r))  # fp32 main_grad
