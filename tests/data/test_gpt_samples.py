"""Reading indexed datasets for training: the samples, in order, are Megatron's ``GPTDataset``
samples for the same seed, split and blend; microbatches per data-parallel rank in Megatron's
sampler order; the position resumes; files Megatron's builder wrote read back exactly; the
build is safe under a process group (rank 0 first); bad data is refused before it."""

import os
from contextlib import contextmanager

import pytest
import torch

from megapipe.data.errors import DataError
from megapipe.data.tokenizer import ByteTokenizer

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from megapipe.data.gpt_samples import (  # noqa: E402
    IndexedTrainBatches,
    build_gpt_datasets,
    check_gpt_data,
    indexed_validation_batches,
    megatron_sample_counts,
)
from megapipe.data.mcore_datasets import mcore_datasets  # noqa: E402

SEQ, GBS, MBS, SEED = 12, 8, 2, 1234
COUNTS = megatron_sample_counts(train_iters=6, global_batch_size=GBS, eval_interval=3,
                                eval_iters=2)
SPLIT = "80,15,5"


def _documents(name: str, count: int) -> list[bytes]:
    return [f"{name}{d:03d}:".encode() + bytes(range(97, 97 + d % 17)) for d in range(count)]


def _write_with_megatrons_builder(prefix: str, documents: list[bytes]) -> None:
    """A dataset as Megatron writes it: one sequence per document, byte ids, EOD 0."""
    mcore = mcore_datasets("test")
    builder = mcore.IndexedDatasetBuilder(prefix + ".bin", dtype=mcore.DType.optimal_dtype(256))
    for doc in documents:
        builder.add_document(list(doc) + [0], [len(doc) + 1])
    builder.finalize(prefix + ".idx")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt")
    docs = {"a": _documents("a", 60), "b": _documents("b", 90)}
    for name, documents in docs.items():
        _write_with_megatrons_builder(str(root / name), documents)
    return root, docs


class _Tokenizer:
    """The reference's own stand-in for a Megatron tokenizer (vocabulary, EOD, cache identity)."""

    vocab_size, eod, unique_identifiers = 256, 0, {"class": "reference"}


@contextmanager
def _world_of_one():
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def _megatron_reference(blend, split, seed, cache):
    """Megatron's datasets built directly, as pretrain_gpt.py builds them."""
    mcore = mcore_datasets("test")
    config = mcore.GPTDatasetConfig(
        random_seed=seed, sequence_length=SEQ, blend=blend, split=split, path_to_cache=cache,
        tokenizer=_Tokenizer(), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False,
    )
    with _world_of_one():
        return mcore.BlendedMegatronDatasetBuilder(
            mcore.GPTDataset, list(COUNTS), lambda: True, config).build()


def _sampler_order(dataset, consumed, dp, dp_rank):
    """Megatron's MegatronPretrainingSampler, restated: microbatches of MBS * dp consecutive
    samples, rank r taking the r-th MBS of each."""
    batches = []
    for start in range(consumed, consumed + GBS, MBS * dp):
        samples = [dataset[start + dp_rank * MBS + j] for j in range(MBS)]
        batches.append((torch.stack([s["tokens"] for s in samples]),
                        torch.stack([s["labels"] for s in samples])))
    return batches


def _equal(ours, theirs):
    return len(ours) == len(theirs) and all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("weighted", [False, True])
