"""Every rule a pretraining run depends on, checked before any process group starts.

``validate(args)`` raises ``ArgsError`` with one line naming the flag, the value and the rule.
The rules reuse ``ParallelConfig``, ``GPTConfig`` and ``build_schedule``'s own checks, so each
rule lives in one place.
"""

from __future__ import annotations

import math
import os

from megapipe.schedule import SCHEDULES, ScheduleError
from megapipe.train.args import ArgsError, PretrainArgs
from megapipe.train.flags import HIGH_PRIORITY_GROUPS, LR_DECAY_STYLES

FLOAT_FLAGS = ("lr", "min-lr", "weight-decay", "clip-grad", "moe-aux-loss-coeff",
               "moe-emulated-link-gbps", "moe-emulated-link-latency-us", "exit-duration-in-mins",
               "dp-emulated-link-gbps",
               "distributed-timeout-minutes")
"""Real-valued flags; NaN or infinity in any of them is refused up front."""


def _positive(name: str, value: int | None, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if value is not None and value < low:
        raise ArgsError(f"--{name}={value} must be >= {low}")


def validate(args: PretrainArgs) -> None:
    """Every rule the run depends on, checked before any process group starts."""
    _check_numbers(args)
    _check_parallel(args)
    _check_data_parallel(args)
    _check_overlap_budget(args)
    _check_recompute(args)
    _check_model_and_schedule(args)
    _check_precision_and_moe_options(args)
    _check_options_and_paths(args)
    _check_profiling(args)


def check_output_path(flag: str, path: str | None) -> None:
    """Fail before any work if ``path`` cannot be created as a file (None: nothing asked)."""
    if path is None:
        return
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise ArgsError(f"--{flag} {path}: folder {folder!r} does not exist")
    if os.path.isdir(path):
        raise ArgsError(f"--{flag} {path} is a directory; name a file to write")
    if not os.access(folder, os.W_OK):
        raise ArgsError(f"--{flag} {path}: folder {folder!r} is not writable")


def _check_profiling(args: PretrainArgs) -> None:
    """The traced iterations lie in 1..train-iters in order; the trace file can be written."""
    if args.use_pytorch_profiler and args.profile_trace is None:
        raise ArgsError("--use-pytorch-profiler needs --profile-trace FILE (its traces are "
                        "written next to that file)")
    if args.profile_trace is None:
        return
    start, end = args.profile_step_start, args.profile_step_end
    _positive("profile-step-start", start)
    if end is not None and end < start:
        raise ArgsError(f"--profile-step-start={start} is after --profile-step-end={end}")
    last = start if end is None else end
    if last > args.train_iters:
        flag = "--profile-step-start" if end is None else "--profile-step-end"
        raise ArgsError(f"{flag}={last} is beyond --train-iters={args.train_iters}: that "
                        "iteration never runs")
    check_output_path("profile-trace", args.profile_trace)


def _check_precision_and_moe_options(args: PretrainArgs) -> None:
    """Precision, router dtype, capacity and NCCL stream options."""
    if args.fp16:
        raise ArgsError(
            "--fp16 is not supported: megapipe trains in fp32 or with --bf16 (fp16 would need "
            "dynamic loss scaling, which megapipe does not implement)"
        )
    if args.moe_router_dtype not in (None, "fp32", "fp64"):
        raise ArgsError(f"--moe-router-dtype={args.moe_router_dtype!r} must be fp32 or fp64")
    factor = args.moe_expert_capacity_factor
    if factor is not None and not factor > 0:
        raise ArgsError(f"--moe-expert-capacity-factor={factor} must be > 0")
    if args.moe_pad_expert_input_to_capacity and factor is None:
        raise ArgsError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    unknown = [g for g in args.high_priority_stream_groups if g not in HIGH_PRIORITY_GROUPS]
    if unknown:
        raise ArgsError(
            f"--high-priority-stream-groups {' '.join(unknown)}: not a group; choose from "
            f"{', '.join(HIGH_PRIORITY_GROUPS)}"
        )


def _check_numbers(args: PretrainArgs) -> None:
    """Sizes, counts and rates in their ranges."""
    for name in ("num-layers", "hidden-size", "num-attention-heads", "ffn-hidden-size",
                 "seq-length", "micro-batch-size", "global-batch-size", "train-iters",
                 "pipeline-model-parallel-size", "expert-model-parallel-size",
                 "moe-ffn-hidden-size", "log-interval", "moe-router-topk"):
        _positive(name, getattr(args, name.replace("-", "_")))
    for name in ("lr-warmup-iters", "eval-iters", "eval-interval", "num-experts"):
        _positive(name, getattr(args, name.replace("-", "_")), allow_zero=True)
    _positive("save-interval", args.save_interval)
    _positive("keep-last", args.keep_last)
    _positive("exit-interval", args.exit_interval)
    for name in ("exit-duration-in-mins", "distributed-timeout-minutes"):
        value = getattr(args, name.replace("-", "_"))
        if value is not None and not value > 0:
            raise ArgsError(f"--{name}={value} must be > 0")
    _positive("lr-decay-iters", args.lr_decay_iters)
    _positive("nproc", args.nproc)
    _positive("virtual-pipeline-model-parallel-size", args.virtual_pipeline_model_parallel_size)
    for name in FLOAT_FLAGS:
        value = getattr(args, name.replace("-", "_"))
        if value is not None and not math.isfinite(value):
            raise ArgsError(f"--{name}={value} must be a finite number")
    if not (args.lr > 0 and 0 <= args.min_lr <= args.lr):
        raise ArgsError(f"need 0 <= --min-lr={args.min_lr} <= --lr={args.lr} and --lr > 0")
    if not (args.weight_decay >= 0 and args.clip_grad >= 0 and args.moe_aux_loss_coeff >= 0):
        raise ArgsError(
            f"--weight-decay={args.weight_decay}, --clip-grad={args.clip_grad} and "
            f"--moe-aux-loss-coeff={args.moe_aux_loss_coeff} must be >= 0"
        )
    if args.moe_emulated_link_gbps is not None and not args.moe_emulated_link_gbps > 0:
        raise ArgsError(f"--moe-emulated-link-gbps={args.moe_emulated_link_gbps:g} must be > 0")
    if not args.moe_emulated_link_latency_us >= 0:
        raise ArgsError(
            f"--moe-emulated-link-latency-us={args.moe_emulated_link_latency_us:g} must be >= 0"
        )
    if args.lr_decay_style not in LR_DECAY_STYLES:
        raise ArgsError(
            f"--lr-decay-style={args.lr_decay_style!r} must be one of {', '.join(LR_DECAY_STYLES)}"
        )


def _check_parallel(args: PretrainArgs) -> None:
    """pp, vpp, ep and dp fit the world size, the experts and the global batch."""
    if args.vpp > 1 and args.pp == 1:
        raise ArgsError(
            f"--virtual-pipeline-model-parallel-size={args.vpp} needs "
            "--pipeline-model-parallel-size > 1"
        )
    if args.world_size % args.pp != 0:
        raise ArgsError(
            f"world size {args.world_size} is not divisible by "
            f"--pipeline-model-parallel-size={args.pp}"
        )
    try:
        args.parallel
    except ValueError as err:
        raise ArgsError(f"--expert-model-parallel-size={args.ep}: {err}") from None
    if args.num_experts == 0 and args.ep > 1:
        raise ArgsError(f"--expert-model-parallel-size={args.ep} needs --num-experts > 0")
    if args.num_experts and args.num_experts % args.ep != 0:
        raise ArgsError(
            f"--num-experts={args.num_experts} must be divisible by "
            f"--expert-model-parallel-size={args.ep}"
        )
    per_step = args.micro_batch_size * args.dp
    if args.global_batch_size % per_step != 0:
        raise ArgsError(
            f"--global-batch-size={args.global_batch_size} is not divisible by "
            f"--micro-batch-size x dp = {args.micro_batch_size} x {args.dp} = {per_step}"
        )


def _check_data_parallel(args: PretrainArgs) -> None:
    """Megatron's rules for the distributed optimizer and its overlaps, and the bucket size."""
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise ArgsError(
            "--overlap-param-gather needs --use-distributed-optimizer (without it every rank "
            "holds the whole updated model and nothing is gathered)"
        )
    if args.overlap_param_gather and not args.overlap_grad_reduce:
        raise ArgsError("--overlap-param-gather needs --overlap-grad-reduce (Megatron's rule)")
    link = args.dp_emulated_link_gbps
    if link is not None and not link > 0:
        raise ArgsError(f"--dp-emulated-link-gbps={link:g} must be > 0")
    if link is not None and not args.flat_grad_buffers:
        raise ArgsError(
            f"--dp-emulated-link-gbps={link:g} needs --overlap-grad-reduce or "
            "--use-distributed-optimizer (it slows their bucketed collectives)"
        )
    size = args.ddp_bucket_size
    if size is None:
        return
    if not args.overlap_grad_reduce:
        raise ArgsError(
            f"--ddp-bucket-size={size} needs --overlap-grad-reduce (without it each stage's "
            "gradients reduce after the step, in one bucket)"
        )
    from megapipe.train.grad_buffers import ALIGN  # torch: only when the flag is given

    least = ALIGN * args.dp
    if size < least:
        raise ArgsError(
            f"--ddp-bucket-size={size} is too small: every bucket is one collective per step "
            f"and is padded so that each of the dp={args.dp} ranks' shards holds a multiple "
            f"of {ALIGN} elements; use at least {ALIGN} x dp = {least}"
        )


def _check_overlap_budget(args: PretrainArgs) -> None:
    """The in-flight budget is an integer >= 0 and comes with the overlap it bounds."""
    budget = args.overlap_max_extra_in_flight
    if budget is not None and budget < 0:
        raise ArgsError(f"--overlap-max-extra-in-flight={budget} must be >= 0")
    if budget is not None and not args.overlap_moe_expert_parallel_comm:
        raise ArgsError(
            f"--overlap-max-extra-in-flight={budget} needs --overlap-moe-expert-parallel-comm "
            "(the budget bounds what the overlap pass adds)"
        )


def _check_recompute(args: PretrainArgs) -> None:
    """Recompute flags that go together (Megatron's rules)."""
    full = args.recompute_granularity == "full"
    if full and args.recompute_method is None:
        raise ArgsError("--recompute-granularity full needs --recompute-method uniform or block")
    for flag, value in (("--recompute-method", args.recompute_method),
                        ("--recompute-num-layers", args.recompute_num_layers)):
        if value is not None and not full:
            raise ArgsError(f"{flag}={value} needs --recompute-granularity full")
    layers = args.recompute_num_layers
    if layers is not None and layers < 1:
        raise ArgsError(f"--recompute-num-layers={layers} must be >= 1")
    if args.recompute_modules is not None and args.recompute_granularity != "selective":
        raise ArgsError("--recompute-modules needs --recompute-granularity selective")
    from megapipe.overlap.recompute import check_recompute_modules  # torch: when flags run

    try:
        check_recompute_modules(args.selective_recompute_modules)
    except ValueError as err:
        raise ArgsError(f"--recompute-modules: {err}") from None


def _check_block_recompute(args: PretrainArgs, parts: list[range]) -> None:
    """Block recompute's N layers must fit in a pipeline chunk (the largest one)."""
    most = max(len(r) for r in parts)
    layers = args.recompute_num_layers
    if args.recompute_method == "block" and layers is not None and layers > most:
        raise ArgsError(
            f"--recompute-num-layers={layers} exceeds the largest pipeline chunk's layers "
            f"({most}: --num-layers={args.num_layers} over {len(parts)} chunks); block "
            "recomputes the first N layers of each chunk"
        )


def _check_model_and_schedule(args: PretrainArgs) -> None:
    """The model builds, the schedule exists for this layout, and every stage gets layers."""
    try:
        args.gpt_config()
    except ValueError as err:
        raise ArgsError(str(err).splitlines()[0]) from None
    if args.pipeline_schedule is not None and args.pipeline_schedule not in SCHEDULES:
        raise ArgsError(
            f"--pipeline-schedule={args.pipeline_schedule!r} is unknown; known: "
            f"{', '.join(SCHEDULES)}"
        )
    try:
        schedule = args.build_schedule()
    except ScheduleError as err:
        message = f"--pipeline-schedule {args.schedule_name}: {err}".splitlines()[0]
        raise ArgsError(message) from None
    from megapipe.models.split import split_layers

    num_parts = schedule.num_stages // 2 if schedule.bidirectional else schedule.num_stages
    parts = split_layers(args.num_layers, num_parts)
    if any(len(r) == 0 for r in parts[1:-1]):
        raise ArgsError(
            f"--num-layers={args.num_layers} leaves a middle pipeline stage without layers "
            f"({num_parts} model parts for pp={args.pp}, vpp={args.vpp})"
        )
    _check_block_recompute(args, parts)


def _check_options_and_paths(args: PretrainArgs) -> None:
    """Flags that need each other, and the data files named (checkpoint folders: ``resume``)."""
    if args.moe_a2a_chunks < 1:
        raise ArgsError(f"--moe-a2a-chunks={args.moe_a2a_chunks} must be >= 1")
    if args.moe_a2a_chunks > 1 and not args.overlap_moe_expert_parallel_comm:
        raise ArgsError(
            f"--moe-a2a-chunks={args.moe_a2a_chunks} needs --overlap-moe-expert-parallel-comm "
            "(the chunks overlap each other on the combined step's streams)"
        )
    local = args.num_experts // args.ep if args.num_experts else 0
    if args.moe_a2a_chunks > 1 and args.moe_a2a_chunks > local:
        raise ArgsError(
            f"--moe-a2a-chunks={args.moe_a2a_chunks} exceeds the {local} experts each EP rank "
            f"holds (--num-experts={args.num_experts} / ep={args.ep}): chunks split a rank's "
            "experts into groups"
        )
    if args.delay_wgrad_compute and not args.overlap_moe_expert_parallel_comm:
        raise ArgsError(
            "--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm (the deferred weight "
            "gradients fill the combined step's backward all-to-all)"
        )
    for flag, value in (("--save-interval", args.save_interval), ("--keep-last", args.keep_last)):
        if value is not None and args.save is None:
            raise ArgsError(f"{flag} needs --save DIR")
    _check_data_paths(args)


def _check_data_paths(args: PretrainArgs) -> None:
    """Every --data-path names readable text, enough for two windows of seq-length + 1."""
    from megapipe.train.data import check_corpus  # torch: only when flags are run

    try:
        check_corpus(args.data_path, args.seq_length)
    except (OSError, ValueError) as err:
        raise ArgsError(str(err).splitlines()[0]) from None
