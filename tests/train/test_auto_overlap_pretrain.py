"""--overlap-moe-expert-parallel-comm-auto on a real pretrain run: the ranks agree on the
faster mode, log it, and the losses are bitwise those of either fixed mode. The step times are
scripted (a clock the test controls), so the choice is deterministic."""

import pytest
import torch.distributed as dist

from megapipe.train.config.parse import ArgsError, parse_pretrain_args
from megapipe.train.loop import train
from support.pretrain_flags import TINY
from support.scripted_clock import ScriptedClock

BASE = TINY + ["--train-iters", "7", "--eval-interval", "0", "--log-interval", "1"]


def _train_auto(argv, seconds_by_rank):
    clock = ScriptedClock(seconds_by_rank[dist.get_rank()])
    return train(parse_pretrain_args(argv, env={}), write=lambda line: None, clock=clock)


def _train(argv):
    return train(parse_pretrain_args(argv, env={}), write=lambda line: None)


def _decisions(result):
    return [line for line in result.lines if line.startswith("overlap auto:")]


def test_auto_keeps_the_faster_mode_with_and_without_the_link(rank_pools):
    pool = rank_pools(4)
    # with the emulated link the overlap pays: combined steps are the faster on three ranks;
    # rank 3 alone would keep plain, but the slowest rank's times decide for every rank
    seconds = [{False: 2.0, True: 1.0}] * 3 + [{False: 1.0, True: 1.5}]
    auto = pool.run(_train_auto, BASE + ["--overlap-moe-expert-parallel-comm-auto",
                                         "--moe-emulated-link-gbps", "0.5"], seconds)
    fixed = pool.run(_train, BASE + ["--no-overlap-moe-expert-parallel-comm"])[0].losses
    assert all(r.losses == fixed for r in auto)  # bitwise the fixed modes' losses
    lines = [_decisions(r) for r in auto]
    assert lines == [["overlap auto: on (combined 1.5 s vs plain 2 s per step, slowest rank, "
                      "steps 1-6; next check at step 501)"]] * 4  # the default interval
    assert auto[0].lines[0].endswith("schedule interleaved-1f1b with overlap auto; " +
                                     auto[0].lines[0].split("auto; ")[1])
    # the steps ran in the trial's modes, then the kept one: only combined steps trace
    # all-to-alls (the log's "a2a hidden")
    traced = [" | a2a hidden " in next(line for line in auto[0].lines
                                       if line.startswith(f"iter {i}/7")) for i in range(1, 8)]
    assert traced == [False] * 3 + [True] * 4, traced
    # no link: nothing to hide, the combined step's own cost makes it the slower on rank 2;
    # the slowest rank's times decide for every rank: plain steps kept, the same losses
    seconds = [{False: 1.0, True: 0.9}] * 2 + [{False: 1.0, True: 1.25}, {False: 1.0,
                                                                         True: 0.9}]
    auto = pool.run(_train_auto, BASE + ["--overlap-moe-expert-parallel-comm-auto"], seconds)
    assert all(r.losses == fixed for r in auto)
    assert [_decisions(r) for r in auto] == [[
        "overlap auto: off (combined 1.25 s vs plain 1 s per step, slowest rank, steps 1-6; "
        "next check at step 501)"]] * 4
    traced = [" | a2a hidden " in next(line for line in auto[0].lines
                                       if line.startswith(f"iter {i}/7")) for i in range(1, 8)]
    assert traced == [False] * 3 + [True] * 3 + [False], traced


AUTO = "--overlap-moe-expert-parallel-comm-auto"


@pytest.mark.parametrize("flags, message", [
    ([AUTO, "--no-overlap-moe-expert-parallel-comm"],
     f"{AUTO} with --no-overlap-moe-expert-parallel-comm: auto chooses between"),
    ([AUTO, "--delay-wgrad-compute"], f"{AUTO} with --delay-wgrad-compute"),
    ([AUTO, "--moe-a2a-waves", "2"], f"{AUTO} with --moe-a2a-waves=2"),
    ([AUTO, "--overlap-max-extra-in-flight", "1"], f"{AUTO} with --overlap-max-extra-in-flight=1"),
    ([AUTO, "--overlap-auto-interval", "5"],
     "--overlap-auto-interval=5 is shorter than one timing trial (6 iterations)"),
    (["--overlap-auto-interval", "10"], "--overlap-auto-interval=10 needs " + AUTO),
])
def test_auto_with_a_one_mode_option_is_one_clear_line(flags, message):
    with pytest.raises(ArgsError) as err:
        parse_pretrain_args(flags, env={})
    assert message in str(err.value) and "\n" not in str(err.value)
