"""The newcomer's path, end to end (issue 31's commands): ``train-tokenizer`` on local files,
``preprocess-data`` of two jsonl corpora, ``pretrain`` on both blended with the Hugging Face
tokenizer and the modern model (rope, grouped-query attention with 2 query groups, QK norm,
untied) at pp 2 vpp 2 ep 2 with the overlap and ``--save``, the same run continued under
another layout (pp 1, dp 4), then ``export-hf`` of both checkpoints: transformers loads each
export, and its fp32 logits equal megapipe's forward of the checkpoint within 1e-5 relative.
The validation line's bits per byte are checked against the targets' bytes counted here.

The commands run in this process (``megapipe.cli.main``), the training in the shared 4-rank
pool; a tiny model on a tiny corpus, so the whole walk costs seconds.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytest.importorskip("tokenizers", reason="tokenizers is not installed (the data extra)")
pytest.importorskip("safetensors", reason="safetensors is not installed (the hf extra)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

import megapipe.train.main as pretrain  # noqa: E402
from megapipe.cli import main as megapipe  # noqa: E402
from megapipe.data.bits_per_byte import target_bytes, token_byte_counts  # noqa: E402
from megapipe.data.gpt_samples import (  # noqa: E402
    build_gpt_datasets,
    indexed_validation_batches,
    megatron_sample_counts,
)
from megapipe.data.tokenizer import HuggingFaceTokenizer  # noqa: E402
from megapipe.models.split import build_stage, copy_into_stage  # noqa: E402
from megapipe.moe.experts import GroupedExperts  # noqa: E402
from megapipe.train.checkpoint.reader import config_of, find_checkpoint, read_model_state  # noqa: E402
from megapipe.train.config.parse import parse_pretrain_args  # noqa: E402
from megapipe.train.job import build_job  # noqa: E402
from megapipe.train.loop import train  # noqa: E402

MODEL = ["--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "4",
         "--ffn-hidden-size", "64", "--moe-ffn-hidden-size", "32", "--seq-length", "32",
         "--moe-layer-freq", "[0,1,1]", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-interval", "3",
         "--eval-iters", "1"]
MODERN = ["--position-embedding-type", "rope", "--group-query-attention", "--num-query-groups",
          "2", "--qk-layernorm", "--untie-embeddings-and-output-weights"]
ONE_STAGE = ["--pipeline-model-parallel-size", "1", "--virtual-pipeline-model-parallel-size",
             "1", "--nproc", "4"]


def _paragraphs(module: str, count: int) -> list[str]:
    """Text present on every machine: paragraphs of a standard-library module."""
    source = (Path(os.__file__).parent / f"{module}.py").read_text()
    found = [p.strip() for p in re.split(r"\n\s*\n", source) if len(p.strip()) > 80]
    assert len(found) >= count, (module, len(found))
    return found[:count]


def _train(argv):
    return train(parse_pretrain_args(argv, env={}), write=lambda line: None)


@pytest.fixture(scope="module")
def walk(rank_pools, tmp_path_factory):
    """The commands of the README's tour, in order; returns their folders and results."""
    root = tmp_path_factory.mktemp("newcomer")
    for name, module in (("a", "os"), ("b", "textwrap")):
        lines = [json.dumps({"text": text}) + "\n" for text in _paragraphs(module, 50)]
        (root / f"{name}.jsonl").write_text("".join(lines))
    tok = root / "TOKDIR"
    assert megapipe(["train-tokenizer", "--input", str(root / "a.jsonl"), str(root / "b.jsonl"),
                     "--vocab-size", "300", "--output", str(tok)]) == 0
    for name in ("a", "b"):
        assert megapipe(["preprocess-data", "--input", str(root / f"{name}.jsonl"),
                         "--json-keys", "text", "--tokenizer-type", "HuggingFaceTokenizer",
                         "--tokenizer-model", str(tok), "--output-prefix",
                         str(root / "OUT" / name), "--append-eod", "--workers", "1"]) == 0
    prefixes = [str(root / "OUT" / f"{name}_text_document") for name in ("a", "b")]
    data = ["--data-path", "0.7", prefixes[0], "0.3", prefixes[1], "--split", "98,2,0",
            "--data-cache-path", str(root / "cache"), "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", str(tok)]
    ckpt = root / "CKPT"
    argv = MODEL + data + MODERN + ["--save", str(ckpt)]
    first = rank_pools(4).run(_train, argv + ["--train-iters", "3"])
    # the same run continued under another layout: pp 1, dp 4 (ep 2), written at iteration 5
    second = rank_pools(4).run(_train, argv + ONE_STAGE + ["--load", str(ckpt),
                                                          "--train-iters", "5"])
    return root, tok, prefixes, argv, first[0], second[0]


def _logits(checkpoint: Path, ids: torch.Tensor) -> torch.Tensor:
    """megapipe's forward of the checkpoint: its stored config, its tensors, one process."""
    config = config_of(find_checkpoint(checkpoint))
    model = build_stage(config, 0, 1)
    copy_into_stage(model, read_model_state(checkpoint))
    with torch.no_grad():
        return model(ids)


def test_the_run_trains_the_modern_model_on_both_datasets(walk):
    _, tok, _, _, first, second = walk
    lines = "\n".join(first.lines)
    assert "schedule interleaved-1f1b with overlap" in lines
    assert "2 query groups, rope, QK norm" in lines and "untied embeddings" in lines, lines
    assert f"tokenizer: HuggingFaceTokenizer {tok}, 300 tokens; model vocabulary 384" in lines
    assert "data: 2 indexed dataset(s) (0.7 " in lines and "split 98,2,0" in lines
    assert second.first_iteration == 3 and len(second.losses) == 2
    assert all(math.isfinite(x) for x in first.losses + second.losses)


