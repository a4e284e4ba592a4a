"""``preprocess-data``: Megatron's ``IndexedDataset`` reads megapipe's files token for token, the
files are byte for byte what Megatron's builder writes when fed as Megatron's
``tools/preprocess_data.py`` feeds it, ``--workers 2`` tokenizes in a real process pool, and bad
input is one line with nothing left behind."""

import json
import os
import sys
from pathlib import Path

import numpy
import pytest

from megapipe.data.errors import DataError
from megapipe.data.preprocess import preprocess
from megapipe.data.tokenizer import HuggingFaceTokenizer
from megapipe.data.train_tokenizer import train_tokenizer

pytest.importorskip("tokenizers", reason="pip install -e '.[data]'")
pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from megapipe.data.mcore_datasets import mcore_datasets  # noqa: E402

DOCS = [
    {"text": "The quick brown fox jumps over the lazy dog.", "title": "fox"},
    {"text": "", "title": "an empty document"},
    {"text": ["First sentence.", "", "Second one, with ü and 🙂."], "title": "sentences"},
    {"text": "def f(x):\n    return x * 2\n", "title": "code"},
] + [{"text": f"Document number {i}: " + "lorem ipsum " * (i % 5), "title": f"t{i}"}
     for i in range(40)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("pre")
    docs = root / "docs.jsonl"
    docs.write_text("".join(json.dumps(d) + "\n" for d in DOCS) + "\n")  # a blank last line
    train_tokenizer([docs], 300, root / "tok")
    return root


def _megatron_style(path, tokenizer, keys, append_eod, prefix):
    """What Megatron's tools/preprocess_data.py hands its IndexedDatasetBuilder, restated
    here: per key, each non-empty sentence's ids, the end of document after a non-empty
    document, one add_document per line."""
    mcore = mcore_datasets("test")
    dtype = mcore.DType.optimal_dtype(tokenizer.vocab_size)
    builders = {k: mcore.IndexedDatasetBuilder(f"{prefix}_{k}_document.bin", dtype=dtype)
                for k in keys}
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        for key in keys:
            texts = record[key] if isinstance(record[key], list) else [record[key]]
            ids, lengths = [], []
            for text in texts:
                sentence = tokenizer.encode(text)
                if sentence:
                    ids.extend(sentence)
                    lengths.append(len(sentence))
            if ids and append_eod:
                ids.append(tokenizer.eod)
                lengths[-1] += 1
            builders[key].add_document(ids, lengths)
    for key in keys:
        builders[key].finalize(f"{prefix}_{key}_document.idx")


def test_megatron_reads_megapipes_files_token_for_token(corpus):
    tok = HuggingFaceTokenizer(corpus / "tok")
    result = preprocess(corpus / "docs.jsonl", ["text"], "HuggingFaceTokenizer",
                        str(corpus / "tok"), str(corpus / "out" / "one"), append_eod=True)
    assert result.prefixes == [str(corpus / "out" / "one_text_document")]
    assert result.worker_pids == {os.getpid()} and result.documents == len(DOCS)
    dataset = mcore_datasets("test").IndexedDataset(result.prefixes[0])
    assert dataset.index.dtype == numpy.uint16
    assert len(dataset.document_indices) == len(DOCS) + 1
    sequences = 0
    for d, doc in enumerate(DOCS):
        texts = doc["text"] if isinstance(doc["text"], list) else [doc["text"]]
        expected = [tok.encode(t) for t in texts if t]
        if expected:
            expected[-1] = expected[-1] + [tok.eod]
        begin, end = dataset.document_indices[d], dataset.document_indices[d + 1]
        assert end - begin == len(expected), d  # the empty document holds no sequence
        for s, ids in enumerate(expected):
            assert dataset[int(begin) + s].tolist() == ids
        sequences += len(expected)
    assert len(dataset) == sequences
    assert result.tokens == int(dataset.sequence_lengths.sum())


def test_files_equal_megatrons_builder_fed_as_megatrons_tool(corpus):
    tok = HuggingFaceTokenizer(corpus / "tok")
    for keys, eod in ((["text"], True), (["text", "title"], False)):
        ours = str(corpus / "cmp" / f"ours{len(keys)}")
        theirs = str(corpus / "cmp" / f"theirs{len(keys)}")
        preprocess(corpus / "docs.jsonl", keys, "HuggingFaceTokenizer", str(corpus / "tok"),
                   ours, append_eod=eod)
        _megatron_style(corpus / "docs.jsonl", tok, keys, eod, theirs)
        for key in keys:
            for suffix in (".bin", ".idx"):
                a = Path(f"{ours}_{key}_document{suffix}").read_bytes()
                b = Path(f"{theirs}_{key}_document{suffix}").read_bytes()
                assert a == b, (key, suffix)


def test_two_workers_tokenize_in_a_process_pool(corpus):
    one = preprocess(corpus / "docs.jsonl", ["text"], "HuggingFaceTokenizer",
                     str(corpus / "tok"), str(corpus / "w1" / "d"), append_eod=True)
    two = preprocess(corpus / "docs.jsonl", ["text"], "HuggingFaceTokenizer",
                     str(corpus / "tok"), str(corpus / "w2" / "d"), append_eod=True, workers=2)
    assert os.getpid() not in two.worker_pids and len(two.worker_pids) >= 1
    for suffix in (".bin", ".idx"):
        assert (Path(one.prefixes[0] + suffix).read_bytes()
                == Path(two.prefixes[0] + suffix).read_bytes())


def test_byte_tokenizer_datasets(corpus):
    result = preprocess(corpus / "docs.jsonl", ["title"], "ByteTokenizer", None,
                        str(corpus / "bytes" / "b"), append_eod=True)
    dataset = mcore_datasets("test").IndexedDataset(result.prefixes[0])
    assert dataset[0].tolist() == list(b"fox") + [0]
    assert dataset[1].tolist() == list(b"an empty document") + [0]


@pytest.mark.parametrize("line,message", [
    ("not json", r"bad.jsonl line 2 is not JSON"),
    ('{"title": "no text"}', r"bad.jsonl line 2 has no 'text' field \(--json-keys\)"),
    ('{"text": 3}', r"line 2: field 'text' holds int, not text"),
])
def test_bad_lines_are_one_line_and_leave_no_files(tmp_path, corpus, line, message):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(DataError, match=message):
        preprocess(tmp_path / "bad.jsonl", ["text"], "HuggingFaceTokenizer",
                   str(corpus / "tok"), str(tmp_path / "out" / "x"))
    assert list((tmp_path / "out").iterdir()) == []


def test_without_megatron_core_it_says_so(tmp_path, corpus, monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.core.datasets.indexed_dataset", None)
    with pytest.raises(DataError, match="preprocess-data needs megatron-core's data pipeline, "
                                        "which is not installed"):
        preprocess(corpus / "docs.jsonl", ["text"], "ByteTokenizer", None,
                   str(tmp_path / "x"))
    assert not (tmp_path / "x_text_document.bin").exists()
