"""A checkpoint written under one parallel layout resumes under another (DCP reshards it)."""

import shutil

import pytest

from megapipe.train.checkpoint.files import LATEST_FILE
from megapipe.train.config.parse import parse_pretrain_args
from megapipe.train.loop import train
from support.pretrain_flags import TINY

LAYOUTS = {
    "pp1 ep4 dp4": ["--pipeline-model-parallel-size", "1",
                    "--virtual-pipeline-model-parallel-size", "1",
                    "--expert-model-parallel-size", "4"],
    "pp4 ep1 dp1": ["--pipeline-model-parallel-size", "4",
                    "--virtual-pipeline-model-parallel-size", "1",
                    "--expert-model-parallel-size", "1"],
    "pp2 ep1 dp2 1f1b": ["--virtual-pipeline-model-parallel-size", "1",
                         "--expert-model-parallel-size", "1", "--nproc", "4"],
}


def _train(argv):
    return train(parse_pretrain_args(argv, env={}), write=lambda line: None)


def test_pp2_vpp2_ep2_dp2_checkpoint_resumes_under_other_layouts(rank_pools, tmp_path):
    """The loss curve after resuming continues the uninterrupted run's, within fp32 rounding
    (other layouts sum in another order), for model weights, AdamW moments, LR schedule and
    data position all carried over."""
    common = TINY + ["--train-iters", "6", "--eval-interval", "0"]
    save = tmp_path / "ckpt"
    full = rank_pools(4).run(_train, common + ["--save", str(save), "--save-interval", "3"])[0]
    only3 = tmp_path / "only3"
    shutil.copytree(save / "iter_0000003", only3 / "iter_0000003")
    (only3 / LATEST_FILE).write_text("3\n")
    for name, flags in LAYOUTS.items():
        resumed = rank_pools(4).run(_train, common + ["--load", str(only3)] + flags)[0]
        assert resumed.first_iteration == 3, name
        assert resumed.losses == pytest.approx(full.losses[3:], rel=2e-6, abs=0), name
        assert resumed.losses != pytest.approx(full.losses[:3], rel=1e-3), name  # not restarted