def test_bits_per_byte_are_the_targets_bytes(walk):
    """The validation line's bits per byte = the mean loss x target tokens / ln 2 / the bytes
    of text the target tokens stand for, counted here from Megatron's validation samples."""
    root, tok, prefixes, _, first, _ = walk
    assert re.search(r"validation at iter 3 \| loss [\d.]+ per token \| ppl [\d.]+ \| "
                     r"[\d.]+ bits per byte", "\n".join(first.lines)), first.lines
    tokenizer = HuggingFaceTokenizer(tok)
    counts = megatron_sample_counts(3, 8, 3, 1)
    datasets = build_gpt_datasets(["0.7", prefixes[0], "0.3", prefixes[1]], "98,2,0", 32, 1234,
                                  counts, tokenizer, root / "cache")
    [batch] = indexed_validation_batches(datasets.valid, 1, 8, 8, 1, 0)
    labels = torch.cat([labels for _, labels in batch])
    text_bytes = int(target_bytes(labels, token_byte_counts(tokenizer, 384)))
    assert 0 < text_bytes and labels.numel() == 8 * 32
    expected = first.valid_losses[3] * labels.numel() / math.log(2) / text_bytes
    assert first.valid_bits_per_byte[3] == pytest.approx(expected, rel=1e-12)


def test_exports_of_both_layouts_load_in_transformers_with_equal_logits(walk, tmp_path):
    root, tok, *_ = walk
    ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(5))
    for iteration in (3, 5):  # pp 2 vpp 2 ep 2 dp 2, then pp 1 ep 2 dp 4
        checkpoint = root / "CKPT" / f"iter_{iteration:07d}"
        out = tmp_path / f"HFDIR{iteration}"
        assert megapipe(["export-hf", "--load", str(checkpoint), "--out", str(out)]) == 0
        model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        assert type(model).__name__ == "Qwen3MoeForCausalLM"
        assert model.config.num_key_value_heads == 2 and model.config.vocab_size == 384
        with torch.no_grad():
            theirs = model.eval()(ids).logits
        ours = _logits(checkpoint, ids)
        assert ((theirs - ours).abs().max() / ours.abs().max()).item() <= 1e-5
        tokenizer = transformers.AutoTokenizer.from_pretrained(out)
        text = "def join(a, *p):"
        assert tokenizer(text)["input_ids"] == HuggingFaceTokenizer(tok).encode(text)


def test_a_tokenizer_larger_than_the_checkpoints_vocabulary_is_refused(walk, tmp_path, capsys):
    from tokenizers import Tokenizer, models

    root, _, _, argv, _, _ = walk
    big = Tokenizer(models.BPE())
    big.add_tokens([f"t{i}" for i in range(400)])
    big.save(str(tmp_path / "big.json"))
    flags = argv + ONE_STAGE + ["--load", str(root / "CKPT"), "--tokenizer-model",
                                str(tmp_path / "big.json"), "--train-iters", "6"]
    assert pretrain.main(flags) == 2  # refused before any process starts
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the tokenizer has 400 tokens, more than the checkpoint's " \
        "model vocabulary of 384" in err, err


def _start_from_hf(argv: list[str], hf: str, checkpoint: str) -> dict:
    """One rank: a run of ``argv`` started from ``hf`` (one step), then its job built again
    from ``hf``: each parameter of this rank's stages against the checkpoint the export came
    from (a grouped-experts weight: this rank's experts)."""
    config = parse_pretrain_args(argv + ["--load-hf", hf], env={})
    result = train(config, write=lambda line: None)
    source = read_model_state(checkpoint)
    job = build_job(config, start_from=hf)
    try:
        differ, compared = [], 0
        for stage in job.stages.values():
            first = {id(p): m.first_expert for m in stage.modules()
                     if isinstance(m, GroupedExperts) for p in m.parameters(recurse=False)}
            for name, param in stage.named_parameters():
                want = source[name]
                if id(param) in first:
                    want = want[first[id(param)]:first[id(param)] + param.shape[0]]
                compared += 1
                if not torch.equal(param.detach(), want):
                    differ.append(name)
    finally:
        job.close()
    return {"result": result, "differ": differ, "compared": compared}


def test_a_run_starts_from_the_export_under_another_layout(rank_pools, walk, tmp_path):
    """``pretrain --load-hf``: the export of the pp 1 dp 4 checkpoint starts a pp 2 vpp 2 ep 2
    run, whose stages hold exactly the checkpoint's weights, and which trains from there. The
    command gives no model flag (the README's): config.json states the model."""
    root, _, _, argv, _, _ = walk
    hf, checkpoint = tmp_path / "HFDIR", root / "CKPT" / "iter_0000005"
    assert megapipe(["export-hf", "--load", str(checkpoint), "--out", str(hf)]) == 0
    data = argv[len(MODEL):-len(MODERN) - 2]  # argv: MODEL, data, MODERN, --save CKPT
    batches = ["--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
               "--eval-interval", "0"]
    new = ["--save", str(tmp_path / "NEW"), "--train-iters", "1"]
    ranks = rank_pools(4).run(_start_from_hf, data + batches + new, str(hf), str(checkpoint))
    for rank in ranks:
        assert rank["compared"] > 0 and rank["differ"] == [], rank["differ"]
    result = ranks[0]["result"]
    assert result.first_iteration == 0 and len(result.losses) == 1
    assert math.isfinite(result.losses[0])
    assert f"starting from the weights of --load-hf {hf}" in result.lines
