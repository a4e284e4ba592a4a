"""``megapipe pretrain --bf16``: trains like fp32, resumes bitwise, and the flags around it."""

import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megapipe.train.config.parse import parse_pretrain_args
from megapipe.train.loop import train
from megapipe.train.main import main
from support.pretrain_flags import TINY

# Measured on this model: every one of the 30 bf16 losses within 1.5e-3 of the fp32 run's.
LOSS_MARGIN = 0.02  # per iteration, absolute
DROP_MARGIN = 0.05  # the fall from the first to the last loss, relative to fp32's


def _train(argv):
    return train(parse_pretrain_args(argv, env={}), write=lambda line: None)


def test_bf16_loss_falls_like_fp32(rank_pools):
    base = TINY + ["--train-iters", "30", "--eval-interval", "0"]
    fp32 = rank_pools(4).run(_train, base)[0]
    bf16 = rank_pools(4).run(_train, base + ["--bf16"])[0]
    assert "; fp32; " in fp32.lines[0], fp32.lines[0]
    assert "bf16 with fp32 main weights, moments and gradients" in bf16.lines[0], bf16.lines[0]
    assert bf16.losses != fp32.losses  # really another precision
    worst = max(abs(a - b) for a, b in zip(bf16.losses, fp32.losses))
    assert worst <= LOSS_MARGIN, (worst, bf16.losses, fp32.losses)
    fp32_drop = fp32.losses[0] - fp32.losses[-1]
    bf16_drop = bf16.losses[0] - bf16.losses[-1]
    assert fp32_drop > 1.5 and abs(bf16_drop - fp32_drop) <= DROP_MARGIN * fp32_drop


def test_bf16_resume_is_bitwise_and_keeps_fp32_main_weights(rank_pools, tmp_path):
    common = TINY + ["--train-iters", "6", "--eval-interval", "0", "--bf16"]
    save = tmp_path / "ckpt"
    full = rank_pools(4).run(_train, common + ["--save", str(save), "--save-interval", "3"])[0]
    metadata = dcp.FileSystemReader(str(save / "iter_0000003")).read_metadata()
    mains = {k: m for k, m in metadata.state_dict_metadata.items() if k.endswith("/main_param")}
    models = [k for k in metadata.state_dict_metadata if k.startswith("model/")]
    assert len(mains) == len(models) > 0  # one fp32 main weight per bf16 parameter
    assert {m.properties.dtype for m in mains.values()} == {torch.float32}
    only3 = tmp_path / "only3"
    shutil.copytree(save / "iter_0000003", only3 / "iter_0000003")
    (only3 / "latest_checkpointed_iteration.txt").write_text("3\n")
    # resumed with --deterministic-mode: on CPU no kernel megapipe runs is non-deterministic,
    # so the mode must change no bit
    resumed = rank_pools(4).run(_train, common + ["--load", str(only3), "--deterministic-mode"])[0]
    assert "deterministic kernels" in resumed.lines[0], resumed.lines[0]
    assert resumed.first_iteration == 3
    assert resumed.losses == full.losses[3:]  # bitwise


def test_capacity_padding_in_bf16_overlap_equals_no_overlap(rank_pools):
    base = TINY + ["--train-iters", "3", "--eval-interval", "0", "--bf16",
                   "--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity",
                   "--moe-router-dtype", "fp32"]
    combined = rank_pools(4).run(_train, base)[0]
    plain = rank_pools(4).run(_train, base + ["--no-overlap-moe-expert-parallel-comm"])[0]
    assert "router fp32" in combined.lines[0]
    assert combined.losses == plain.losses
    assert combined.losses[-1] < combined.losses[0]


def test_more_processes_than_gpus_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    code = main(TINY + ["--nproc", "4"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "4 processes on this host" in err and "it has 2 GPU(s)" in err


@pytest.mark.parametrize("flags,message", [
    (["--fp16"], "--fp16 is not supported: megapipe trains in fp32 or with --bf16"),
    (["--bf16", "--fp16"], "--fp16 is not supported"),
    (["--moe-router-dtype", "bf16"], "--moe-router-dtype='bf16' must be fp32 or fp64"),
    (["--moe-pad-expert-input-to-capacity"], "needs --moe-expert-capacity-factor"),
    (["--moe-expert-capacity-factor", "0"], "--moe-expert-capacity-factor=0.0 must be > 0"),
    (["--high-priority-stream-groups", "ep", "tp"], "--high-priority-stream-groups tp: not a"),
])
def test_precision_flags_fail_in_one_line(flags, message, capsys):
    assert main(flags) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
