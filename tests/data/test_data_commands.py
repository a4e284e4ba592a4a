"""``megapipe train-tokenizer`` and ``megapipe preprocess-data``: the newcomer's commands run on
tiny local files, and bad input ends with one line and exit status 2."""

import json

import pytest

from megapipe.cli import main

pytest.importorskip("tokenizers", reason="pip install -e '.[data]'")

TEXTS = ["The quick brown fox jumps over the lazy dog. " * 4, "Grüße, héllo wörld! " * 3]


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cmd")
    (root / "corpus").mkdir()
    for i, text in enumerate(TEXTS):
        (root / "corpus" / f"{i}.txt").write_text(text)
    assert main(["train-tokenizer", "--input", str(root / "corpus"), "--vocab-size", "300",
                 "--output", str(root / "tok")]) == 0
    return root / "tok"


def test_train_tokenizer_writes_a_tokenizer(tokdir, capsys):
    assert (tokdir / "tokenizer.json").is_file() and (tokdir / "tokenizer_config.json").is_file()
    out = tokdir.parent / "again"
    assert main(["train-tokenizer", "--input", str(tokdir.parent / "corpus"), "--vocab-size",
                 "300", "--output", str(out)]) == 0
    assert capsys.readouterr().out == (
        f"wrote {out / 'tokenizer.json'}: 300 tokens, <|endoftext|> = 0; trained on 2 texts "
        "from 2 file(s)\n")
    assert (out / "tokenizer.json").read_bytes() == (tokdir / "tokenizer.json").read_bytes()


def test_preprocess_data_the_newcomers_command(tokdir, tmp_path, capsys):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from megapipe.data.mcore_datasets import mcore_datasets
    from megapipe.data.tokenizer import HuggingFaceTokenizer

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 40))
    assert main(["preprocess-data", "--input", str(docs), "--json-keys", "text",
                 "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokdir),
                 "--output-prefix", str(tmp_path / "OUT" / "name"), "--append-eod",
                 "--workers", "2"]) == 0
    prefix = tmp_path / "OUT" / "name_text_document"
    out = capsys.readouterr().out
    assert f"wrote {prefix}.bin and {prefix}.idx" in out
    assert "80 documents" in out and "tokenized in 2 worker processes" in out
    dataset = mcore_datasets("test").IndexedDataset(str(prefix))
    tok = HuggingFaceTokenizer(tokdir)
    assert len(dataset) == 80
    assert dataset[41].tolist() == tok.encode(TEXTS[1]) + [tok.eod]


@pytest.mark.parametrize("argv,message", [
    (["train-tokenizer", "--input", "{d}/missing", "--output", "{d}/t"],
     "--input {d}/missing does not exist"),
    (["train-tokenizer", "--input", "{d}/docs.jsonl", "--vocab-size", "100", "--output", "{d}/t"],
     "--vocab-size=100 must be >= 257"),
    (["train-tokenizer", "--input", "{d}/bad.jsonl", "--output", "{d}/t"],
     "{d}/bad.jsonl line 1 is not JSON"),
    (["train-tokenizer", "--input", "{d}/docs.jsonl", "--output", "{d}/docs.jsonl"],
     "--output {d}/docs.jsonl is a file; name a directory"),
    (["preprocess-data", "--input", "{d}/docs.jsonl", "--tokenizer-type", "HuggingFaceTokenizer",
      "--tokenizer-model", "{d}/nope", "--output-prefix", "{d}/o"],
     "--tokenizer-model {d}/nope does not exist"),
    (["preprocess-data", "--input", "{d}/docs.jsonl", "--tokenizer-type", "HuggingFaceTokenizer",
      "--output-prefix", "{d}/o"], "needs --tokenizer-model PATH"),
    (["preprocess-data", "--input", "{d}/docs.jsonl", "--tokenizer-type", "GPT2BPETokenizer",
      "--output-prefix", "{d}/o"], "invalid choice: 'GPT2BPETokenizer'"),
    (["preprocess-data", "--input", "{d}/docs.jsonl", "--tokenizer-type", "ByteTokenizer",
      "--output-prefix", "{d}/o", "--workers", "0"], "--workers=0 must be >= 1"),
    (["preprocess-data", "--input", "{d}/gone.jsonl", "--tokenizer-type", "ByteTokenizer",
      "--output-prefix", "{d}/o"], "--input {d}/gone.jsonl does not exist"),
    (["preprocess-data", "--input", "{d}/docs.jsonl", "--tokenizer-type", "ByteTokenizer",
      "--tokenizer-model", "{d}", "--output-prefix", "{d}/o"], "ByteTokenizer takes no"),
    (["preprocess-data", "--input", "{d}/docs.jsonl", "--tokenizer-type", "ByteTokenizer"],
     "required: --output-prefix"),
])
def test_bad_input_is_one_line(tmp_path, capsys, argv, message):
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    assert main([a.format(d=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megapipe: error: ") and err.count("\n") == 1
    assert message.format(d=tmp_path) in err


def test_preprocess_data_rejects_bad_lines_with_exit_2(tmp_path, capsys):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    assert main(["preprocess-data", "--input", str(tmp_path / "bad.jsonl"), "--tokenizer-type",
                 "ByteTokenizer", "--output-prefix", str(tmp_path / "o")]) == 2
    assert "bad.jsonl line 2 has no 'text' field" in capsys.readouterr().err
    assert not (tmp_path / "o_text_document.bin").exists()
