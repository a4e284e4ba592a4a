"""``megapipe export-hf``: checkpoints of two layouts (4 gloo ranks) written as Qwen3-MoE; the
files are the same, transformers loads them, and its logits equal megapipe's forward of the
checkpoint. What Qwen3-MoE cannot express is refused in one line (exit status 2)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors", reason="safetensors is not installed (the hf extra)")
pytest.importorskip("tokenizers", reason="tokenizers is not installed (the hf extra)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                   "(the hf extra)")

from megapipe.cli import main  # noqa: E402
from megapipe.hf.architectures import gpt_config_from_hf  # noqa: E402
from megapipe.hf.export_config import export_architecture  # noqa: E402
from megapipe.hf.load_hf import load_hf  # noqa: E402
from megapipe.models.config import GPTConfig  # noqa: E402
from megapipe.models.split import build_stage, copy_into_stage  # noqa: E402
from megapipe.train.checkpoint.export_hf import export_hf  # noqa: E402
from megapipe.train.checkpoint.files import DESCRIPTOR_FILE  # noqa: E402
from megapipe.train.checkpoint.reader import config_of, find_checkpoint, read_model_state  # noqa: E402
from support.hf_cases import LAYOUTS, MODERN, TIED, reference_model, write_checkpoints  # noqa: E402


@pytest.fixture(scope="module")
def saved(rank_pools, tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    verdicts = rank_pools(4).run(write_checkpoints, str(root))
    return root, verdicts


@pytest.fixture(scope="module")
def exported(saved, tmp_path_factory):
    root, _ = saved
    out = tmp_path_factory.mktemp("exports")
    lines = {name: export_hf(root / name, out / name) for name, *_ in LAYOUTS}
    return out, lines


def _ids(config: GPTConfig) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, config.vocab_size, (2, config.seq_length), generator=g)


def _megapipe_logits(checkpoint_dir: Path) -> torch.Tensor:
    """megapipe's forward of the checkpoint: its config, its tensors, one process."""
    checkpoint = find_checkpoint(checkpoint_dir)
    config = config_of(checkpoint)
    model = build_stage(config, 0, 1)
    copy_into_stage(model, read_model_state(checkpoint.path))
    with torch.no_grad():
        return model(_ids(config))


def _hf_logits(directory: Path, config: GPTConfig) -> torch.Tensor:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    missing = {k: v for k, v in info.items() if v and k != "error_msgs"}
    assert not missing and not info.get("error_msgs"), info  # nothing initialised at random
    with torch.no_grad():
        return model.eval()(_ids(config)).logits


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_checkpoint_reader_rebuilds_the_model_from_every_layout(saved):
    root, verdicts = saved
    assert all(v["split_stages_from_whole_checkpoint"] for v in verdicts), verdicts
    for name, config, *_, dtype in LAYOUTS:
        reference = reference_model(config)
        expected = {k: t.to(dtype) for k, t in reference.state_dict().items()}
        state = read_model_state(find_checkpoint(root / name).path)
        assert state.keys() == expected.keys(), name
        for key, tensor in expected.items():
            assert torch.equal(state[key], tensor), (name, key)
        with torch.no_grad():  # the forward runs in float32 from the checkpoint's weights
            for param in reference.parameters():
                param.copy_(param.to(dtype))
            assert torch.equal(_megapipe_logits(root / name), reference(_ids(config)))


def test_two_layouts_export_the_same_files(exported):
    out, lines = exported
    whole, split = out / "whole", out / "split"
    names = sorted(p.name for p in whole.iterdir())
    assert names == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert names == sorted(p.name for p in split.iterdir())
    for name in names:
        assert (whole / name).read_bytes() == (split / name).read_bytes(), name
    assert "Qwen3MoeForCausalLM" in lines["whole"][1]


@pytest.mark.parametrize("layout", ["whole", "split", "tied", "bf16"])
def test_transformers_logits_equal_megapipes_forward_of_the_checkpoint(saved, exported, layout):
    """fp32 logits (a bf16 checkpoint's weights upcast on both sides)."""
    root, _ = saved
    out, _ = exported
    config = TIED if layout == "tied" else MODERN
    hf = _hf_logits(out / layout, config)
    ours = _megapipe_logits(root / layout)
    assert hf.shape == ours.shape == (2, config.seq_length, config.vocab_size)
    assert _relative(hf, ours) <= 1e-5, _relative(hf, ours)


