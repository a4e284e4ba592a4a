"""Schedule generators: orders checked by hand on small cases, warmup counts, and structure."""

from __future__ import annotations

import pytest

from megapipe.schedule import Kind, build_schedule, validate
from megapipe.schedule.families.dualpipe import dualpipe, dualpipev
from megapipe.schedule.families.interleaved import (
    interleaved_1f1b,
    megatron_chunk_sequence,
    megatron_warmup,
)
from megapipe.schedule.families.simple import gpipe, one_f_one_b
from megapipe.schedule.families.zero_bubble import zb1p, zbv
from megapipe.schedule.ir import loop_placement, v_placement
from schedule_rows import leading_forwards


def texts(row) -> str:
    return " ".join(str(a) for a in row)


def test_1f1b_pp4_m8_by_hand():
    schedule = one_f_one_b(4, 8)
    assert texts(schedule.actions[0]) == (
        "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7"
    )
    assert texts(schedule.actions[2]) == (
        "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7"
    )
    assert texts(schedule.actions[3]) == " ".join(f"3F{i} 3B{i}" for i in range(8))
    assert schedule.stage_to_rank == (0, 1, 2, 3)


def test_1f1b_with_fewer_microbatches_than_ranks():
    assert texts(one_f_one_b(4, 2).actions[0]) == "0F0 0F1 0B0 0B1"


def test_1f1b_pp1_is_no_pipelining():
    assert texts(build_schedule("1f1b", 1, 3).actions[0]) == "0F0 0B0 0F1 0B1 0F2 0B2"


def test_gpipe_by_hand():
    assert texts(gpipe(2, 3).actions[1]) == "1F0 1F1 1F2 1B0 1B1 1B2"


def test_megatron_chunk_sequence_matches_megatron_docstring_example():
    # Megatron's example: PP2, N=3 (group size), M=5, VP2.
    order = megatron_chunk_sequence(5, 2, 3)
    assert [mb for mb, _ in order] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [chunk for _, chunk in order] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


def test_interleaved_pp2_vpp2_m4_by_hand():
    schedule = interleaved_1f1b(2, 4, 2)
    assert schedule.stage_to_rank == (0, 1, 0, 1)
    assert texts(schedule.actions[0]) == (
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3"
    )
    assert texts(schedule.actions[1]) == (
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"
    )


@pytest.mark.parametrize("pp, vpp, m, group", [
    (2, 2, 4, None), (4, 2, 8, None), (4, 3, 12, None), (4, 4, 4, None), (8, 2, 16, None),
    (3, 2, 9, None), (4, 2, 9, 5), (4, 3, 10, 6), (8, 4, 24, None),
])
def test_interleaved_warmup_follows_megatrons_formula(pp, vpp, m, group):
    schedule = interleaved_1f1b(pp, m, vpp, group)
    g = group or pp
    for rank, row in enumerate(schedule.actions):
        expected = min(2 * (pp - rank - 1) + (vpp - 1) * g, m * vpp)
        assert megatron_warmup(rank, pp, vpp, g, m * vpp) == expected
        # The steady state starts with a forward, so one more forward precedes the first B.
        assert leading_forwards(row) == min(expected + 1, m * vpp)


def test_interleaved_vpp1_is_1f1b():
    assert interleaved_1f1b(4, 6, 1).actions == one_f_one_b(4, 6).actions


def test_interleaved_backwards_run_chunks_in_reverse():
    row = interleaved_1f1b(2, 4, 3).actions[0]
    first_backward = next(a for a in row if a.kind is Kind.B)
    assert first_backward.stage == 4  # rank 0's last chunk


def test_looped_bfs_by_hand():
    schedule = build_schedule("looped-bfs", 2, 2, vpp=2)
    assert texts(schedule.actions[0]) == "0F0 0F1 2F0 2F1 2B1 2B0 0B1 0B0"


def test_zb1p_pp2_m3_by_hand():
    schedule = zb1p(2, 3)
    assert texts(schedule.actions[0]) == "0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2"
    assert texts(schedule.actions[1]) == "1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2"


@pytest.mark.parametrize("pp, vpp", [(4, 1), (8, 1), (4, 2), (3, 3)])
def test_zb1p_rank_r_defers_its_weight_gradients_by_r(pp, vpp):
    schedule = zb1p(pp, 4 * pp, vpp)
    for rank, row in enumerate(schedule.actions):
        kinds = [a.kind for a in row]
        first_w = kinds.index(Kind.W)
        assert kinds[:first_w].count(Kind.I) == rank + 1
        assert kinds.count(Kind.I) == kinds.count(Kind.W) == 4 * pp * vpp
        assert Kind.B not in kinds


