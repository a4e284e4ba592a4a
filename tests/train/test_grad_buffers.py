"""The data-parallel layout (buckets, shards, pieces) and the checkpoint boxes (no processes)."""

import math
import random

import pytest
import torch

from megapipe.train.checkpoint.pieces import PieceTensor, flat_boxes
from megapipe.train.config.parse import ArgsError, parse_pretrain_args
from megapipe.train.optim.grad_buffers import ALIGN, FlatBuffer, assign_buckets
from support.pretrain_flags import TINY


def test_buckets_close_at_the_size_and_pad_each_shard():
    numels = [100, 300, 50, 700, 10]
    starts, buckets = assign_buckets(numels, bucket_size=400, shards=2)
    assert all(s % ALIGN == 0 for s in starts)
    assert [b.params for b in buckets] == [(0, 1), (2, 3), (4,)]
    for bucket in buckets:
        assert (bucket.end - bucket.start) % (2 * ALIGN) == 0
        for i in bucket.params:
            assert bucket.start <= starts[i] and starts[i] + numels[i] <= bucket.end
    assert [b.start for b in buckets[1:]] == [b.end for b in buckets[:-1]]
    lo0, hi0 = buckets[0].shard(0, 2)
    lo1, hi1 = buckets[0].shard(1, 2)
    assert (lo0, hi1) == (buckets[0].start, buckets[0].end) and hi0 == lo1 and lo1 % ALIGN == 0
    _, one = assign_buckets(numels, bucket_size=None)
    assert len(one) == 1 and one[0].params == (0, 1, 2, 3, 4)


def test_parameters_become_views_of_the_flat_buffers():
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    before = [p.detach().clone() for p in model.parameters()]
    buffer = FlatBuffer("dense", list(model.parameters()), None, bucket_size=20, sharded=True)
    for param, value in zip(model.parameters(), before):
        assert torch.equal(param, value)
        assert param.untyped_storage().data_ptr() == buffer.data.untyped_storage().data_ptr()
        grad_storage = param.main_grad.untyped_storage().data_ptr()
        assert grad_storage == buffer.grad.untyped_storage().data_ptr()
    model(torch.randn(4, 5)).sum().backward()  # autograd still fills .grad
    assert all(p.grad is not None for p in model.parameters())
    pieces = sorted((id(p.param), p.lo, p.hi) for p in buffer.pieces())
    assert pieces == sorted((id(q), 0, q.numel()) for q in model.parameters())


def _boxes_cover(shape, lo, hi):
    boxes = flat_boxes(shape, lo, hi)
    position = lo
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    for offsets, sizes in boxes:
        start = sum(o * s for o, s in zip(offsets, strides))
        assert start == position, (shape, lo, hi, boxes)
        # contiguous: every dimension after the first partial one is whole
        partial = [i for i, (size, full) in enumerate(zip(sizes, shape)) if size != full]
        assert all(sizes[i] == 1 for i in partial[:-1]), (shape, boxes)
        if partial:
            assert all(sizes[i] == shape[i] for i in range(partial[-1] + 1, len(shape)))
        position += math.prod(sizes)
    assert position == hi
    return boxes


def test_flat_ranges_are_tiled_by_contiguous_row_major_boxes():
    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        numel = math.prod(shape)
        lo = rng.randrange(numel)
        hi = rng.randint(lo + 1, numel)
        _boxes_cover(shape, lo, hi)
    assert flat_boxes((4, 6), 3, 21) == [((0, 3), (1, 3)), ((1, 0), (2, 6)), ((3, 0), (1, 3))]


def test_a_piece_tensor_views_the_range_it_holds():
    values = torch.arange(3.0, 10.0)  # elements 3..9 of arange(12) viewed (3, 4)
    piece = PieceTensor((3, 4), 3, 10, values)
    assert piece.shape == (3, 4)
    chunks = piece.__create_chunk_list__()
    assert [tuple(c.offsets) for c in chunks] == [(0, 3), (1, 0), (2, 0)]
    values.add_(100)  # the boxes are views of the values
    full = torch.arange(12.0).view(3, 4)
    for chunk in chunks:
        index = type("I", (), {"offset": chunk.offsets, "fqn": "x"})()
        view = piece.__get_tensor_shard__(index)
        sl = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
        assert torch.equal(view, full[sl] + 100)


@pytest.mark.parametrize("flags,message", [
    (["--overlap-param-gather", "--overlap-grad-reduce"],
     "--overlap-param-gather needs --use-distributed-optimizer"),
    (["--overlap-param-gather", "--use-distributed-optimizer"],
     "--overlap-param-gather needs --overlap-grad-reduce"),
    (["--ddp-bucket-size", "1000"], "--ddp-bucket-size=1000 needs --overlap-grad-reduce"),
    (["--ddp-bucket-size", "100", "--overlap-grad-reduce"],
     r"--ddp-bucket-size=100 is too small: .* use at least 64 x dp = 128"),
])
def test_bad_data_parallel_flags_are_one_line_errors(flags, message):
    with pytest.raises(ArgsError, match=message):
        parse_pretrain_args(TINY + flags, env={})
