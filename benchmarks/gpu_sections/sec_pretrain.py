"""pretrain: ``megapipe pretrain --bf16`` as one rank (world size 1, NCCL on the GPU),
pp = ep = 1, 1f1b with the overlap on; bf16 with fp32 main weights, moments and gradients
(``MixedPrecisionAdamW``).

Three runs of the same 20 iterations, as a preempted job would see them:

1. uninterrupted, no checkpoint: the reference losses and the tokens/s of the log's last
   interval (iterations 11-20, past the warm-up);
2. ``--save DIR --exit-interval 10``: stops after iteration 10 through the exit flag, having
   saved its checkpoint there (whole-or-nothing, with its manifest);
3. ``--load DIR --save DIR``: resumes from that checkpoint (verified against its manifest) and
   runs iterations 11-20.

Checks: run 2 stops after iteration 10 with its checkpoint; its 10 losses equal the
uninterrupted run's bit for bit (the control: the same flags twice, so a difference here is
kernel non-determinism, not the checkpoint); run 3 says it resumed at iteration 10 and its
losses equal the uninterrupted run's bit for bit (the fp32 main weights and AdamW moments are
in the checkpoint). Every run uses ``--deterministic-mode`` (strict deterministic kernels: an
operation without one would be an error naming it; the runner sets ``CUBLAS_WORKSPACE_CONFIG``
for this section): fused attention's backward sums with atomics otherwise, so two runs differ in
the low bits whatever the checkpoint holds (the first GPU run, without it, saw exactly that).
The tokens/s are measured so.
"""

from __future__ import annotations

import os
import re

import torch.distributed as dist

from megapipe.parallel.launch import free_port
from megapipe.train.config.parse import parse_pretrain_args
from megapipe.train.loop import TrainResult, train

COMMON = ["--pipeline-model-parallel-size", "1", "--virtual-pipeline-model-parallel-size", "1",
          "--expert-model-parallel-size", "1", "--eval-interval", "0", "--deterministic-mode"]
REAL = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16",
        "--ffn-hidden-size", "4096", "--num-experts", "8", "--moe-router-topk", "2",
        "--moe-ffn-hidden-size", "1024", "--seq-length", "1024", "--micro-batch-size", "4",
        "--global-batch-size", "32", "--lr-warmup-iters", "5"]
DRY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
       "--ffn-hidden-size", "64", "--moe-ffn-hidden-size", "32", "--seq-length", "32",
       "--micro-batch-size", "2", "--global-batch-size", "8", "--lr-warmup-iters", "2"]
DRY_DATA = "megapipe"  # the package's own source as the corpus: quicker to load than the stdlib
_TOKENS_PER_S = re.compile(r"([\d,]+) tok/s")


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
    flags += ["--train-iters", str(iterations), "--log-interval", str(half), "--bf16"]
    result.figure("flags", " ".join(flags))
    result.note("--deterministic-mode on (for the bitwise resume); tokens/s measured so")
    full = _train(flags)
    for line in full.lines:
        print(line, flush=True)
    result.figure("loss", f"{full.losses[0]:.4f} -> {full.losses[-1]:.4f}", "",
                  f"loss, iterations 1 -> {iterations}")
    rate = tokens_per_second(full.lines)
    result.figure("tokens_per_s", rate, "tok/s", f"tokens/s, iterations {half + 1}-{iterations}",
                  headline=True)
    if not ctx.enough_time(result, "save, exit and resume", 40.0 if ctx.cuda else 5.0):
        return
    save = str(ctx.scratch / "pretrain_ckpt")
    stopped = _train(flags + ["--save", save, "--exit-interval", str(half)])
    result.check(f"--exit-interval {half} saves and stops after iteration {half}",
                 stopped.exit_reason is not None and len(stopped.saved) == 1
                 and len(stopped.losses) == half,
                 f"stopped: {stopped.exit_reason}; saved {stopped.saved}; "
                 f"{len(stopped.losses)} iterations")
    result.check(f"control: its {half} losses equal the uninterrupted run's bitwise (the same "
                 "flags twice; a difference is kernel non-determinism, not the checkpoint)",
                 stopped.losses == full.losses[:half],
                 f"{stopped.losses[-2:]} vs {full.losses[half - 2:half]}")
    resumed = _train(flags + ["--load", save, "--save", save])
    for line in resumed.lines[:3]:
        print(line, flush=True)
    result.check(f"resuming at iteration {half} gives the uninterrupted run's losses bitwise "
                 "(bf16, fp32 main weights and moments from the checkpoint)",
                 resumed.first_iteration == half and resumed.losses == full.losses[half:],
                 f"resumed at {resumed.first_iteration}: {resumed.losses[:3]} vs "
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