def test_zb1p_warmup_is_one_hop_per_rank():
    pp, vpp, m = 4, 2, 8
    schedule = zb1p(pp, m, vpp)
    for rank, row in enumerate(schedule.actions):
        assert leading_forwards(row) == (pp - rank - 1) + (vpp - 1) * pp + 1


def test_zbv_pp1_by_hand():
    assert texts(zbv(1, 2).actions[0]) == "0F0 1F0 1I0 1W0 0F1 0I0 0W0 1F1 1I1 1W1 0I1 0W1"


def test_zbv_places_stages_in_a_v():
    schedule = zbv(4, 8)
    assert schedule.stage_to_rank == v_placement(4, 8) == (0, 1, 2, 3, 3, 2, 1, 0)
    for rank, row in enumerate(schedule.actions):
        assert {a.stage for a in row} == {rank, 7 - rank}


def test_zbv_drops_only_the_padding_microbatches():
    # Built for max(M, 2pp-1) microbatches; the surplus must vanish without breaking anything.
    schedule = zbv(4, 3)
    assert {a.microbatch for row in schedule.actions for a in row} == {0, 1, 2}
    validate(schedule)


def test_dualpipe_pp2_m4_by_hand():
    schedule = dualpipe(2, 4, overlap=True)
    assert schedule.bidirectional and schedule.stage_to_rank == (0, 1, 1, 0)
    assert texts(schedule.actions[0]) == (
        "0F0 3F2 0F1 3B2 (3F3;0B0)OVERLAP_F_B 3B3 0I1 0W1"
    )
    assert texts(schedule.actions[1]) == (
        "2F2 1F0 2F3 1B0 (1F1;2B2)OVERLAP_F_B 1B1 2I3 2W3"
    )


def mirror(action, pp: int, m: int):
    """The action of the mirror rank: same position in the other pipeline, the other half of M."""
    def flip(a):
        stage = a.stage + pp if a.stage < pp else a.stage - pp
        return type(a)(stage, a.kind, (a.microbatch + m // 2) % m)

    if action.kind is Kind.OVERLAP:
        return type(action).overlap(flip(action.forward), flip(action.backward))
    return flip(action)


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 12), (6, 14), (8, 16)])
def test_dualpipe_ranks_mirror_each_other(pp, m):
    schedule = dualpipe(pp, m, overlap=True)
    for rank in range(pp):
        mirrored = [mirror(a, pp, m) for a in schedule.actions[rank]]
        assert tuple(mirrored) == schedule.actions[pp - 1 - rank]


@pytest.mark.parametrize("pp, m", [(2, 8), (4, 8), (4, 20), (8, 16)])
def test_dualpipe_and_v_main_phase_is_overlapped(pp, m):
    for build, ranks, chunks in ((dualpipe, pp // 2, m // 2), (dualpipev, pp, m)):
        schedule = build(pp, m, overlap=True)
        for rank, row in enumerate(schedule.actions):
            position = min(rank, pp - 1 - rank) if build is dualpipe else rank
            behind = ranks - position - 1
            main = chunks - 2 * ranks + position + 1
            pairs = sum(a.kind is Kind.OVERLAP for a in row)
            assert pairs == 2 * main + behind - (1 if behind == 0 else 0)
            assert all(a.forward.microbatch != a.backward.microbatch
                       for a in row if a.kind is Kind.OVERLAP)


@pytest.mark.parametrize("build, pp, m", [(dualpipe, 4, 12), (dualpipev, 3, 8), (dualpipev, 4, 9)])
def test_dualpipe_without_overlap_splits_each_pair_into_f_then_b(build, pp, m):
    paired = build(pp, m, overlap=True)
    split = build(pp, m, overlap=False)
    for row_paired, row_split in zip(paired.actions, split.actions):
        flat = [c for a in row_paired for c in a.computations()]
        assert list(row_split) == flat
        assert all(a.kind is not Kind.OVERLAP for a in row_split)


def test_dualpipev_placement_and_counts():
    schedule = dualpipev(4, 10, overlap=False)
    assert schedule.stage_to_rank == v_placement(4, 8)
    for rank, row in enumerate(schedule.actions):
        for stage in (rank, 7 - rank):
            own = [a for a in row if a.stage == stage]
            assert sum(a.kind is Kind.F for a in own) == 10
            b = sum(a.kind is Kind.B for a in own)
            i = sum(a.kind is Kind.I for a in own)
            assert b + i == 10 and i == sum(a.kind is Kind.W for a in own)


def test_loop_placement_of_interleaved_and_zb1p():
    assert interleaved_1f1b(3, 6, 2).stage_to_rank == loop_placement(3, 6)
    assert zb1p(3, 6, 2).stage_to_rank == loop_placement(3, 6)
