"""examples/megatron_core_gpt.py builds what docs/megatron-core.md says: 8 layers, a dense first
layer, then MoE layers with shared experts."""

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "megatron_core_gpt.py"


def test_the_example_model_has_a_dense_first_layer_then_moe_layers():
    spec = importlib.util.spec_from_file_location("megatron_core_gpt", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    from megatron.core.transformer.moe.moe_layer import MoELayer

    config = example.make_config(torch.device("cpu"))
    parts = [example.part_spec(config, part, 4) for part in range(4)]
    kinds = [
        "moe" if layer.submodules.mlp.module is MoELayer else "dense"
        for part in parts for layer in part.layer_specs
    ]
    assert kinds == ["dense"] + ["moe"] * 7
    assert config.moe_shared_expert_intermediate_size
