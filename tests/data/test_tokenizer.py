"""Tokenizers: the byte level one, a trained byte-level BPE read back, Megatron's padding, the
checks that refuse a bad tokenizer in one line, and bits per byte on a hand-computed case."""

import json

import pytest
import torch

from megapipe.data.bits_per_byte import bits_per_byte, target_bytes, token_byte_counts
from megapipe.data.errors import DataError
from megapipe.data.tokenizer import (
    ByteTokenizer,
    HuggingFaceTokenizer,
    build_tokenizer,
    byte_level_alphabet,
    check_vocab,
    padded_vocab_size,
)
from megapipe.data.train_tokenizer import train_tokenizer

tokenizers = pytest.importorskip("tokenizers", reason="pip install -e '.[data]'")

TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Grüße aus Köln: héllo wörld, naïve café. " * 2,
    "def add(a, b):\n    return a + b\n" * 4,
]


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    train_tokenizer([root / "docs.jsonl"], 300, root / "tok")
    return root / "tok"


@pytest.mark.parametrize("vocab,divisible,tp,padded", [
    (50257, 128, 1, 50304),  # GPT-2's vocabulary as Megatron pads it
    (300, 128, 1, 384), (300, 128, 2, 512), (256, 128, 1, 256), (257, 128, 1, 384),
    (2048, 128, 8, 2048), (2049, 128, 8, 3072), (300, 1, 1, 300), (300, 64, 4, 512),
])
def test_padded_vocab_is_megatrons(vocab, divisible, tp, padded):
    """Megatron: ceil(vocab / (divisible x tp)) x (divisible x tp)."""
    assert padded_vocab_size(vocab, divisible, tp) == padded


@pytest.mark.parametrize("args", [(0,), (300, 0), (300, 128, -1), (300, 1.5)])
def test_padded_vocab_refuses_non_positive(args):
    with pytest.raises(DataError, match="must be a positive integer"):
        padded_vocab_size(*args)


def test_byte_tokenizer():
    tok = ByteTokenizer()
    ids = tok.encode("héllo")
    assert ids == [104, 195, 169, 108, 108, 111]
    assert tok.decode_bytes(ids).decode() == "héllo"
    assert (tok.vocab_size, tok.eod, tok.byte_level) == (256, 0, True)


def test_byte_level_alphabet_is_gpt2s():
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert set(alphabet) == set(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    assert alphabet["A"] == 65 and alphabet["Ġ"] == 32 and alphabet["Ċ"] == 10
    assert alphabet["Ã"] == 0xC3 and alphabet["©"] == 0xA9


def test_trained_tokenizer_reads_back(tokdir):
    tok = build_tokenizer("HuggingFaceTokenizer", tokdir)
    assert tok.vocab_size == 300 and tok.eod == 0 and tok.byte_level
    assert json.loads((tokdir / "tokenizer_config.json").read_text())["eos_token"] == \
        "<|endoftext|>"
    for text in TEXTS + ["unseen: ∑ ü 🙂 \x00 end"]:
        ids = tok.encode(text)
        assert tok.decode_bytes(ids) == text.encode()
        assert all(0 <= i < 300 for i in ids)
    assert len(tok.encode(TEXTS[0])) < len(TEXTS[0])  # merges were learnt
    # the file itself is accepted as well as its directory
    assert HuggingFaceTokenizer(tokdir / "tokenizer.json").encode("fox") == tok.encode("fox")
    # a token may hold part of a UTF-8 character: its bytes are the raw bytes
    emoji = tok.encode("🙂")
    assert b"".join(tok.decode_bytes([i]) for i in emoji) == "🙂".encode()


def test_end_of_document_from_the_config(tokdir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((tokdir / "tokenizer.json").read_bytes())
    assert HuggingFaceTokenizer(tmp_path).eod == 0  # no config: the <|endoftext|> added token
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "Ġ"}))
    assert HuggingFaceTokenizer(tmp_path).eod == HuggingFaceTokenizer(tmp_path).encode(" ")[0]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    with pytest.raises(DataError, match="names eos_token '</s>', which the tokenizer"):
        HuggingFaceTokenizer(tmp_path)


