"""``--load-hf`` from checkpoints as people publish them: tiny Qwen3-MoE (both router forms),
Mixtral and OLMoE models made and saved by the installed transformers (one sharded into several
files). megapipe's loss on a batch equals transformers' (fp32, relative 1e-5), in one process
and in a pipeline/expert layout with the combined step (4 gloo ranks, each reading only its
stages' tensors); ``export-hf`` of the loaded model gives back the same tensors and config; the
model flags not given are config.json's; bad input is one line before any process starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors", reason="safetensors is not installed (the hf extra)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                   "(the hf extra)")

from megapipe.hf.architectures import gpt_config_from_hf  # noqa: E402
from megapipe.hf.load_hf import load_hf  # noqa: E402
from megapipe.models.gpt import gpt_loss  # noqa: E402
from megapipe.models.split import build_stage, copy_into_stage  # noqa: E402
from megapipe.train import main as pretrain  # noqa: E402
from megapipe.train.checkpoint.export_hf import export_hf  # noqa: E402
from megapipe.train.config.parse import parse_pretrain_args  # noqa: E402
from support.hf_published import (  # noqa: E402
    CASES,
    LAYOUT,
    MICROBATCHES,
    batch,
    layout_run,
    save_published,
    transformers_loss,
    transformers_model,
)

NAMES = list(CASES)
# what the export writes beside the keys transformers wrote: for older releases' readers, and
# the head dim, which transformers leaves out when it is hidden / heads
LEGACY = {"rope_theta", "num_experts", "head_dim"}
NOT_THE_MODEL = {"transformers_version", "bos_token_id", "pad_token_id", "eos_token_id"}


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("published")
    for name in NAMES:
        save_published(name, root / name)
    return {name: root / name for name in NAMES}


@pytest.fixture(scope="module")
def theirs(published) -> dict[str, torch.nn.Module]:
    return {name: transformers_model(directory) for name, directory in published.items()}


@pytest.fixture(scope="module")
def layout(published, rank_pools, tmp_path_factory):
    root = tmp_path_factory.mktemp("started")
    results = rank_pools(4).run(layout_run, {k: str(v) for k, v in published.items()},
                                str(root))
    return root, [r for r in results if r is not None]


def _relative(ours: float, theirs: float) -> float:
    return abs(ours - theirs) / abs(theirs)


@pytest.mark.parametrize("name", NAMES)
def test_first_loss_equals_transformers(published, theirs, name):
    config, state = load_hf(published[name])
    model = build_stage(config, 0, 1)
    copy_into_stage(model, state)
    tokens, labels = batch(0, 0)
    with torch.no_grad():
        ours = gpt_loss(model(tokens), labels).item()
    expected = transformers_loss(theirs[name], tokens, labels)
    assert _relative(ours, expected) <= 1e-5, (name, ours, expected)
    assert config.moe_router_pre_softmax == (name in ("qwen3_moe", "olmoe"))
    assert config.qk_layernorm_scope == ("all" if name == "olmoe" else "head")
    assert config.qk_layernorm == (name != "mixtral")


def test_the_sharded_checkpoint_is_several_files(published):
    index = json.loads((published["qwen3_moe_renormalised"]
                        / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2


def test_a_pipeline_expert_layout_starts_with_transformers_losses(theirs, layout):
    _, results = layout
    last = [r for r in results if r["pp_rank"] == LAYOUT.pp - 1]
    assert len(last) == LAYOUT.dp
    for name in NAMES:
        for result in last:
            losses = result["cases"][name]["losses"]
            assert sorted(losses) == list(range(MICROBATCHES))
            for i, ours in losses.items():
                expected = transformers_loss(theirs[name], *batch(result["dp_rank"], i))
                assert _relative(ours, expected) <= 1e-5, (name, result["dp_rank"], i)
        for result in results:  # each rank read its stages' tensors, no other
            case = result["cases"][name]
            assert case["read"] == case["held"], name


@pytest.mark.parametrize("name", NAMES)
def test_export_hf_of_the_loaded_model_gives_back_the_same_tensors(published, layout, name,
                                                                   tmp_path):
    from safetensors.torch import load_file

    root, _ = layout
    export_hf(root / name, tmp_path / name)
    source, out = published[name], tmp_path / name

    def tensors(directory: Path) -> dict[str, torch.Tensor]:
        found: dict[str, torch.Tensor] = {}
        for file in sorted(directory.glob("*.safetensors")):
            found.update(load_file(file))
        return found

    theirs, ours = tensors(source), tensors(out)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs), name
    written = json.loads((source / "config.json").read_text())
    exported = json.loads((out / "config.json").read_text())
    assert gpt_config_from_hf(exported) == gpt_config_from_hf(written)
    assert set(written) - NOT_THE_MODEL <= set(exported), set(written) - set(exported)
    assert set(exported) - set(written) <= LEGACY | NOT_THE_MODEL, set(exported) - set(written)
    for key in set(written) & set(exported) - NOT_THE_MODEL:
        assert exported[key] == written[key], (key, exported[key], written[key])


def test_model_flags_not_given_are_config_json_s(published):
    directory = published["olmoe"]
    config = parse_pretrain_args(["--load-hf", str(directory), "--seq-length", "16"], env={})
    expected = gpt_config_from_hf(json.loads((directory / "config.json").read_text()))
    assert config.model.seed == 1234  # the run's own
    import dataclasses

    mine = dataclasses.replace(config.model, seed=expected.seed, moe_aux_loss_coeff=0.01)
    assert mine == dataclasses.replace(expected, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)


@pytest.mark.parametrize("name,edit,flags,words", [
    ("mixtral", dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"]), [],
     ['model_type="deepseek_v3": --load-hf reads qwen3_moe (Qwen3MoeForCausalLM), mixtral']),
    ("mixtral", dict(sliding_window=4096), [],
     ["config.json sliding_window=4096: megapipe's attention has no sliding window"]),
    ("olmoe", dict(clip_qkv=8.0), [], ["config.json clip_qkv=8.0 has no equivalent"]),
    ("qwen3_moe", dict(layer_types=["full_attention"] * 3), [],
     ["layer_types=", "megapipe does not mirror this qwen3_moe key"]),
    ("qwen3_moe_renormalised", {}, ["--moe-router-pre-softmax"],
     ["its config.json has --moe-router-pre-softmax=False but this run has "
      "--moe-router-pre-softmax=True"]),
    ("mixtral", {}, ["--num-layers", "3"],
     ["its config.json has --num-layers=2 but this run has --num-layers=3"]),
], ids=["unknown-architecture", "sliding-window", "clip-qkv", "unknown-key", "router-flag",
        "layers-flag"])
def test_bad_input_is_one_line_before_any_process(published, tmp_path, monkeypatch, capsys,
                                                  name, edit, flags, words):
    directory = tmp_path / name
    directory.mkdir()
    for file in published[name].iterdir():
        (directory / file.name).symlink_to(file)
    if edit:
        (directory / "config.json").unlink()
        fields = json.loads((published[name] / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps(dict(fields, **edit)))
    started = []
    monkeypatch.setattr(pretrain, "run_local", lambda *a: started.append(a) or 0)
    code = pretrain.main(["--load-hf", str(directory), "--seq-length", "16", *flags])
    err = capsys.readouterr().err
    assert code == 2 and not started and err.count("\n") == 1, err
    for word in words:
        assert word in err, (word, err)


def test_the_flags_spell_the_models_choices():
    """``train.config.flags.model`` spells the QK norm scopes and position embeddings without
    importing torch; they must be the model's."""
    from megapipe.models.config import POSITION_EMBEDDING_TYPES, QK_LAYERNORM_SCOPES
    from megapipe.train.config.flags import model

    assert model.QK_LAYERNORM_SCOPES == QK_LAYERNORM_SCOPES
    assert set(model.POSITION_EMBEDDING_TYPES) == set(POSITION_EMBEDDING_TYPES)
