"""pretrain: ``megapipe pretrain`` as one rank (world size 1, NCCL on the GPU), pp = ep = 1,
1f1b with the overlap on: 20 iterations with a checkpoint at 10 and 20, then a resume from
iteration 10 whose losses must equal the uninterrupted run's bit for bit; tokens per second
from the log's last interval (iterations 11-20, past the warm-up).

bf16: with a ``--bf16`` flag (the precision work adds it) the run uses it; without, it runs in
fp32 and says so. On a GPU both runs use ``torch.use_deterministic_algorithms`` (the runner
sets ``CUBLAS_WORKSPACE_CONFIG`` for this section): atomics in an embedding or router backward
would otherwise change the low bits between two runs whatever the checkpoint holds; the tokens/s
are measured so.
"""

from __future__ import annotations

import os
import re
import shutil

import torch
import torch.distributed as dist

from megapipe.parallel.launch import free_port
from megapipe.train.args import parse_pretrain_args
from megapipe.train.checkpoint_files import LATEST_FILE, iteration_dir
from megapipe.train.flags import build_parser
from megapipe.train.loop import TrainResult, train

COMMON = ["--pipeline-model-parallel-size", "1", "--virtual-pipeline-model-parallel-size", "1",
          "--expert-model-parallel-size", "1", "--eval-interval", "0"]
REAL = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16",
        "--ffn-hidden-size", "4096", "--num-experts", "8", "--moe-router-topk", "2",
        "--moe-ffn-hidden-size", "1024", "--seq-length", "1024", "--micro-batch-size", "4",
        "--global-batch-size", "32", "--lr-warmup-iters", "5"]
DRY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
       "--ffn-hidden-size", "64", "--moe-ffn-hidden-size", "32", "--seq-length", "32",
       "--micro-batch-size", "2", "--global-batch-size", "8", "--lr-warmup-iters", "2"]
DRY_DATA = "megapipe"  # the package's own source as the corpus: quicker to load than the stdlib
_TOKENS_PER_S = re.compile(r"([\d,]+) tok/s")


def has_flag(flag: str) -> bool:
    return flag in build_parser()._option_string_actions


def tokens_per_second(lines: list[str]) -> float | None:
    """The tokens/s of the last log line that has one."""
    for line in reversed(lines):
        match = _TOKENS_PER_S.search(line)
        if match:
            return float(match.group(1).replace(",", ""))
    return None


def run(ctx, result) -> None:  # noqa: ANN001
    iterations = 20 if ctx.cuda else 4
    half = iterations // 2
    flags = COMMON + (REAL if ctx.cuda else DRY + ["--data-path", str(ctx.repo / DRY_DATA)])
    flags += ["--train-iters", str(iterations), "--log-interval", str(half)]
    if has_flag("--bf16"):
        flags.append("--bf16")
    else:
        result.skip("bf16", "megapipe pretrain has no --bf16 flag yet; this run is fp32")
    result.figure("flags", " ".join(flags))
    if ctx.cuda:
        torch.use_deterministic_algorithms(True, warn_only=True)
        result.note("deterministic algorithms on (for the bitwise resume); tokens/s measured so")
    save = ctx.scratch / "pretrain_ckpt"
    full = _train(flags + ["--save", str(save), "--save-interval", str(half)])
    for line in full.lines:
        print(line, flush=True)
    result.figure("loss", f"{full.losses[0]:.4f} -> {full.losses[-1]:.4f}", "",
                  f"loss, iterations 1 -> {iterations}")
    rate = tokens_per_second(full.lines)
    result.figure("tokens_per_s", rate, "tok/s", f"tokens/s, iterations {half + 1}-{iterations}",
                  headline=True)
    if not ctx.enough_time(result, "resume from the checkpoint", 30.0 if ctx.cuda else 5.0):
        return
    only_half = ctx.scratch / "pretrain_ckpt_half"
    shutil.copytree(iteration_dir(save, half), iteration_dir(only_half, half))
    (only_half / LATEST_FILE).write_text(f"{half}\n")
    resumed = _train(flags + ["--load", str(only_half)])
    same = resumed.first_iteration == half and resumed.losses == full.losses[half:]
    result.check(f"resuming at iteration {half} gives the uninterrupted run's losses bitwise",
                 same, f"resumed at {resumed.first_iteration}: {resumed.losses[:3]} vs "
                       f"{full.losses[half:half + 3]}")


def _train(flags: list[str]) -> TrainResult:
    """One run as rank 0 of 1 in this process (NCCL on a GPU, gloo on CPU)."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        return train(parse_pretrain_args(flags, env={}), write=lambda line: None)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
