"""Typed layer state: each layer kind declares its state, and the engine makes the plan's."""

import dataclasses

import pytest
import torch

from megapipe.megatron.mcore_layers import McoreLayerState
from megapipe.models import GPTConfig, build_stage
from megapipe.moe.layer import MoEState
from megapipe.overlap.combined import combined_step
from megapipe.overlap.device_streams import make_streams
from megapipe.overlap.plan import (
    LayerState,
    Node,
    NodeKind,
    UndeclaredState,
    WarnOnce,
    WavePlan,
    node_plan_of,
)
from megapipe.overlap.sequential import record_forward, run_backward
from megapipe.recompute.layer_groups import GroupState


@pytest.mark.parametrize("state_type", [LayerState, MoEState, McoreLayerState, GroupState])
def test_a_state_takes_its_declared_fields_only(state_type):
    state = state_type()
    for field in dataclasses.fields(state_type):  # every field has its default
        setattr(state, field.name, getattr(state, field.name))
    with pytest.raises(AttributeError, match="routing_indices"):
        state.routing_indices = torch.zeros(2)
    assert not hasattr(state, "__dict__")


@pytest.mark.parametrize("waves", [1, 2])
def test_the_tape_holds_each_layer_in_its_plans_state_type(waves):
    """Embedding, a dense layer, two MoE layers (one group of two under uniform recompute),
    head: each layer record's state is of its plan's type, in its wave form too."""
    for config in (GPTConfig(num_layers=3, first_k_dense_layers=1),
                   GPTConfig(num_layers=3, first_k_dense_layers=1, recompute_method="uniform",
                             recompute_num_layers=2)):
        model = build_stage(config, 0, 1)
        plans = [node_plan_of(p, WarnOnce(), waves) for p in model.layer_plans()]
        ids = torch.randint(0, config.vocab_size, (1, 8),
                            generator=torch.Generator().manual_seed(0))
        _, tape = record_forward(plans, (ids,))
        kinds = [type(layer.state) for layer in tape.layers]
        assert kinds == [plan.state_type for plan in plans]
        grouped = config.recompute_method == "uniform"
        assert kinds == ([LayerState, GroupState, MoEState, LayerState] if grouped else
                         [LayerState, LayerState, MoEState, MoEState, LayerState])
        assert all(isinstance(p, WavePlan) for p, k in zip(plans, kinds) if k is MoEState)


class _OldProtocolMoE(torch.nn.Module):
    """A layer as the previous release's docs had it: ``node_plan()`` a plain list of nodes
    whose dispatch keeps its own metadata on the state (``state.shape``, ``state.order``) for
    the combine to read."""

    def __init__(self, hidden: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(hidden, hidden, generator=g) * 0.3)
        self.v = torch.nn.Parameter(torch.randn(hidden, hidden, generator=g) * 0.3)

    def node_plan(self) -> list:
        return [Node("attention", NodeKind.COMPUTE, self._attention),
                Node("dispatch", NodeKind.COMM, self._dispatch),
                Node("experts", NodeKind.COMPUTE, self._experts),
                Node("combine", NodeKind.COMM, self._combine)]

    def _attention(self, state, t):
        return (torch.tanh(t[0] @ self.w),)

    def _dispatch(self, state, t):
        state.shape = t[0].shape
        state.order = torch.argsort(t[0][:, 0])  # non-differentiable routing metadata
        return (t[0][state.order].reshape(-1),)

    def _experts(self, state, t):
        return (torch.relu(t[0].reshape(state.shape) @ self.v),)

    def _combine(self, state, t):
        return (t[0][torch.argsort(state.order)],)


def test_a_model_written_for_the_previous_protocol_runs_unchanged_plain_and_combined():
    """Nodes that write their own names on the state: the plain path (the tape, F then B) and
    the combined step (F of one microbatch beside B of another on two streams) both run, with
    bitwise the same outputs and gradients."""
    gen = torch.Generator().manual_seed(0)
    x_f, x_b, g_f, g_b = (torch.randn(6, 8, generator=gen) for _ in range(4))
    runs = []
    for combined in (False, True):
        stack = [_OldProtocolMoE(8, seed) for seed in (1, 2)]
        plans = [layer.node_plan() for layer in stack]
        _, tape_b = record_forward(plans, (x_b.clone().requires_grad_(),))
        if combined:
            with make_streams("cpu") as streams:
                out_f, tape_f, grads_b = combined_step(plans, (x_f.clone().requires_grad_(),),
                                                       tape_b, (g_b,), streams)
        else:
            out_f, tape_f = record_forward(plans, (x_f.clone().requires_grad_(),))
            grads_b = run_backward(tape_b, (g_b,))
        assert {type(layer.state) for layer in tape_f.layers} == {UndeclaredState}
        grads_f = run_backward(tape_f, (g_f,))
        runs.append([*out_f, *grads_b, *grads_f, *(p.grad for m in stack for p in m.parameters())])
    assert len(runs[0]) == 7 and all(a is not None and torch.equal(a, b) for a, b in zip(*runs))
