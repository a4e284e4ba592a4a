import math
import shutil
import subprocess
import sys

import pytest
import torch

from megapipe.data.raw_text import (
    END_OF_DOCUMENT,
    load_tokens,
    resolve_data_files,
    split_corpus,
    validation_batches,
)
from megapipe.train.config.parse import ArgsError, parse_pretrain_args
from megapipe.train.loop import train
from support.pretrain_flags import TINY


def _train(argv):
    return train(parse_pretrain_args(argv, env={}), write=lambda line: None)


def test_default_shape_trains_and_loss_falls(rank_pools):
    results = rank_pools(4).run(_train, TINY + ["--train-iters", "8", "--eval-interval", "4",
                                                "--log-activation-memory"])
    losses = results[0].losses
    assert len(losses) == 8 and all(r.losses == losses for r in results)
    assert losses[-1] < losses[0] - 0.5, losses
    assert sorted(results[0].valid_losses) == [4, 8]
    lines = results[0].lines
    assert any("schedule interleaved-1f1b with overlap" in line for line in lines), lines
    assert any(line.startswith("iter 8/8 | loss") for line in lines), lines
    assert 0 < results[0].aux_losses[0] < 1
    # the overlap engine's node traces give the all-to-all time hidden and exposed
    assert any(line.startswith("iter 8/8") and " | a2a hidden " in line for line in lines)
    assert "the overlap hid" in lines[-1], lines[-1]
    assert any(line.startswith("iter 8/8") and " MiB" in line.split("act mem")[1] for line in lines)
    # the model line names the architecture, the tokenizer line the byte level
    assert lines[1].startswith("model: GPT, 2 layers, hidden 32, 4 experts top-2; attention 2 "
                               "heads of 16, rope, QK norm; RMSNorm, SwiGLU, no biases, untied")
    assert lines[2] == "tokenizer: ByteTokenizer (one token per byte), 256 tokens; model " \
        "vocabulary 256"
    # bits per byte: every target byte is one token, an end of document (0) none
    splits = split_corpus(load_tokens(resolve_data_files([])), 32)
    labels = torch.cat([labels for rank in (0, 1)
                        for _, labels in validation_batches(splits, 1, 8, 2, 2, rank)[0]])
    text_bytes = int((labels != END_OF_DOCUMENT).sum())
    expected = results[0].valid_losses[4] * labels.numel() / math.log(2) / text_bytes
    assert results[0].valid_bits_per_byte[4] == pytest.approx(expected, rel=1e-12)
    assert any(f"| {results[0].valid_bits_per_byte[8]:.4f} bits per byte" in line
               for line in lines)


