import math

import pytest
from hypothesis import given, strategies as st

from megapipe.models.split import split_layers, stage_ids_of_rank
from megapipe.schedule.ir import loop_placement, v_placement


@pytest.mark.parametrize(
    "num_layers, num_parts, counts",
    [(4, 1, [4]), (4, 2, [2, 2]), (4, 4, [0, 2, 2, 0]), (8, 4, [1, 3, 3, 1]), (6, 4, [1, 2, 2, 1]),
     (16, 8, [1, 3, 3, 2, 2, 2, 2, 1])],
)
def test_split_layers_lighter_ends(num_layers, num_parts, counts):
    assert [len(r) for r in split_layers(num_layers, num_parts)] == counts


@given(st.integers(0, 40), st.integers(1, 12), st.integers(0, 3), st.integers(0, 3))
def test_split_layers_is_contiguous_and_balanced(num_layers, num_parts, w_in, w_out):
    parts = split_layers(num_layers, num_parts, w_in, w_out)
    assert len(parts) == num_parts
    assert [i for r in parts for i in r] == list(range(num_layers))
    loads = [len(r) for r in parts]
    loads[0] += w_in
    loads[-1] += w_out
    # water-filling: the heaviest part is as light as the weights allow
    assert max(loads) == max(math.ceil((num_layers + w_in + w_out) / num_parts), w_in, w_out)
    if num_parts > 2:
        assert len(parts[0]) <= min(len(r) for r in parts[1:-1]) and len(parts[-1]) <= len(parts[1])


def test_split_layers_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_parts must be an int >= 1, got 0"):
        split_layers(4, 0)
    with pytest.raises(ValueError, match="num_layers must be an int >= 0, got -1"):
        split_layers(-1, 2)


@pytest.mark.parametrize("pp, num_stages", [(1, 1), (2, 4), (4, 8), (3, 6), (2, 8)])
@pytest.mark.parametrize("placement, place", [("loop", loop_placement), ("v", v_placement)])
def test_stage_ids_match_schedule_placements(pp, num_stages, placement, place):
    if placement == "v" and num_stages % (2 * pp):
        pytest.skip("V needs an even number of laps")
    owner = place(pp, num_stages)
    for rank in range(pp):
        assert stage_ids_of_rank(rank, pp, num_stages, placement) == [
            s for s in range(num_stages) if owner[s] == rank
        ]


def test_stage_id_examples_and_errors():
    assert stage_ids_of_rank(0, 2, 4, "loop") == [0, 2]
    assert stage_ids_of_rank(0, 2, 4, "v") == [0, 3]
    assert stage_ids_of_rank(1, 2, 4, "v") == [1, 2]
    with pytest.raises(ValueError, match="num_stages=5 must be a positive multiple of pp=2"):
        stage_ids_of_rank(0, 2, 5)
    with pytest.raises(ValueError, match="placement='zigzag'"):
        stage_ids_of_rank(0, 2, 4, "zigzag")
    with pytest.raises(ValueError, match="pp_rank=2 outside"):
        stage_ids_of_rank(2, 2, 4)