def test_config_json_maps_the_fields(exported):
    out, _ = exported
    untied = json.loads((out / "split" / "config.json").read_text())
    tied = json.loads((out / "tied" / "config.json").read_text())
    assert untied["num_key_value_heads"] == 2 and untied["head_dim"] == 12
    assert untied["mlp_only_layers"] == [0] and untied["norm_topk_prob"] is False
    assert untied["tie_word_embeddings"] is False and tied["tie_word_embeddings"] is True
    assert untied["dtype"] == "float32"
    assert json.loads((out / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    from safetensors import safe_open

    with safe_open(out / "tied" / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
        assert "model.layers.1.mlp.experts.3.down_proj.weight" in f.keys()


def test_byte_level_tokenizer_gives_the_byte_ids(exported):
    out, _ = exported
    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "whole")
    text = "héllo\x00 wörld ✓\n\ttabs  end"
    assert tokenizer(text)["input_ids"] == list(text.encode("utf-8"))
    assert tokenizer.decode(list(text.encode("utf-8"))) == text
    assert tokenizer.eos_token_id == 0


def test_hugging_face_tokenizer_is_copied(saved, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=270, show_progress=False,
                                  special_tokens=["<|endoftext|>"])
    tokenizer.train_from_iterator(["the cat sat on the mat"] * 20 + ["a dog ran"] * 20, trainer)
    (tmp_path / "tok").mkdir()
    tokenizer.save(str(tmp_path / "tok" / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
    root, _ = saved
    export_hf(root / "whole", tmp_path / "out", tokenizer_model=str(tmp_path / "tok"))
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert loaded("the cat ran")["input_ids"] == tokenizer.encode("the cat ran").ids
    eos = tokenizer.token_to_id("<|endoftext|>")
    assert loaded.eos_token_id == eos
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"] == eos
    big = Tokenizer(models.BPE())
    big.add_tokens([f"t{i}" for i in range(400)])
    big.save(str(tmp_path / "big.json"))
    with pytest.raises(ValueError, match="has 400 tokens, more than the model's vocab_size=300"):
        export_hf(root / "whole", tmp_path / "out2", tokenizer_model=str(tmp_path / "big.json"))
    assert not (tmp_path / "out2").exists()  # refused before anything is written


def test_shards_hold_the_same_tensors(saved, exported, tmp_path):
    from safetensors.torch import load_file

    root, _ = saved
    out, _ = exported
    export_hf(root / "split", tmp_path / "sharded", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    sharded = {}
    for name in files:
        sharded.update(load_file(tmp_path / "sharded" / name))
    single = load_file(out / "split" / "model.safetensors")
    assert sharded.keys() == single.keys() == index["weight_map"].keys()
    assert all(torch.equal(sharded[k], single[k]) for k in single)
    assert _relative(_hf_logits(tmp_path / "sharded", MODERN),
                     _megapipe_logits(root / "split")) <= 1e-5


def test_load_hf_gives_back_the_config_and_the_weights(exported):
    out, _ = exported
    for layout, config in (("split", MODERN), ("tied", TIED)):
        loaded, state = load_hf(out / layout)
        assert loaded == config, layout
        reference = reference_model(config).state_dict()
        assert state.keys() == reference.keys()
        assert all(torch.equal(state[k], reference[k]) for k in reference)
    parts = [build_stage(MODERN, p, 2) for p in range(2)]
    for part in parts:  # any split takes it (copy_into_stage)
        copy_into_stage(part, load_hf(out / "split")[1])
    ids = _ids(MODERN)
    assert torch.equal(parts[1](parts[0](ids)), reference_model(MODERN)(ids))


@pytest.mark.parametrize("edit,message", [
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), 'rope_type="yarn"'),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling={"),
    (dict(hidden_act="gelu"), 'hidden_act="gelu"'),
    (dict(model_type="deepseek_v3"), 'model_type="deepseek_v3": --load-hf reads qwen3_moe'),
    (dict(architectures=["Qwen3MoeModel"]), 'architectures=["Qwen3MoeModel"]'),
    (dict(num_hidden_layers=5, mlp_only_layers=[0, 3]), "MoE layers [1, 2, 4] are not"),
    (dict(attention_bias=True), "attention_bias=true has no equivalent"),
    (dict(num_experts=8), "num_local_experts=4 and num_experts=8 disagree"),
    (dict(q_lora_rank=8), "q_lora_rank=8: megapipe does not mirror this qwen3_moe key"),
])
def test_load_hf_refuses_what_megapipe_does_not_mirror(exported, edit, message):
    out, _ = exported
    hf = json.loads((out / "split" / "config.json").read_text())
    assert gpt_config_from_hf(hf) == MODERN
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        gpt_config_from_hf(dict(hf, **edit))


@pytest.mark.parametrize("fields,field", [
    (dict(position_embedding_type="learned_absolute"),
     "Qwen3MoeForCausalLM: position_embedding_type='learned_absolute'"),
    (dict(qk_layernorm=False), "MixtralForCausalLM: qk_layernorm=False"),  # a dense layer
    (dict(qk_layernorm=False, first_k_dense_layers=0), "MixtralForCausalLM: "
     "moe_router_pre_softmax=True"),
    (dict(qk_layernorm_scope="all"), "OlmoeForCausalLM: first_k_dense_layers=1"),
    (dict(qk_layernorm_scope="all", first_k_dense_layers=0), "OlmoeForCausalLM: kv_channels=12"),
    (dict(moe_score_function="sigmoid"), "Qwen3MoeForCausalLM: moe_score_function='sigmoid'"),
    (dict(moe_shared_expert_intermediate_size=16),
     "Qwen3MoeForCausalLM: moe_shared_expert_intermediate_size=16"),
    (dict(moe_capacity_factor=1.5), "Qwen3MoeForCausalLM: moe_capacity_factor=1.5"),
])
def test_what_a_family_cannot_express_is_refused_in_one_line(fields, field):
    config = dataclasses.replace(MODERN, **fields)
    with pytest.raises(ValueError, match=f"cannot export to {field} has no equivalent") as caught:
        export_architecture(config)
    assert "\n" not in str(caught.value)


def _copy_with(root: Path, tmp_path: Path, edit) -> Path:
    """A copy of the "whole" checkpoint with its descriptor's model part edited."""
    source = find_checkpoint(root / "whole").path
    target = tmp_path / "ckpt" / source.name
    shutil.copytree(source, target)
    descriptor = json.loads((target / DESCRIPTOR_FILE).read_text())
    edit(descriptor["model"])
    (target / DESCRIPTOR_FILE).write_text(json.dumps(descriptor))
    return target


@pytest.mark.parametrize("edit,message", [
    (lambda m: m["gpt_config"].update(position_embedding_type="learned_absolute"),
     "position_embedding_type='learned_absolute' has no equivalent"),
    (lambda m: m.pop("gpt_config"), "its descriptor has no model.gpt_config"),
    (lambda m: m.pop("tokenizer"), "the checkpoint names no tokenizer"),
    (lambda m: m["gpt_config"].update(num_layers=4), "lacks model/layers.3.attention_norm.weight"),
], ids=["learned_positions", "no_config", "no_tokenizer", "other_shape"])
def test_cli_refuses_in_one_line_with_status_2(saved, tmp_path, capsys, edit, message):
    root, _ = saved
    checkpoint = _copy_with(root, tmp_path, edit)
    code = main(["export-hf", "--load", str(checkpoint), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_cli_writes_the_export_and_refuses_a_full_out_dir(saved, tmp_path, capsys):
    root, _ = saved
    assert main(["export-hf", "--load", str(root / "split"), "--out", str(tmp_path / "o")]) == 0
    assert "Qwen3MoeForCausalLM" in capsys.readouterr().out
    assert main(["export-hf", "--load", str(root / "split"), "--out", str(tmp_path / "o")]) == 2
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert main(["export-hf", "--load", str(tmp_path / "none"), "--out", str(tmp_path / "p")]) == 2
    assert "no such directory" in capsys.readouterr().err
