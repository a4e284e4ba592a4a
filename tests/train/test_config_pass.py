"""The pretrain config is checked and built in one pass (``train.config.build``): on real
``megapipe pretrain`` flags the tokenizer is read once, the model config made once and the
schedule built once, with CUDA graphs and with indexed data read by a Hugging Face tokenizer
(whose checks read the tokenizer and build the model and schedule too)."""

from __future__ import annotations

import json

import pytest

import megapipe.data.tokenizer as tokenizer_module
import megapipe.schedule as schedule_module
from megapipe.models.config import GPTConfig
from megapipe.train.config.parse import parse_pretrain_args


def _builds(monkeypatch, argv: list[str]) -> dict[str, int]:
    """How often ``parse_pretrain_args(argv)`` reads a tokenizer, makes a model config and
    builds a schedule."""
    counts = {"tokenizer": 0, "model": 0, "schedule": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(tokenizer_module, "build_tokenizer",
                        counted("tokenizer", tokenizer_module.build_tokenizer))
    monkeypatch.setattr(schedule_module, "build_schedule",
                        counted("schedule", schedule_module.build_schedule))
    monkeypatch.setattr(GPTConfig, "__post_init__", counted("model", GPTConfig.__post_init__))
    parse_pretrain_args(argv, env={})
    return counts


GRAPHS = ["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn", "moe_router",
          "moe_preprocess"]


@pytest.mark.parametrize("argv", [[], GRAPHS], ids=["default", "cuda-graphs"])
def test_each_part_is_built_once(monkeypatch, argv):
    assert _builds(monkeypatch, argv) == {"tokenizer": 1, "model": 1, "schedule": 1}


def test_indexed_data_reads_its_tokenizer_once(monkeypatch, tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    pytest.importorskip("tokenizers", reason="tokenizers is not installed (the data extra)")
    from megapipe.cli import main as megapipe

    (tmp_path / "a.jsonl").write_text("".join(
        json.dumps({"text": f"word{i} " * 40}) + "\n" for i in range(200)))
    tok = tmp_path / "tok"
    assert megapipe(["train-tokenizer", "--input", str(tmp_path / "a.jsonl"), "--vocab-size",
                     "300", "--output", str(tok)]) == 0
    assert megapipe(["preprocess-data", "--input", str(tmp_path / "a.jsonl"),
                     "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tok),
                     "--output-prefix", str(tmp_path / "a"), "--append-eod"]) == 0
    argv = ["--data-path", str(tmp_path / "a_text_document"), "--tokenizer-type",
            "HuggingFaceTokenizer", "--tokenizer-model", str(tok), "--seq-length", "32",
            "--train-iters", "5", "--eval-interval", "0", "--split", "98,2,0"]
    assert _builds(monkeypatch, argv) == {"tokenizer": 1, "model": 1, "schedule": 1}
