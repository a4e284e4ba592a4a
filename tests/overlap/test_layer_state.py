"""Typed layer state: each layer kind declares its state, and the engine makes the plan's."""

import dataclasses

import pytest
import torch

from megapipe.megatron.mcore_layers import McoreLayerState
from megapipe.models import GPTConfig, build_stage
from megapipe.moe.layer import MoEState
from megapipe.overlap.layer_groups import GroupState
from megapipe.overlap.plan import LayerState, WarnOnce, WavePlan, node_plan_of
from megapipe.overlap.sequential import record_forward


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