def test_sample_order_is_megatrons(data, tmp_path, weighted):
    root, _ = data
    a, b = str(root / "a"), str(root / "b")
    data_path = ["0.3", a, "0.7", b] if weighted else [b]
    blend = ([a, b], [0.3, 0.7]) if weighted else ([b], None)
    ours = build_gpt_datasets(data_path, SPLIT, SEQ, SEED, COUNTS, ByteTokenizer(),
                              tmp_path / "ours")
    assert not torch.distributed.is_initialized()  # its own one-process group is gone
    theirs = _megatron_reference(blend, SPLIT, SEED, str(tmp_path / "theirs"))
    assert len(ours.train) == len(theirs[0]) >= COUNTS[0]
    for dp in (1, 2):
        for rank in range(dp):
            batches = IndexedTrainBatches(ours.train, GBS, MBS, dp, rank, SEED)
            assert batches.num_microbatches == GBS // (MBS * dp)
            for iteration in range(COUNTS[0] // GBS):
                mine = batches.next_batch()
                assert mine[0][0].shape == (MBS, SEQ) and mine[0][0].dtype == torch.int64
                assert _equal(mine, _sampler_order(theirs[0], iteration * GBS, dp, rank))
            valid = indexed_validation_batches(ours.valid, 2, GBS, MBS, dp, rank)
            assert all(_equal(v, _sampler_order(theirs[1], i * GBS, dp, rank))
                       for i, v in enumerate(valid))
    other = _megatron_reference(blend, SPLIT, SEED + 1, str(tmp_path / "other"))
    first = IndexedTrainBatches(ours.train, GBS, MBS, 1, 0, SEED).next_batch()
    assert not _equal(first, _sampler_order(other[0], 0, 1, 0))  # the seed matters


def test_samples_are_the_documents_megatron_wrote(data, tmp_path):
    """Each sample is s + 1 consecutive tokens of the documents in some order: cut at the EODs,
    its inner pieces are whole documents of the train split, its ends a document's end and
    start (or, with no EOD, a piece of one document). Labels are the tokens shifted by one."""
    root, docs = data
    train = build_gpt_datasets([str(root / "a")], SPLIT, SEQ, SEED, COUNTS, ByteTokenizer(),
                               tmp_path / "c").train
    train_docs = docs["a"][: round(0.8 * 60)]
    batches = IndexedTrainBatches(train, GBS, MBS, 1, 0, SEED)
    for _ in range(COUNTS[0] // GBS):
        for tokens, labels in batches.next_batch():
            assert torch.equal(tokens[:, 1:], labels[:, :-1])
            for row in torch.cat([tokens, labels[:, -1:]], dim=1).tolist():
                pieces = bytes(row).split(b"\0")
                if len(pieces) == 1:  # inside one document
                    assert any(pieces[0] in d for d in train_docs)
                    continue
                assert all(p in train_docs for p in pieces[1:-1])
                assert any(d.endswith(pieces[0]) for d in train_docs)
                assert any(d.startswith(pieces[-1]) for d in train_docs)


def test_position_resumes(data, tmp_path):
    root, _ = data
    train = build_gpt_datasets([str(root / "b")], SPLIT, SEQ, SEED, COUNTS, ByteTokenizer(),
                               tmp_path / "c").train
    run = IndexedTrainBatches(train, GBS, MBS, 2, 1, SEED)
    run.next_batch(), run.next_batch()
    resumed = IndexedTrainBatches(train, GBS, MBS, 2, 1, SEED)
    resumed.load_state_dict(run.state_dict())
    assert resumed.consumed_samples == 2 * GBS
    assert _equal(resumed.next_batch(), run.next_batch())
    with pytest.raises(DataError, match="seeded with 1234, this run with --seed=7"):
        IndexedTrainBatches(train, GBS, MBS, 2, 1, 7).load_state_dict(run.state_dict())
    run.consumed_samples = len(train) - GBS + 1
    with pytest.raises(DataError, match="the train split holds"):
        run.next_batch()


def test_megatrons_blend_parser_agrees():
    from megatron.core.datasets.utils import get_blend_from_list

    from megapipe.data.blend import parse_data_path

    for values in (["A"], ["A", "B"], ["0.3", "A", "0.7", "B"], ["30", "A", "70", "B", "1", "C"]):
        assert parse_data_path(values).megatron() == \
            tuple(map(lambda x: x if x is None else list(x), get_blend_from_list(values)))


def test_bad_data_is_refused_before_building(data, tmp_path):
    root, _ = data
    _write_with_megatrons_builder(str(tmp_path / "small"), _documents("s", 30))
    # 969,30,1 of 30 documents leaves the test split none: Megatron would loop forever, even
    # asked for no test samples
    for counts in (COUNTS, COUNTS[:2] + (0,)):
        with pytest.raises(DataError, match=r"small: its test split \(--split 969,30,1: "
                                            r"sequences 30 to 30 of 30\) holds no tokens"):
            check_gpt_data([str(tmp_path / "small")], "969,30,1", SEQ, SEED, counts,
                           ByteTokenizer())
    check_gpt_data([str(tmp_path / "small")], "969,31,0", SEQ, SEED, COUNTS, ByteTokenizer())
    (tmp_path / "mixed.bin").write_bytes((root / "b.bin").read_bytes())
    (tmp_path / "mixed.idx").write_bytes((root / "a.idx").read_bytes())
    with pytest.raises(DataError, match=r"mixed.bin holds .* bytes, its index describes"):
        check_gpt_data([str(tmp_path / "mixed")], SPLIT, SEQ, SEED, COUNTS, ByteTokenizer())
    with pytest.raises(DataError, match="missing.idx does not exist"):
        build_gpt_datasets(["1", str(root / "a"), "1", str(root / "missing")], SPLIT, SEQ,
                           SEED, COUNTS, ByteTokenizer())


def _first_batches_on_ranks(data_path, cache):
    """On every rank of a 2-process gloo world: build (collective), take this dp rank's first
    two iterations."""
    datasets = build_gpt_datasets(data_path, SPLIT, SEQ, SEED, COUNTS, ByteTokenizer(), cache)
    rank = torch.distributed.get_rank()
    batches = IndexedTrainBatches(datasets.train, GBS, MBS, 2, rank, SEED)
    return rank, [batches.next_batch() for _ in range(2)]


def test_collective_build_under_a_process_group(data, tmp_path, rank_pools):
    """Rank 0 writes the caches, a barrier, rank 1 reads them; each rank's microbatches are
    Megatron's sampler order."""
    root, _ = data
    data_path = ["0.3", str(root / "a"), "0.7", str(root / "b")]
    results = rank_pools(2).run(_first_batches_on_ranks, data_path, str(tmp_path / "cache"))
    theirs = _megatron_reference(([str(root / "a"), str(root / "b")], [0.3, 0.7]), SPLIT, SEED,
                                 str(tmp_path / "theirs"))
    for rank, iterations in results:
        for t, batch in enumerate(iterations):
            assert _equal(batch, _sampler_order(theirs[0], t * GBS, 2, rank))
    written = sorted(os.listdir(tmp_path / "cache"))
    assert any("BlendedDataset-train" in name for name in written)
