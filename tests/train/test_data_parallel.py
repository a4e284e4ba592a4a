"""megapipe pretrain with bucketed data parallelism (4 gloo ranks, pp 2 x dp 2, ep 2).

``--overlap-grad-reduce`` reduces each bucket as soon as the backward has finished it,
``--use-distributed-optimizer`` shards AdamW over dp, ``--overlap-param-gather`` gathers the
updated weights behind the next step's forwards. The losses are those of the run that reduces
after the step and keeps the whole optimizer on every rank.
"""

import json
import shutil

import pytest

from megapipe.train.checkpoint.files import LATEST_FILE
from megapipe.train.config.parse import parse_pretrain_args
from megapipe.train.loop import train
from megapipe.train.observe.trace_summary import summarize_file
from support.dp_cases import optimizer_state_bytes
from support.pretrain_flags import TINY

BUCKETS = ["--ddp-bucket-size", "512"]
ALL = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", *BUCKETS]


def _train(argv):
    return train(parse_pretrain_args(argv, env={}), write=lambda line: None)


def _act_mem(result):
    return [line.split("act mem ")[1] for line in result.lines if "act mem" in line]


def _close(got, want, rel=1e-6):
    assert len(got) == len(want)
    assert got == pytest.approx(want, rel=rel, abs=0)


def test_sharded_optimizer_with_both_overlaps_gives_the_unsharded_losses(rank_pools):
    """20 iterations with an evaluation in between (it waits for the gathers): the same
    numbers within 1e-6 relative (here bitwise)."""
    common = TINY + ["--train-iters", "20", "--eval-interval", "10", "--log-interval", "5"]
    base = rank_pools(4).run(_train, common)[0]
    dp = rank_pools(4).run(_train, common + ALL)[0]
    _close(dp.losses, base.losses)
    assert dp.valid_losses == pytest.approx(base.valid_losses, rel=1e-6)
    assert base.losses[-1] < base.losses[0] - 0.5


def test_activation_memory_is_reported_as_before(rank_pools):
    """The parameters now live in flat buffers; act mem still counts activations only."""
    common = TINY + ["--train-iters", "2", "--eval-interval", "0", "--log-interval", "1",
                     "--log-activation-memory"]
    base = rank_pools(4).run(_train, common)[0]
    dp = rank_pools(4).run(_train, common + ALL)[0]
    assert _act_mem(dp) == _act_mem(base) and "MiB" in _act_mem(base)[-1]


@pytest.mark.parametrize("flags", [
    ["--overlap-grad-reduce", *BUCKETS],
    ["--overlap-grad-reduce", *BUCKETS, "--bf16"],
    ["--use-distributed-optimizer", "--bf16"],
    ["--pipeline-schedule", "zbv", *ALL],
    ["--delay-wgrad-compute", "--moe-a2a-waves", "2", *ALL],
    ["--pipeline-schedule", "dualpipe", "--virtual-pipeline-model-parallel-size", "1",
     "--global-batch-size", "16", *ALL],
], ids=["grad-reduce", "grad-reduce-bf16", "dist-opt-bf16", "zbv", "deferred-wgrad", "dualpipe"])
def test_other_schedules_and_precisions_give_the_unsharded_losses(rank_pools, flags):
    """Deferred weight gradients (zbv's W, --delay-wgrad-compute) reach main_grad outside
    autograd; DualPipe sums its mirrored stages before reducing; bf16 keeps fp32 main weights."""
    base_flags = [f for f in flags if f not in ALL]
    common = TINY + ["--train-iters", "6", "--eval-interval", "0"]
    base = rank_pools(4).run(_train, common + base_flags)[0]
    got = rank_pools(4).run(_train, common + flags)[0]
    _close(got.losses, base.losses)


def test_optimizer_state_is_sharded_over_dp(rank_pools):
    """pp 1, dp 4, ep 2: dense state over 4 ranks, expert state over 2 (expert-DP)."""
    layout = ["--pipeline-model-parallel-size", "1", "--virtual-pipeline-model-parallel-size",
              "1", "--nproc", "4"]
    whole = rank_pools(4).run(optimizer_state_bytes, TINY + layout)
    sharded = rank_pools(4).run(optimizer_state_bytes, TINY + layout + ALL)
    ratio = sum(sharded) / sum(whole)
    assert 0.25 < ratio < 0.45, (whole, sharded)  # dense 1/4, experts 1/2, plus padding


def test_resume_is_bitwise_and_reshards_to_another_dp(rank_pools, tmp_path):
    common = TINY + ["--train-iters", "6", "--eval-interval", "0"]
    save = tmp_path / "ckpt"
    full = rank_pools(4).run(_train, common + ALL + ["--save", str(save), "--save-interval",
                                                     "3"])[0]
    only3 = tmp_path / "only3"
    shutil.copytree(save / "iter_0000003", only3 / "iter_0000003")
    (only3 / LATEST_FILE).write_text("3\n")
    resumed = rank_pools(4).run(_train, common + ALL + ["--load", str(only3)])[0]
    assert resumed.first_iteration == 3 and resumed.losses == full.losses[3:]  # bitwise
    dp4 = ["--pipeline-model-parallel-size", "1", "--virtual-pipeline-model-parallel-size", "1",
           "--nproc", "4"]
    for flags in (dp4 + ALL, dp4):  # sharded over 4 ranks, and not sharded at all
        other = rank_pools(4).run(_train, common + ["--load", str(only3)] + flags)[0]
        assert other.first_iteration == 3
        _close(other.losses, full.losses[3:], rel=2e-6)


def test_the_profile_trace_shows_the_reductions_inside_the_backward(rank_pools, tmp_path):
    path = tmp_path / "trace.json"
    rank_pools(4).run(_train, TINY + ALL + ["--train-iters", "3", "--eval-interval", "0",
                                            "--profile-trace", str(path),
                                            "--profile-step-start", "2",
                                            "--profile-step-end", "3"])
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    early = 0
    for rank in range(4):
        mine = [e for e in events if e["pid"] == rank and e["args"]["step"] == 3]
        reductions = [e for e in mine if e["cat"] == "dp" and e["name"].startswith("reduce")]
        gathers = [e for e in mine if e["cat"] == "dp" and e["name"].startswith("all-gather")]
        assert reductions and gathers and all(e["tid"] == 3 for e in reductions + gathers)
        last_action_end = max(e["ts"] + e["dur"] for e in mine if e["cat"] == "action")
        early += sum(e["ts"] < last_action_end for e in reductions)
    assert early > 0  # some bucket was reduced while the rank still computed
    text = summarize_file(str(path))
    assert text.count("data parallel: collectives") == 4, text


def test_graph_replays_wait_for_the_parameter_gathers(rank_pools):
    """--overlap-param-gather with CUDA graphs (the CPU stand-in, which runs no module hook at
    a replay): the engine waits for a captured node's gathers before its replay, so the losses
    are those without graphs (before this wait the second step stopped: gathers never waited
    for)."""
    from support.dp_cases import graph_replay_losses

    common = TINY + ["--train-iters", "2", "--eval-interval", "0"] + ALL
    graphs = ["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn", "moe_router"]
    base = rank_pools(4).run(graph_replay_losses, common)[0]
    got = rank_pools(4).run(graph_replay_losses, common + graphs)[0]
    assert isinstance(got, list) and got == base