def test_training_is_deterministic_and_walks_directories(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text(TEXTS[0])
    (corpus / "sub" / "b.py").write_text(TEXTS[2])
    (corpus / "c.jsonl").write_text(json.dumps({"text": TEXTS[1], "meta": "ignored"}) + "\n\n")
    (corpus / "blob.bin").write_bytes(bytes(range(256)))  # not UTF-8: skipped
    (corpus / ".hidden").write_text("zzzzzzzzzzzzzzzzzzzzzzzzzzzzzz")  # hidden: skipped
    first = train_tokenizer([corpus], 320, tmp_path / "t1")
    second = train_tokenizer([corpus], 320, tmp_path / "t2")
    assert (first.files, first.skipped, first.texts) == (4, 1, 3)  # .hidden not listed
    assert first.path.read_bytes() == second.path.read_bytes()
    vocab = json.loads(first.path.read_text())["model"]["vocab"]
    assert not any("zz" in token for token in vocab) and not any("meta" in t for t in vocab)
    assert any(t == "Ġfox" for t in vocab)  # learnt from a.txt; "ignored" was never read
    other = train_tokenizer([corpus / "a.txt"], 320, tmp_path / "t3")
    assert other.path.read_bytes() != first.path.read_bytes()


@pytest.mark.parametrize("make,args,message", [
    (lambda p: None, ("HuggingFaceTokenizer", "{p}/missing"), "missing does not exist"),
    (lambda p: p.joinpath("empty").mkdir(), ("HuggingFaceTokenizer", "{p}/empty"),
     "is a directory without tokenizer.json"),
    (lambda p: p.joinpath("bad.json").write_text("{}"), ("HuggingFaceTokenizer", "{p}/bad.json"),
     "is not a Hugging Face tokenizer.json"),
    (lambda p: None, ("HuggingFaceTokenizer", None), "needs --tokenizer-model PATH"),
    (lambda p: None, ("ByteTokenizer", "{p}"), "takes no --tokenizer-model"),
    (lambda p: None, ("GPT2BPETokenizer", None), "GPT2BPETokenizer is not supported"),
])
def test_bad_tokenizers_are_one_line(tmp_path, make, args, message):
    make(tmp_path)
    kind, model = args
    with pytest.raises(DataError, match=message) as err:
        build_tokenizer(kind, None if model is None else model.format(p=tmp_path))
    assert "\n" not in str(err.value)


def test_check_vocab(tokdir):
    tok = HuggingFaceTokenizer(tokdir)
    check_vocab(tok, 300)
    check_vocab(tok, padded_vocab_size(300))
    with pytest.raises(DataError, match="the tokenizer has 300 tokens, more than the model's "
                                        "vocabulary of 256"):
        check_vocab(tok, 256)
    check_vocab(ByteTokenizer(), 256)


def _hand_made_bpe(tmp_path):
    """A byte-level BPE with known tokens: the 256 byte characters, then "Ã©" (é, 2 bytes) and
    "Ġw" (" w", 2 bytes), and <|endoftext|> as id 258."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(byte_level_alphabet(), key=byte_level_alphabet().get)
    vocab = {c: i for i, c in enumerate(alphabet)} | {"Ã©": 256, "Ġw": 257}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("Ã", "©"), ("Ġ", "w")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    return HuggingFaceTokenizer(tmp_path)


def test_bits_per_byte_by_hand(tmp_path):
    tok = _hand_made_bpe(tmp_path)
    assert tok.encode("é w") == [256, 257] and tok.eod == 258
    counts = token_byte_counts(tok, padded_vocab_size(tok.vocab_size))
    assert counts.shape == (384,)
    assert counts[256] == 2 and counts[257] == 2 and counts[ord("h")] == 1
    assert counts[258] == 0 and counts[259:].sum() == 0  # end of document, padding
    labels = torch.tensor([[256, 257], [ord("h"), 258]])
    # targets é, " w", h, <|endoftext|>: 2 + 2 + 1 + 0 = 5 bytes; per-token losses
    # 0.5, 1.0, 2.0, 0.7 nats: 4.2 nats / ln 2 = 6.0593 bits over 5 bytes = 1.21186 bits/byte
    assert int(target_bytes(labels, counts)) == 5
    assert bits_per_byte(0.5 + 1.0 + 2.0 + 0.7, 5) == pytest.approx(1.2118638, abs=1e-7)
    with pytest.raises(DataError, match="no text"):
        bits_per_byte(1.0, 0)


def test_bits_per_byte_of_the_byte_tokenizer():
    counts = token_byte_counts(ByteTokenizer())
    assert counts[0] == 0 and bool((counts[1:] == 1).all())  # end of document: no text byte
    labels = torch.tensor([[104, 195, 169, 0]])
    assert int(target_bytes(labels, counts)) == 3
    assert bits_per_byte(3.0, 3) == pytest.approx(1 / 0.6931471805599453)


def test_bits_per_byte_refuses_a_tokenizer_without_fixed_bytes(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"▁a": 0, "▁b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(DataError, match="needs a byte-level tokenizer"):
        token_byte_counts(HuggingFaceTokenizer(tmp_path))


def test_encodes_as_megatrons_hugging_face_tokenizer(tokdir):
    """Megatron's ``_HuggingFaceTokenizer`` is ``transformers.AutoTokenizer`` on the path:
    vocabulary ``len(tokenizer)``, end of document ``eos_token_id``, ids
    ``tokenizer(text).input_ids``. The trained directory loads there and agrees id for id."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    theirs = transformers.AutoTokenizer.from_pretrained(str(tokdir))
    ours = HuggingFaceTokenizer(tokdir)
    assert len(theirs) == ours.vocab_size and theirs.eos_token_id == ours.eod
    for text in TEXTS + ["unseen: ∑ ü 🙂 end<|endoftext|>next", ""]:
        assert theirs(text).input_ids == ours.encode(text)
