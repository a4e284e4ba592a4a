"""``DataParallelSync`` on toy stages (2 gloo ranks): buckets start inside the last backward,
the reduced gradients are the plain average, and misuse fails with one clear error."""

import pytest

from support.dp_cases import early_reduction_case, gather_outside_forward_case


@pytest.mark.parametrize("sharded", [False, True], ids=["all-reduce", "reduce-scatter"])
def test_buckets_start_inside_the_last_backward_from_the_second_step(rank_pools, sharded):
    outs = rank_pools(2).run(early_reduction_case, sharded)
    for out in outs:
        assert out["buckets"] > 1
        first, second = out["started_early"]
        assert first == 0  # the first step learns how many gradients each parameter gets
        assert second == out["buckets"]  # then every bucket starts before the step says so
        assert out["equal"]
        assert "received a gradient after its bucket's reduction had started" in out["error"]


def test_a_parameter_used_outside_its_module_is_an_error_with_param_gather(rank_pools):
    for message in rank_pools(2).run(gather_outside_forward_case):
        assert "parameter all-gathers never waited for (dense bucket 1)" in message
        assert "outside its module's forward call" in message
