"""The sync-free dispatch (``moe.rank_capacity``): fixed-size all-to-alls, counts on the
device, bitwise the dropless exchange when nothing overflows, overflow seen by every rank."""

import pytest
import torch

from megapipe.moe.rank_capacity import RankCapacityDispatch, lane_rows
from support.rank_capacity_cases import compare


def test_without_overflow_it_is_the_dropless_exchange_with_no_host_read(rank_pools):
    results = rank_pools(2).run(compare, 24, 1.5, False)
    for r in results:
        assert not r["overflowed"] and r["syncs"] == []
        assert r["buffer_rows"] == 2 * 18  # ep x ceil(1.5 x 24 / 2)
        assert r["rows_equal"] and r["padding_zero"] and r["offsets_equal"]
        assert r["out_equal"] and r["grad_equal"]
        assert r["buffer_bytes"] == 6 * 36 * 8 * 4


def test_an_overflow_on_one_rank_is_seen_by_every_rank(rank_pools):
    # most rows go to EP rank 0's experts: their lanes (ceil(1.0 x 24 / 2) = 12) overflow
    results = rank_pools(2).run(compare, 24, 1.0, True)
    assert [r["overflowed"] for r in results] == [True, True]
    assert all(r["syncs"] == [] for r in results)  # still no host read inside


def test_one_rank_needs_no_exchange():
    rows = torch.randn(6, 4)
    counts = torch.tensor([2, 0, 3, 1])
    d = RankCapacityDispatch(4, lane_rows(6, 1.0, 1))
    expert_rows, splits = d.dispatch(rows, counts)
    assert torch.equal(expert_rows, rows) and torch.equal(splits.offsets,
                                                          torch.tensor([2, 2, 5, 6]).int())
    assert torch.equal(d.combine(expert_rows, splits), rows)
    small = RankCapacityDispatch(4, lane_rows(6, 0.5, 1))
    expert_rows, splits = small.dispatch(rows, counts)
    assert bool(splits.overflow) and expert_rows.shape == (3, 4)  # 6 rows in a lane of 3
    assert torch.equal(small.combine(expert_rows, splits), torch.cat([rows[:3], 0 * rows[3:]]))


def test_a_factor_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="rank capacity factor=0 must be > 0"):
        lane_rows(8, 0, 2)


def test_experts_without_the_grouped_kernel_refuse_device_only_counts():
    from megapipe.moe.experts import GroupedExperts

    experts = GroupedExperts(30, 32, 2, 0)  # 30 x 4 bytes: rows the kernel does not take
    with pytest.raises(NotImplementedError, match="device-only row counts need torch's grouped"):
        experts(torch.zeros(4, 30), None, offsets=torch.tensor([2, 4], dtype=torch.int32))
