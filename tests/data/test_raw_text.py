import pytest
import torch

from megapipe.data.raw_text import (
    END_OF_DOCUMENT,
    TrainBatches,
    default_corpus_files,
    load_tokens,
    resolve_data_files,
    split_corpus,
    validation_batches,
)
from megapipe.data.tokenizer import ByteTokenizer


def _splits(tmp_path, size=5000, seq=7):
    (tmp_path / "a.txt").write_bytes(bytes((i * 7 + 3) % 251 + 1 for i in range(size)))
    return split_corpus(load_tokens(resolve_data_files([str(tmp_path)])), seq, 0.1)


def test_raw_text_ids_are_the_byte_tokenizers(tmp_path):
    (tmp_path / "a.txt").write_text("héllo\n", encoding="utf-8")
    tok = ByteTokenizer()
    assert load_tokens([tmp_path / "a.txt"]).tolist() == tok.encode("héllo\n") + [tok.eod]


def test_default_corpus_is_sorted_standard_library_text():
    files = default_corpus_files()
    assert [f.name for f in files] == sorted(f.name for f in files)
    assert any(f.name == "os.py" for f in files)


def test_directory_files_sorted_and_documents_separated(tmp_path):
    (tmp_path / "b.txt").write_text("bb")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("a")
    (tmp_path / ".hidden").write_text("zz")
    files = resolve_data_files([str(tmp_path)])
    assert [f.name for f in files] == ["b.txt", "a.txt"]
    assert load_tokens(files).tolist() == [98, 98, END_OF_DOCUMENT, 97, END_OF_DOCUMENT]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_data_files([str(tmp_path / "missing")])


def test_split_is_deterministic_and_disjoint(tmp_path):
    splits = _splits(tmp_path)
    assert splits.num_train + splits.num_valid == 5001 // 8
    assert splits.num_valid == int(625 * 0.1)
    valid = validation_batches(splits, 2, 8, 2, 2, 0)
    assert len(valid) == 2 and len(valid[0]) == 2
    again = validation_batches(_splits(tmp_path), 2, 8, 2, 2, 0)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(valid[0], again[0]))


def _all_samples(batches):
    return {tuple(row.tolist()) for mb in batches for row in mb[0]}


def test_dp_shards_partition_the_global_batch_and_labels_shift(tmp_path):
    splits = _splits(tmp_path)
    shards = [TrainBatches(splits, 8, 2, dp=2, dp_rank=r, seed=5) for r in range(2)]
    single = TrainBatches(splits, 8, 2, dp=1, dp_rank=0, seed=5)
    for _ in range(3):
        per_rank = [s.next_batch() for s in shards]
        whole = single.next_batch()
        assert len(per_rank[0]) == 2 and len(whole) == 4
        assert _all_samples(per_rank[0]) | _all_samples(per_rank[1]) == _all_samples(whole)
        assert not _all_samples(per_rank[0]) & _all_samples(per_rank[1])
        tokens, labels = per_rank[0][0]
        assert tokens.shape == labels.shape == (2, 7) and tokens.dtype == torch.int64
        assert torch.equal(tokens[:, 1:], labels[:, :-1])


def test_position_restores_and_epochs_wrap(tmp_path):
    splits = _splits(tmp_path)
    a = TrainBatches(splits, 16, 4, dp=1, dp_rank=0, seed=1)
    for _ in range(40):  # > one epoch of 562 training windows
        a.next_batch()
    b = TrainBatches(splits, 16, 4, dp=1, dp_rank=0, seed=1)
    b.load_state_dict(a.state_dict())
    for x, y in zip(a.next_batch(), b.next_batch()):
        assert torch.equal(x[0], y[0])
    with pytest.raises(ValueError, match="seeded with 1"):
        TrainBatches(splits, 16, 4, dp=1, dp_rank=0, seed=2).load_state_dict(a.state_dict())
