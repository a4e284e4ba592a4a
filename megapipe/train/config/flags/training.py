"""The training's flags: precision, the batch, the learning rate and the optimizer, the garbage
collector, activation recompute (``--help`` groups "precision", "training", "activation
recompute").
"""

from __future__ import annotations

from dataclasses import dataclass

from megapipe.train.config.declare import COUNT, POSITIVE, finite, flag, one_of
from megapipe.train.config.flag_checks import no_fp16

PRECISION, TRAINING, RECOMPUTE = "precision", "training", "activation recompute"  # --help groups
LR_DECAY_STYLES = ("cosine", "linear", "constant")


@dataclass(frozen=True)
class PrecisionFlags:
    """bf16 with fp32 main weights; deterministic kernels."""

    bf16: bool = flag(
        False,
        "bf16 parameters and activations; fp32 main weights, AdamW moments "
        "and gradient accumulation/reduction",
        group=PRECISION,
    )
    fp16: bool = flag(
        False, "not supported (one clear error): use --bf16", no_fp16, group=PRECISION
    )
    deterministic_mode: bool = flag(
        False,
        "deterministic kernels only (torch's deterministic algorithms, deterministic "
        "fused-attention backward, cuBLAS workspace setting), so a GPU run repeats bit for bit "
        "and a resume equals the uninterrupted run; an operation without a deterministic kernel "
        "is an error",
        group=PRECISION,
    )


@dataclass(frozen=True)
class TrainingFlags:
    """Batches, iterations, the learning rate schedule, AdamW, the seed, the garbage collector."""

    micro_batch_size: int = flag(4, "samples per microbatch", POSITIVE, group=TRAINING)
    global_batch_size: int = flag(
        32,
        "samples per iteration (microbatches per step = global / (micro x dp))",
        POSITIVE,
        group=TRAINING,
    )
    train_iters: int = flag(100, "optimizer steps", POSITIVE, group=TRAINING)
    lr: float = flag(3e-3, "peak learning rate", finite, group=TRAINING)
    min_lr: float = flag(3e-4, "final learning rate", finite, group=TRAINING)
    lr_warmup_iters: int = flag(10, "linear warm-up from 0", COUNT, group=TRAINING)
    lr_decay_iters: int | None = flag(
        None,
        "iteration at which the decay reaches --min-lr (default: train-iters)",
        POSITIVE,
        group=TRAINING,
    )
    lr_decay_style: str = flag(
        "cosine", f"one of {', '.join(LR_DECAY_STYLES)}", one_of(*LR_DECAY_STYLES), group=TRAINING
    )
    weight_decay: float = flag(0.01, "AdamW weight decay", finite, group=TRAINING)
    clip_grad: float = flag(1.0, "0 disables clipping", finite, group=TRAINING)
    seed: int = flag(1234, "model initialisation and data sampling", group=TRAINING)
    manual_gc: bool = flag(
        False,
        "turn Python's automatic garbage collection off for the run and collect at the "
        "same point of the loop on every rank instead (--manual-gc-interval, evaluations)",
        group=TRAINING,
    )
    manual_gc_interval: int = flag(
        0,
        "with --manual-gc: collect after every N-th iteration (0: never between iterations)",
        COUNT,
        group=TRAINING,
        metavar="N",
    )
    manual_gc_eval: bool = flag(
        True,
        "with --manual-gc: collect before and after each evaluation "
        "(--no-manual-gc-eval: not there)",
        group=TRAINING,
    )
    heap_trim_interval: int = flag(
        100,
        "hand the C heap's free pages back to the system (glibc malloc_trim) after every "
        "N-th iteration, on every rank, glibc's mmap threshold pinned at 128 KiB from the start "
        "(0: glibc left as it is; megapipe's, not Megatron's)",
        COUNT,
        group=TRAINING,
        metavar="N",
    )


@dataclass(frozen=True)
class RecomputeFlags:
    """Which activations are recomputed in the backward instead of kept."""

    recompute_granularity: str | None = flag(
        None,
        "selective: recompute --recompute-modules inside their node's backward; full: "
        "whole layers, every compute node keeping only its inputs and running again in its own "
        "backward (the all-to-alls never run again)",
        group=RECOMPUTE,
        choices=("full", "selective"),
    )
    recompute_method: str | None = flag(
        None,
        "with --recompute-granularity full: uniform recomputes every layer of each "
        "pipeline chunk, in groups of --recompute-num-layers (a group keeps no layer output "
        "inside it); block recomputes the first --recompute-num-layers layers of each chunk",
        group=RECOMPUTE,
        choices=("uniform", "block"),
    )
    recompute_num_layers: int | None = flag(
        None,
        "with --recompute-granularity full: layers per uniform group, or layers "
        "recomputed per chunk with block (default 1)",
        POSITIVE,
        group=RECOMPUTE,
        metavar="N",
    )
    recompute_modules: tuple[str, ...] | None = flag(
        None,
        "with selective granularity: any of core_attn, moe_act (default: core_attn, as Megatron)",
        group=RECOMPUTE,
    )
