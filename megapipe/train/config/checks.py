"""The rules between pretrain flags that need no built part, checked before any process starts.

Each flag's own checks (ranges, choices) are in its declaration (``flags``) and ran while
parsing; ``check_flags(flags, parallel)`` checks the rules that involve several flags (and the
parallel layout) and raises ``ArgsError`` with one line naming the values and the rule. The rules
that need a built part (the tokenizer, the model, the schedule) are checked where the one-pass
build makes that part, once (``checked_data``, ``checked_model``, ``build``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megapipe.subcommand import writable_file
from megapipe.train.config.declare import ArgsError
from megapipe.train.config.flags import PretrainFlags

if TYPE_CHECKING:  # the process-group modules import torch; the CLI stays light
    from megapipe.parallel.config import ParallelConfig


def selective_recompute_modules(f: PretrainFlags) -> tuple[str, ...]:
    """The modules that recompute (selective granularity; Megatron's default core_attn)."""
    if f.recompute_granularity != "selective":
        return ()
    return ("core_attn",) if f.recompute_modules is None else f.recompute_modules


def check_flags(f: PretrainFlags, parallel: ParallelConfig) -> None:
    """Every rule between flags that needs no built part but the layout (module docstring)."""
    _check_numbers(f)
    _check_data_parallel(f, parallel)
    _check_overlap_budget(f)
    _check_overlap_auto(f)
    _check_rank_capacity(f)
    _check_recompute(f)
    _check_attention(f)
    if f.moe_pad_expert_input_to_capacity and f.moe_expert_capacity_factor is None:
        raise ArgsError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    _check_options(f, parallel)
    _check_profiling(f)
    if not f.manual_gc and (f.manual_gc_interval or not f.manual_gc_eval):
        used = (
            f"--manual-gc-interval={f.manual_gc_interval}"
            if f.manual_gc_interval
            else "--no-manual-gc-eval"
        )
        raise ArgsError(
            f"{used} needs --manual-gc (without it Python's automatic garbage "
            "collector runs and the flag would change nothing)"
        )


def check_output_path(flag: str, path: str | None) -> None:
    """Fail before any work if ``path`` cannot be created as a file (None: nothing asked)."""
    message = None if path is None else writable_file(f"--{flag}", path)
    if message:
        raise ArgsError(message)


def _check_profiling(f: PretrainFlags) -> None:
    """The traced iterations lie in 1..train-iters in order; the trace file can be written."""
    if f.use_pytorch_profiler and f.profile_trace is None:
        raise ArgsError(
            "--use-pytorch-profiler needs --profile-trace FILE (its traces are "
            "written next to that file)"
        )
    if f.profile_trace is None:
        return
    start, end = f.profile_step_start, f.profile_step_end
    if start < 1:
        raise ArgsError(f"--profile-step-start={start} must be >= 1")
    if end is not None and end < start:
        raise ArgsError(f"--profile-step-start={start} is after --profile-step-end={end}")
    last = start if end is None else end
    if last > f.train_iters:
        flag = "--profile-step-start" if end is None else "--profile-step-end"
        raise ArgsError(
            f"{flag}={last} is beyond --train-iters={f.train_iters}: that iteration never runs"
        )
    check_output_path("profile-trace", f.profile_trace)


def _check_numbers(f: PretrainFlags) -> None:
    """Learning rates, decay, clipping and the auxiliary loss in their ranges."""
    if not (f.lr > 0 and 0 <= f.min_lr <= f.lr):
        raise ArgsError(f"need 0 <= --min-lr={f.min_lr} <= --lr={f.lr} and --lr > 0")
    if not (f.weight_decay >= 0 and f.clip_grad >= 0 and f.moe_aux_loss_coeff >= 0):
        raise ArgsError(
            f"--weight-decay={f.weight_decay}, --clip-grad={f.clip_grad} and "
            f"--moe-aux-loss-coeff={f.moe_aux_loss_coeff} must be >= 0"
        )


def _check_data_parallel(f: PretrainFlags, parallel: ParallelConfig) -> None:
    """Megatron's rules for the distributed optimizer and its overlaps, and the bucket size."""
    if f.overlap_param_gather and not f.use_distributed_optimizer:
        raise ArgsError(
            "--overlap-param-gather needs --use-distributed-optimizer (without it every rank "
            "holds the whole updated model and nothing is gathered)"
        )
    if f.overlap_param_gather and not f.overlap_grad_reduce:
        raise ArgsError("--overlap-param-gather needs --overlap-grad-reduce (Megatron's rule)")
    link = f.dp_emulated_link_gbps
    if link is not None and not (f.overlap_grad_reduce or f.use_distributed_optimizer):
        raise ArgsError(
            f"--dp-emulated-link-gbps={link:g} needs --overlap-grad-reduce or "
            "--use-distributed-optimizer (it slows their bucketed collectives)"
        )
    size = f.ddp_bucket_size
    if size is None:
        return
    if not f.overlap_grad_reduce:
        raise ArgsError(
            f"--ddp-bucket-size={size} needs --overlap-grad-reduce (without it each stage's "
            "gradients reduce after the step, in one bucket)"
        )
    from megapipe.train.optim.grad_buffers import ALIGN  # torch: only when the flag is given

    least = ALIGN * parallel.dp
    if size < least:
        raise ArgsError(
            f"--ddp-bucket-size={size} is too small: every bucket is one collective per step "
            f"and is padded so that each of the dp={parallel.dp} ranks' shards holds a multiple "
            f"of {ALIGN} elements; use at least {ALIGN} x dp = {least}"
        )


def _check_overlap_budget(f: PretrainFlags) -> None:
    """The in-flight budget comes with the overlap it bounds."""
    budget = f.overlap_max_extra_in_flight
    if budget is not None and not f.overlap_moe_expert_parallel_comm:
        raise ArgsError(
            f"--overlap-max-extra-in-flight={budget} needs --overlap-moe-expert-parallel-comm "
            "(the budget bounds what the overlap pass adds)"
        )


def _check_overlap_auto(f: PretrainFlags) -> None:
    """Auto switches between the plain and the combined schedule: both must run the same
    model with the same bits, so options that exist in one mode only are refused."""
    interval = f.overlap_auto_interval
    if not f.overlap_moe_expert_parallel_comm_auto:
        if interval != PretrainFlags.overlap_auto_interval:
            raise ArgsError(
                f"--overlap-auto-interval={interval} needs --overlap-moe-expert-parallel-comm-auto"
            )
        return
    auto = "--overlap-moe-expert-parallel-comm-auto"
    from megapipe.pipeline.overlap_auto import TRIAL  # torch: only when the flag is given

    if 0 < interval < len(TRIAL):
        raise ArgsError(
            f"--overlap-auto-interval={interval} is shorter than one timing trial "
            f"({len(TRIAL)} iterations); use 0 (time once) or at least {len(TRIAL)}"
        )
    only_combined = [
        (name, on)
        for name, on in (
            ("--no-overlap-moe-expert-parallel-comm", not f.overlap_moe_expert_parallel_comm),
            ("--delay-wgrad-compute", f.delay_wgrad_compute),
            (f"--moe-a2a-waves={f.moe_a2a_waves}", f.moe_a2a_waves > 1),
            (
                f"--overlap-max-extra-in-flight={f.overlap_max_extra_in_flight}",
                f.overlap_max_extra_in_flight is not None,
            ),
            ("--profile-trace", f.profile_trace is not None),
        )
        if on
    ]
    if only_combined:
        name = only_combined[0][0]
        raise ArgsError(
            f"{auto} with {name}: auto chooses between the plain and the combined "
            "step, which must differ in nothing else (and a profile traces one "
            "schedule); drop one of the two"
        )


def _check_rank_capacity(f: PretrainFlags) -> None:
    """``--moe-expert-rank-capacity-factor`` (``moe.rank_capacity``): dropless, one all-to-all
    per node, a step that can run again, experts on the grouped GEMM kernel."""
    factor = f.moe_expert_rank_capacity_factor
    if factor is None:
        return
    name = f"--moe-expert-rank-capacity-factor={factor:g}"
    for other, on in (
        (
            f"--moe-expert-capacity-factor={f.moe_expert_capacity_factor}",
            f.moe_expert_capacity_factor is not None,
        ),
        (f"--moe-a2a-waves={f.moe_a2a_waves}", f.moe_a2a_waves > 1),
        ("--overlap-grad-reduce", f.overlap_grad_reduce),
        ("--use-distributed-optimizer", f.use_distributed_optimizer),
    ):
        if on:
            raise ArgsError(
                f"{name} with {other}: not supported (the rank capacity keeps the layer "
                "dropless in one all-to-all per node, and a step that overflows runs again, "
                "which bucketed gradient reductions already issued would not undo)"
            )
    row_bytes = 2 if f.bf16 else 4
    for flag_name, size in (
        ("--hidden-size", f.hidden_size),
        ("--moe-ffn-hidden-size", f.moe_ffn_hidden_size),
    ):
        if size is not None and size * row_bytes % 16:
            raise ArgsError(
                f"{name} needs {flag_name} x {row_bytes} bytes to be a multiple of 16 (got "
                f"{size}): its experts run on torch's grouped GEMM, which reads no host counts"
            )


def _check_recompute(f: PretrainFlags) -> None:
    """Recompute flags that go together (Megatron's rules)."""
    full = f.recompute_granularity == "full"
    if full and f.recompute_method is None:
        raise ArgsError("--recompute-granularity full needs --recompute-method uniform or block")
    for flag, value in (
        ("--recompute-method", f.recompute_method),
        ("--recompute-num-layers", f.recompute_num_layers),
    ):
        if value is not None and not full:
            raise ArgsError(f"{flag}={value} needs --recompute-granularity full")
    if f.recompute_modules is not None and f.recompute_granularity != "selective":
        raise ArgsError("--recompute-modules needs --recompute-granularity selective")
    from megapipe.recompute.function import check_recompute_modules  # torch: when flags run

    try:
        check_recompute_modules(selective_recompute_modules(f))
    except ValueError as err:
        raise ArgsError(f"--recompute-modules: {err}") from None


def _check_attention(f: PretrainFlags) -> None:
    """Grouped-query attention's groups divide the heads (without the switch
    ``--num-query-groups`` is ignored, as Megatron ignores it)."""
    groups = f.num_query_groups
    if f.group_query_attention and f.num_attention_heads % (groups or 1) != 0:
        raise ArgsError(
            f"--num-query-groups={groups} must divide --num-attention-heads="
            f"{f.num_attention_heads} (each key/value head serves as many query "
            "heads; --no-group-query-attention: one per query head)"
        )


def _check_options(f: PretrainFlags, parallel: ParallelConfig) -> None:
    """Flags that need each other: waves, deferred weight gradients, saving."""
    waves, overlap = f.moe_a2a_waves, f.overlap_moe_expert_parallel_comm
    if waves > 1 and not overlap:
        raise ArgsError(
            f"--moe-a2a-waves={waves} needs --overlap-moe-expert-parallel-comm (the waves "
            "overlap each other on the combined step's streams)"
        )
    local = f.num_experts // parallel.ep if f.num_experts else 0
    if waves > 1 and waves > local:
        raise ArgsError(
            f"--moe-a2a-waves={waves} exceeds the {local} experts each EP rank holds "
            f"(--num-experts={f.num_experts} / ep={parallel.ep}): waves split a rank's experts "
            "into groups"
        )
    if f.delay_wgrad_compute and not overlap:
        raise ArgsError(
            "--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm (the deferred weight "
            "gradients fill the combined step's backward all-to-all)"
        )
    for flag, value in (("--save-interval", f.save_interval), ("--keep-last", f.keep_last)):
        if value is not None and f.save is None:
            raise ArgsError(f"{flag} needs --save DIR")
