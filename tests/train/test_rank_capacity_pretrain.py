"""--moe-expert-rank-capacity-factor on real pretrain runs: the losses are the dropless run's,
with a factor that never overflows and with one that does (the log counts the steps run
again), and a step that does not overflow reads nothing on the host in the engine, the MoE
layer or the kernels."""

import dataclasses

import pytest

from megapipe import get_forward_backward_func
from megapipe.models.split import build_stage
from megapipe.train.config.parse import ArgsError, parse_pretrain_args
from megapipe.train.loop import train
from support.pipeline_cases import CONFIG
from support.pretrain_flags import TINY
from support.rank_capacity_cases import pretrain_step_syncs

BASE = TINY + ["--train-iters", "4", "--eval-interval", "0", "--log-interval", "1"]
FACTOR = "--moe-expert-rank-capacity-factor"


def _train(argv):
    return train(parse_pretrain_args(argv, env={}), write=lambda line: None)


def test_losses_are_the_dropless_runs_with_and_without_overflow(rank_pools):
    pool = rank_pools(4)
    dropless = pool.run(_train, BASE + ["--no-overlap-moe-expert-parallel-comm"])[0]
    roomy = pool.run(_train, BASE + [FACTOR, "2"])  # combined steps, never overflows
    tight = pool.run(_train, BASE + [FACTOR, "1.3", "--no-overlap-moe-expert-parallel-comm"])
    for results, again in ((roomy, []), (tight, [1, 2, 4])):
        assert all(r.losses == dropless.losses for r in results)
        assert all(r.ran_again == again for r in results)
        lines = results[0].lines
        assert [line for line in lines if "the step ran again" in line] == [
            f"iter {i}: the rank capacity overflowed on some rank; the step ran again without "
            f"it ({n} so far)" for n, i in enumerate(again, 1)]
        assert lines[-1].endswith(f"steps run again without the rank capacity: {len(again)}")
    # 2 x 32 tokens x top-2 = 128 routed rows, ep 2: lanes of ceil(2 x 128 / 2) rows; fp32 rows
    # of hidden 32 in six buffers of 2 x 128 rows
    assert ("rank capacity 2: dispatch in fixed lanes of 128 rows per EP rank pair (256 rows "
            "received for 128 routed), counts on the device; buffers 0.188 MiB per MoE layer "
            "and microbatch") in "\n".join(roomy[0].lines)
    assert 6 * 256 * 32 * 4 / 2**20 == pytest.approx(0.1875)


def test_a_step_that_fits_reads_nothing_on_the_host_inside(rank_pools):
    results = rank_pools(4).run(pretrain_step_syncs, TINY + ["--eval-interval", "0", FACTOR, "2"])
    for r in results:
        assert not r["ran_again"]
        assert not any(inside for _, _, inside in r["syncs"]), r["syncs"]  # no node's
        places = {where.split(":")[0] for where, _, _ in r["syncs"]}
        assert not any(p.startswith(("megapipe/moe", "megapipe/pipeline", "megapipe/overlap",
                                     "megapipe/kernels", "megapipe/models")) for p in places)
        # after the step: the one overflow check (and the app's loss, norm and log reads)
        assert ("megapipe/train/step.py:rank_capacity_overflowed", "item", False) in r["syncs"]


@pytest.mark.parametrize("flags, message", [
    ([FACTOR, "0"], f"{FACTOR}=0.0 must be > 0"),
    ([FACTOR, "1.5", "--moe-expert-capacity-factor", "1"],
     f"{FACTOR}=1.5 with --moe-expert-capacity-factor=1.0: not supported"),
    ([FACTOR, "1.5", "--moe-a2a-waves", "2"], f"{FACTOR}=1.5 with --moe-a2a-waves=2"),
    ([FACTOR, "1.5", "--overlap-grad-reduce"], f"{FACTOR}=1.5 with --overlap-grad-reduce"),
    ([FACTOR, "1.5", "--moe-ffn-hidden-size", "30"],
     f"{FACTOR}=1.5 needs --moe-ffn-hidden-size x 4 bytes to be a multiple of 16 (got 30)"),
])
def test_what_the_rank_capacity_cannot_take_is_one_clear_line(flags, message):
    with pytest.raises(ArgsError) as err:
        parse_pretrain_args(TINY + flags, env={})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_megatron_front_end_refuses_it():
    config = dataclasses.replace(CONFIG, moe_expert_rank_capacity_factor=1.5)
    chunk = build_stage(config, 0, 1)
    with pytest.raises(ValueError, match="rank capacity .* not supported by the Megatron front"):
        get_forward_backward_func()(forward_step_func=None, data_iterator=None, model=chunk,
                                    num_microbatches=2, seq_length=8, micro_batch_size=1)
