"""The rules between pretrain flags, checked before any process group starts.

Each flag's own checks (ranges, choices) are in its declaration (``flags``) and ran while
parsing; ``validate(flags, world_size)`` then checks every rule that involves several flags and
raises ``ArgsError`` with one line naming the values and the rule. The rules reuse
``ParallelConfig``, ``GPTConfig`` and ``build_schedule``'s own checks through ``job_config``'s
part builders, so each rule and each derived value lives in one place.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from megapipe.schedule import Kind, ScheduleError
from megapipe.train.config.declare import ArgsError
from megapipe.train.config.flags import PretrainFlags
from megapipe.train.config.job_config import (
    model_config, parallel_config, schedule_config, selective_recompute_modules,
)

if TYPE_CHECKING:  # the process-group modules import torch; the CLI stays light
    from megapipe.data.tokenizer import Tokenizer
    from megapipe.parallel.config import ParallelConfig
    from megapipe.schedule import Schedule
    from megapipe.train.config.job_config import DataConfig


def validate(f: PretrainFlags, world_size: int) -> None:
    """Every rule between flags the run depends on (module docstring)."""
    _check_numbers(f)
    parallel = _check_parallel(f, world_size)
    _check_data_parallel(f, parallel)
    _check_overlap_budget(f)
    _check_overlap_auto(f)
    _check_rank_capacity(f)
    _check_recompute(f)
    _check_attention(f)
    vocab = check_data(f)
    schedule = _check_model_and_schedule(f, parallel, vocab)
    _check_tied_embeddings(f, schedule)
    if f.moe_pad_expert_input_to_capacity and f.moe_expert_capacity_factor is None:
        raise ArgsError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    _check_options_and_paths(f, parallel)
    _check_profiling(f)
    _check_cuda_graphs(f, parallel, vocab)
    if not f.manual_gc and (f.manual_gc_interval or not f.manual_gc_eval):
        used = f"--manual-gc-interval={f.manual_gc_interval}" if f.manual_gc_interval \
            else "--no-manual-gc-eval"
        raise ArgsError(f"{used} needs --manual-gc (without it Python's automatic garbage "
                        "collector runs and the flag would change nothing)")


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


def _check_profiling(f: PretrainFlags) -> None:
    """The traced iterations lie in 1..train-iters in order; the trace file can be written."""
    if f.use_pytorch_profiler and f.profile_trace is None:
        raise ArgsError("--use-pytorch-profiler needs --profile-trace FILE (its traces are "
                        "written next to that file)")
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
        raise ArgsError(f"{flag}={last} is beyond --train-iters={f.train_iters}: that "
                        "iteration never runs")
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


def _check_parallel(f: PretrainFlags, world_size: int) -> ParallelConfig:
    """pp, vpp, ep and dp fit the world size, the experts and the global batch."""
    pp, vpp, ep = (f.pipeline_model_parallel_size, f.virtual_pipeline_model_parallel_size or 1,
                   f.expert_model_parallel_size)
    if vpp > 1 and pp == 1:
        raise ArgsError(
            f"--virtual-pipeline-model-parallel-size={vpp} needs --pipeline-model-parallel-size > 1"
        )
    if world_size % pp != 0:
        raise ArgsError(
            f"world size {world_size} is not divisible by --pipeline-model-parallel-size={pp}"
        )
    try:
        parallel = parallel_config(f, world_size)
    except ValueError as err:
        raise ArgsError(f"--expert-model-parallel-size={ep}: {err}") from None
    if f.num_experts == 0 and ep > 1:
        raise ArgsError(f"--expert-model-parallel-size={ep} needs --num-experts > 0")
    if f.num_experts and f.num_experts % ep != 0:
        raise ArgsError(
            f"--num-experts={f.num_experts} must be divisible by --expert-model-parallel-size={ep}"
        )
    per_step = f.micro_batch_size * parallel.dp
    if f.global_batch_size % per_step != 0:
        raise ArgsError(
            f"--global-batch-size={f.global_batch_size} is not divisible by "
            f"--micro-batch-size x dp = {f.micro_batch_size} x {parallel.dp} = {per_step}"
        )
    return parallel


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
            raise ArgsError(f"--overlap-auto-interval={interval} needs "
                            "--overlap-moe-expert-parallel-comm-auto")
        return
    auto = "--overlap-moe-expert-parallel-comm-auto"
    from megapipe.pipeline.overlap_auto import TRIAL  # torch: only when the flag is given

    if 0 < interval < len(TRIAL):
        raise ArgsError(f"--overlap-auto-interval={interval} is shorter than one timing trial "
                        f"({len(TRIAL)} iterations); use 0 (time once) or at least {len(TRIAL)}")
    only_combined = [(name, on) for name, on in (
        ("--no-overlap-moe-expert-parallel-comm", not f.overlap_moe_expert_parallel_comm),
        ("--delay-wgrad-compute", f.delay_wgrad_compute),
        (f"--moe-a2a-waves={f.moe_a2a_waves}", f.moe_a2a_waves > 1),
        (f"--overlap-max-extra-in-flight={f.overlap_max_extra_in_flight}",
         f.overlap_max_extra_in_flight is not None),
        ("--profile-trace", f.profile_trace is not None),
    ) if on]
    if only_combined:
        name = only_combined[0][0]
        raise ArgsError(f"{auto} with {name}: auto chooses between the plain and the combined "
                        "step, which must differ in nothing else (and a profile traces one "
                        "schedule); drop one of the two")


def _check_rank_capacity(f: PretrainFlags) -> None:
    """``--moe-expert-rank-capacity-factor`` (``moe.rank_capacity``): dropless, one all-to-all
    per node, a step that can run again, experts on the grouped GEMM kernel."""
    factor = f.moe_expert_rank_capacity_factor
    if factor is None:
        return
    name = f"--moe-expert-rank-capacity-factor={factor:g}"
    for other, on in (
        (f"--moe-expert-capacity-factor={f.moe_expert_capacity_factor}",
         f.moe_expert_capacity_factor is not None),
        (f"--moe-a2a-waves={f.moe_a2a_waves}", f.moe_a2a_waves > 1),
        ("--overlap-grad-reduce", f.overlap_grad_reduce),
        ("--use-distributed-optimizer", f.use_distributed_optimizer),
    ):
        if on:
            raise ArgsError(
                f"{name} with {other}: not supported (the rank capacity keeps the layer "
                "dropless in one all-to-all per node, and a step that overflows runs again, "
                "which bucketed gradient reductions already issued would not undo)")
    row_bytes = 2 if f.bf16 else 4
    for flag_name, size in (("--hidden-size", f.hidden_size),
                            ("--moe-ffn-hidden-size", f.moe_ffn_hidden_size)):
        if size is not None and size * row_bytes % 16:
            raise ArgsError(
                f"{name} needs {flag_name} x {row_bytes} bytes to be a multiple of 16 (got "
                f"{size}): its experts run on torch's grouped GEMM, which reads no host counts")


def _check_recompute(f: PretrainFlags) -> None:
    """Recompute flags that go together (Megatron's rules)."""
    full = f.recompute_granularity == "full"
    if full and f.recompute_method is None:
        raise ArgsError("--recompute-granularity full needs --recompute-method uniform or block")
    for flag, value in (("--recompute-method", f.recompute_method),
                        ("--recompute-num-layers", f.recompute_num_layers)):
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
        raise ArgsError(f"--num-query-groups={groups} must divide --num-attention-heads="
                        f"{f.num_attention_heads} (each key/value head serves as many query "
                        "heads; --no-group-query-attention: one per query head)")


def check_data(f: PretrainFlags) -> int:
    """The tokenizer reads, the data fits it (raw text: byte level; indexed: Megatron's files,
    splits that hold tokens, the type preprocess-data used); returns the model's (padded)
    vocabulary. One ArgsError line otherwise."""
    from megapipe.data.errors import DataError  # torch-free
    from megapipe.train.config.job_config import data_config, tokenizer_config

    data = data_config(f)
    try:
        tokenizer = tokenizer_config(f)
        if data.indexed:
            _check_indexed(f, data, tokenizer.build())
        elif f.tokenizer_type not in (None, "ByteTokenizer"):
            raise ArgsError(f"--tokenizer-type {f.tokenizer_type} reads Megatron's indexed "
                            "datasets (megapipe preprocess-data makes them); raw text "
                            "--data-path files are read byte level (ByteTokenizer)")
        else:
            for flag, value in (("--split", f.split), ("--data-cache-path", f.data_cache_path)):
                if value is not None:
                    raise ArgsError(f"{flag} {value} needs indexed datasets in --data-path "
                                    "(raw text keeps its last 5% of windows for validation)")
    except DataError as err:
        raise ArgsError(str(err).splitlines()[0]) from None
    return tokenizer.padded_vocab_size


def _check_indexed(f: PretrainFlags, data: "DataConfig", tokenizer: "Tokenizer") -> None:
    """Megatron's dataset files and splits, before any process group (``check_gpt_data``)."""
    from megapipe.data.blend import parse_split
    from megapipe.data.gpt_samples import check_gpt_data, megatron_sample_counts

    if f.tokenizer_type is None:
        raise ArgsError("--data-path with indexed datasets needs --tokenizer-type (the one "
                        "preprocess-data used; with HuggingFaceTokenizer also --tokenizer-model)")
    if f.eval_interval and f.eval_iters and parse_split(data.split)[1] == 0:
        raise ArgsError(f"--split {data.split} gives validation no share but --eval-interval="
                        f"{f.eval_interval} evaluates (--eval-interval 0, or a share)")
    counts = megatron_sample_counts(f.train_iters, f.global_batch_size, f.eval_interval,
                                    f.eval_iters)
    check_gpt_data(data.paths, data.split, f.seq_length, f.seed, counts, tokenizer,
                   data.cache_path)


def _check_tied_embeddings(f: PretrainFlags, schedule: "Schedule") -> None:
    """What megapipe does not run with one weight for the embedding and the output layer."""
    if f.untie_embeddings_and_output_weights:
        return
    tied = "--no-untie-embeddings-and-output-weights (tied embeddings)"
    if schedule.bidirectional:
        raise ArgsError(f"{tied} with --pipeline-schedule {schedule.name}: each model part has "
                        "two copies there; pass --untie-embeddings-and-output-weights")
    if f.use_distributed_optimizer:
        raise ArgsError(f"{tied} with --use-distributed-optimizer: the two copies' gradients "
                        "are sharded differently and are not summed; pass "
                        "--untie-embeddings-and-output-weights")
    if schedule.num_stages == 1 and f.overlap_moe_expert_parallel_comm:
        raise ArgsError(f"{tied} in a model of one stage with --overlap-moe-expert-parallel-"
                        "comm: the combined step adds the weight's two gradients in another "
                        "order than the plain step (not bitwise); untie them, or pass "
                        "--no-overlap-moe-expert-parallel-comm")


def _check_model_and_schedule(f: PretrainFlags, parallel: ParallelConfig,
                              vocab: int) -> "Schedule":
    """The model builds, the schedule exists for this layout, and every stage gets layers;
    block recompute's N layers fit in a pipeline chunk (the largest one). Returns the
    schedule."""
    try:
        model_config(f, vocab)
    except ValueError as err:
        raise ArgsError(str(err).splitlines()[0]) from None
    config = schedule_config(f, parallel.dp)
    try:
        schedule = config.build()
    except ScheduleError as err:
        raise ArgsError(f"--pipeline-schedule {config.name}: {err}".splitlines()[0]) from None
    from megapipe.models.split import split_layers

    num_parts = schedule.num_stages // 2 if schedule.bidirectional else schedule.num_stages
    parts = split_layers(f.num_layers, num_parts)
    if any(len(r) == 0 for r in parts[1:-1]):
        raise ArgsError(
            f"--num-layers={f.num_layers} leaves a middle pipeline stage without layers "
            f"({num_parts} model parts for pp={config.pp}, vpp={config.vpp})"
        )
    most, layers = max(len(r) for r in parts), f.recompute_num_layers
    if f.recompute_method == "block" and layers is not None and layers > most:
        raise ArgsError(
            f"--recompute-num-layers={layers} exceeds the largest pipeline chunk's layers "
            f"({most}: --num-layers={f.num_layers} over {len(parts)} chunks); block "
            "recomputes the first N layers of each chunk"
        )
    return schedule


def _check_options_and_paths(f: PretrainFlags, parallel: ParallelConfig) -> None:
    """Flags that need each other, and the data files named (checkpoint folders: ``resume``)."""
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
    from megapipe.data.raw_text import check_corpus  # torch: only when flags are run
    from megapipe.train.config.job_config import data_config

    if data_config(f).indexed:
        return
    try:  # every --data-path names readable text, enough for two windows of seq-length + 1
        check_corpus(f.data_path, f.seq_length)
    except (OSError, ValueError) as err:
        raise ArgsError(str(err).splitlines()[0]) from None


def _check_cuda_graphs(f: PretrainFlags, parallel: ParallelConfig, vocab: int) -> None:
    """``--cuda-graph-impl`` / ``--cuda-graph-modules`` (or ``--cuda-graph-scope``) against the
    model's nodes and the schedule (``graphs.rules``)."""
    from megapipe.graphs.rules import (  # torch: only when flags are run
        coverage_problem, settings_problem, split_backward_problem,
    )

    if f.cuda_graph_modules and f.cuda_graph_scope:
        raise ArgsError("--cuda-graph-scope is Megatron 0.16-0.17's name of --cuda-graph-modules: "
                        "give one of them")
    modules = f.cuda_graph_modules or f.cuda_graph_scope
    problem = settings_problem(f.cuda_graph_impl, modules)
    if problem is not None:
        raise ArgsError(problem)
    if f.cuda_graph_impl == "none":
        return
    if f.recompute_granularity == "full":
        raise ArgsError("--recompute-granularity full with --cuda-graph-impl local: a recomputed "
                        "node runs its forward again inside its backward, so it is not captured "
                        "(Megatron allows full recompute only with whole-iteration graphs)")
    from megapipe.models.gpt import graph_holders

    problem = coverage_problem(modules, graph_holders(model_config(f, vocab)))
    schedule = schedule_config(f, parallel.dp).build()
    split = any(c.kind is Kind.I for row in schedule.actions for a in row
                for c in a.computations())
    problem = problem or split_backward_problem(  # auto runs plain steps too
        f"--pipeline-schedule {schedule.name}", split,
        f.overlap_moe_expert_parallel_comm and not f.overlap_moe_expert_parallel_comm_auto)
    if problem is not None:
        raise ArgsError(problem)