def _files(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_resume_gives_the_same_losses_bitwise(rank_pools, tmp_path):
    save = str(tmp_path / "ckpt")
    common = TINY + ["--train-iters", "6", "--eval-interval", "0"]
    full = rank_pools(4).run(_train, common + ["--save", save, "--save-interval", "3"])[0]
    assert full.saved[0].endswith("iter_0000003")
    # the same run saved again to the same folder writes the same bytes, every file
    (tmp_path / "ckpt").rename(tmp_path / "first")
    again = rank_pools(4).run(_train, common + ["--save", save, "--save-interval", "3"])[0]
    assert again.losses == full.losses
    assert _files(tmp_path / "ckpt") == _files(tmp_path / "first")
    shutil.rmtree(tmp_path / "first")
    resumed = rank_pools(4).run(_train, common + ["--load", save])[0]
    assert resumed.first_iteration == 6  # the latest checkpoint is the final one
    # resume from iteration 3: point the loader at a copy holding only that checkpoint
    only3 = tmp_path / "only3"
    shutil.copytree(tmp_path / "ckpt" / "iter_0000003", only3 / "iter_0000003")
    (only3 / "latest_checkpointed_iteration.txt").write_text("3\n")
    resumed = rank_pools(4).run(_train, common + ["--load", str(only3)])[0]
    assert resumed.first_iteration == 3
    assert resumed.losses == full.losses[3:]  # bitwise
    # the layout is schedule-independent: resuming without the overlap gives the same bits
    plain = rank_pools(4).run(
        _train, common + ["--load", str(only3), "--no-overlap-moe-expert-parallel-comm"]
    )[0]
    assert plain.losses == full.losses[3:]


def test_non_finite_loss_stops_naming_the_iteration(rank_pools):
    with pytest.raises(Exception, match=r"NonFiniteLossError: loss is (nan|inf) at iteration \d"):
        rank_pools(4).run(_train, TINY + ["--train-iters", "6", "--lr", "1e30", "--min-lr", "0",
                                          "--clip-grad", "0", "--lr-warmup-iters", "0"])


@pytest.mark.parametrize("flags,message", [
    (["--pipeline-model-parallel-size", "1"], "needs --pipeline-model-parallel-size > 1"),
    (["--global-batch-size", "30"], "not divisible by --micro-batch-size x dp = 4 x 2 = 8"),
    (["--nproc", "6", "--expert-model-parallel-size", "2", "--num-experts", "4",
      "--pipeline-model-parallel-size", "2"], "ep=2 must divide dp=3"),
    (["--pipeline-schedule", "best"], "--pipeline-schedule='best' is unknown"),
    (["--lr-decay-style", "step"], "--lr-decay-style='step' must be one of"),
    (["--pipeline-schedule", "dualpipev", "--global-batch-size", "8"], "at least 4 microbatches"),
    (["--delay-wgrad-compute", "--no-overlap-moe-expert-parallel-comm"],
     "--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm"),
    (["--save-interval", "5"], "--save-interval needs --save DIR"),
    (["--moe-a2a-waves", "3"], "--moe-a2a-waves=3 exceeds the 2 experts each EP rank holds"),
    (["--moe-a2a-waves", "2", "--no-overlap-moe-expert-parallel-comm"],
     "--moe-a2a-waves=2 needs --overlap-moe-expert-parallel-comm"),
    (["--moe-a2a-waves", "0"], "--moe-a2a-waves=0 must be >= 1"),
    (["--recompute-granularity", "full"],
     "--recompute-granularity full needs --recompute-method uniform or block"),
    (["--recompute-num-layers", "2"],
     "--recompute-num-layers=2 needs --recompute-granularity full"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "0"], "--recompute-num-layers=0 must be >= 1"),
    (["--recompute-granularity", "full", "--recompute-method", "block",
      "--recompute-num-layers", "9"],
     "--recompute-num-layers=9 exceeds the largest pipeline chunk's layers"
     " (2: --num-layers=6 over 4 chunks)"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-modules", "core_attn"],
     "--recompute-modules needs --recompute-granularity selective"),
    (["--recompute-modules", "moe_act"], "--recompute-modules needs --recompute-granularity"),
    (["--recompute-granularity", "selective", "--recompute-modules", "mlp"],
     "recompute module 'mlp' is not supported; supported: core_attn, moe_act"),
    (["--recompute-method", "block"], "--recompute-method=block needs --recompute-granularity"),
    (["--overlap-max-extra-in-flight", "-1"], "--overlap-max-extra-in-flight=-1 must be >= 0"),
    (["--overlap-max-extra-in-flight", "1", "--no-overlap-moe-expert-parallel-comm"],
     "--overlap-max-extra-in-flight=1 needs --overlap-moe-expert-parallel-comm"),
])
def test_bad_flags_are_one_clear_line(flags, message):
    with pytest.raises(ArgsError) as err:
        parse_pretrain_args(flags, env={})
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("flags, modules, method, layers", [
    ([], (), None, 1),
    (["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "moe_act"],
     ("core_attn", "moe_act"), None, 1),
    (["--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "2"], (), "uniform", 2),
])
def test_recompute_flags_reach_the_model_config(flags, modules, method, layers):
    config = parse_pretrain_args(TINY + flags, env={}).model
    assert (config.recompute_modules, config.recompute_method, config.recompute_num_layers) == (
        modules, method, layers)


def test_bad_flag_exits_2_with_one_line_before_any_process():
    done = subprocess.run(
        [sys.executable, "-m", "megapipe.train.main", "--global-batch-size", "30"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0
    assert done.stderr.startswith("megapipe pretrain: error: --global-batch-size=30")


def test_every_schedule_trains_the_same_model(rank_pools):
    """The schedule changes the order of work, not the math: the losses agree across schedules."""
    base = TINY + ["--train-iters", "3", "--eval-interval", "0", "--global-batch-size", "16",
                   "--num-layers", "4"]
    reference = rank_pools(4).run(
        _train,
        base + ["--virtual-pipeline-model-parallel-size", "1", "--pipeline-schedule", "1f1b"],
    )[0].losses
    # a budget of one extra microbatch in flight pairs fewer steps, and full recompute re-runs
    # every compute node in its backward: same bits (selective recompute and the budget alone
    # are checked bitwise in tests/pipeline and tests/schedule)
    budget = ["--virtual-pipeline-model-parallel-size", "1", "--pipeline-schedule", "1f1b",
              "--overlap-max-extra-in-flight", "1"]
    full = ["--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "1"]
    assert rank_pools(4).run(_train, base + budget + full)[0].losses == reference
    interleaved = rank_pools(4).run(_train, base)[0].losses
    assert interleaved == pytest.approx(reference, rel=1e-6)
    # deferring the expert weight gradients changes when they run, not the bits; measuring
    # the activation memory changes none either, nor does splitting the all-to-alls into expert
    # groups (each alone is checked bitwise in tests/pipeline and tests/overlap)
    changed = base + ["--delay-wgrad-compute", "--log-activation-memory", "--moe-a2a-waves", "2"]
    assert rank_pools(4).run(_train, changed)[0].losses == interleaved
    # the other families (zbv and dualpipe are checked bitwise against plain in tests/pipeline)
    for flags in (["--pipeline-schedule", "dualpipev"],
                  ["--pipeline-schedule", "zb1p", "--no-overlap-moe-expert-parallel-comm"]):
        losses = rank_pools(4).run(_train, base + flags)[0].losses
        assert losses == pytest.approx(reference, rel=1e-6), flags


def test_grad_norm_matches_the_unsharded_model(rank_pools):
    """pp=2, ep=2 (experts sharded, stages split) vs pp=1, ep=1 (every rank the whole model):
    the same global batch gives the same loss and the same global gradient norm."""
    base = TINY + ["--train-iters", "3", "--eval-interval", "0", "--global-batch-size", "16",
                   "--num-layers", "4"]
    sharded = rank_pools(4).run(_train, base)[0]
    whole = rank_pools(4).run(_train, base + [
        "--pipeline-model-parallel-size", "1", "--virtual-pipeline-model-parallel-size", "1",
        "--expert-model-parallel-size", "1", "--nproc", "4"])[0]
    experts_only = rank_pools(4).run(_train, base + [
        "--pipeline-model-parallel-size", "1", "--virtual-pipeline-model-parallel-size", "1",
        "--expert-model-parallel-size", "4"])[0]
    for run in (whole, experts_only):
        assert run.losses == pytest.approx(sharded.losses, rel=1e-6)
        assert run.grad_norms == pytest.approx(sharded.grad_norms, rel=1e-5)


def _threads_around_a_run(argv):
    import os

    def threads():
        return len(os.listdir(f"/proc/{os.getpid()}/task"))

    _train(argv)  # the pool's warm-up: torch's lazily made threads exist from here
    before = threads()
    _train(argv)
    return before, threads()


def test_a_finished_run_ends_its_process_groups(rank_pools):
    """A process that runs job after job (a sweep, a notebook, these tests) does not gather
    the jobs' groups: each gloo group keeps three threads until it is ended (each NCCL group
    its communicator's buffers), and a run makes five or so per rank."""
    for before, after in rank_pools(4).run(_threads_around_a_run, TINY + ["--train-iters", "1"]):
        assert after <= before, (before, after)
