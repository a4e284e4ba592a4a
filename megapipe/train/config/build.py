"""The config checked and built in one pass: each part made once, checked as it is made.

``job_config(flags, world_size)`` makes the parallel layout and checks the rules between flags
(``checks``), then reads the tokenizer once and checks the data against it, builds the model
config once, the schedule once (and the stages it gives), and checks CUDA graphs against those
two. Every refusal is an ``ArgsError`` of one line, raised before any process group exists; the
parts returned are the ones checked, and every derived value (dp, the schedule's name and
microbatches, the bucket size, the padded vocabulary) is computed here and nowhere else.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING

from megapipe.schedule import Kind, ScheduleError
from megapipe.schedule.registry import default_schedule_name
from megapipe.train.config.checks import check_flags, selective_recompute_modules
from megapipe.train.config.declare import ArgsError
from megapipe.train.config.flag_checks import HIGH_PRIORITY_GROUPS, values_are_indexed
from megapipe.train.config.flags import PretrainFlags
from megapipe.train.config.job_config import (
    DEFAULT_SPLIT,
    CheckpointConfig,
    CollectorConfig,
    DataConfig,
    DataParallelConfig,
    FailureConfig,
    GraphConfig,
    JobConfig,
    LoggingConfig,
    OptimizerConfig,
    OverlapConfig,
    PrecisionConfig,
    ScheduleConfig,
    TokenizerConfig,
    emulated_link,
)

if TYPE_CHECKING:  # the model and process-group modules import torch; the CLI stays light
    from megapipe.data.tokenizer import Tokenizer
    from megapipe.models.config import GPTConfig
    from megapipe.parallel.config import ParallelConfig
    from megapipe.schedule import Schedule


def job_config(f: PretrainFlags, world_size: int, vocab_size: int | None = None) -> JobConfig:
    """The checked typed parts of ``f`` for ``world_size`` ranks (module docstring); the model's
    vocabulary is ``vocab_size`` when given (``--load-hf``'s), else the tokenizer's padded."""
    parallel = _parallel(f, world_size)
    check_flags(f, parallel)
    tokenizer, data = _tokenizer_and_data(f, vocab_size)
    model = _model(f, tokenizer.padded_vocab_size)
    schedule_config, schedule = _schedule(f, parallel)
    graphs = _graphs(f, model, schedule)
    high_priority = tuple(HIGH_PRIORITY_GROUPS[g] for g in f.high_priority_stream_groups)
    return JobConfig(
        seed=f.seed, train_iters=f.train_iters, parallel=parallel, schedule=schedule_config,
        overlap=OverlapConfig(f.overlap_moe_expert_parallel_comm, f.delay_wgrad_compute,
                              f.moe_a2a_waves, high_priority,
                              f.overlap_moe_expert_parallel_comm_auto, f.overlap_auto_interval),
        model=model, tokenizer=tokenizer,
        optimizer=OptimizerConfig(f.lr, f.min_lr, f.lr_warmup_iters,
                                  f.lr_decay_iters or f.train_iters, f.lr_decay_style,
                                  f.weight_decay, f.clip_grad),
        precision=PrecisionConfig(f.bf16, f.deterministic_mode),
        data_parallel=DataParallelConfig(
            f.overlap_grad_reduce, f.use_distributed_optimizer, f.overlap_param_gather,
            bucket_size(f, parallel.dp), f.dp_emulated_link_gbps),
        data=data,
        checkpoint=CheckpointConfig(f.save, f.load, f.save_interval, f.keep_last, f.load_hf),
        logging=LoggingConfig(f.log_interval, f.tensorboard_dir, f.log_activation_memory,
                              f.profile_trace, f.profile_step_start,
                              f.profile_step_end or f.profile_step_start, f.use_pytorch_profiler),
        failures=FailureConfig(timedelta(minutes=f.distributed_timeout_minutes),
                               f.exit_signal_handler, f.exit_interval, f.exit_duration_in_mins),
        graphs=graphs,
        collector=CollectorConfig(f.manual_gc, f.manual_gc_interval, f.manual_gc_eval,
                                  f.heap_trim_interval),
    )


def world_size_of(f: PretrainFlags, env: Mapping[str, str] | None = None) -> int:
    """The launcher's world size (torchrun, srun), else ``--nproc``, else pp x ep."""
    from megapipe.parallel.launch import launched_world_size  # torch: only when flags are run

    pp_ep = max(f.pipeline_model_parallel_size, 1) * max(f.expert_model_parallel_size, 1)
    return next(n for n in (launched_world_size(env), f.nproc, pp_ep) if n is not None)


def bucket_size(f: PretrainFlags, dp: int) -> int | None:
    """Elements per gradient bucket: the flag, else Megatron's max(40M, 1M x dp); None (one
    bucket per stage) without ``--overlap-grad-reduce``."""
    return (f.ddp_bucket_size or max(40_000_000, 1_000_000 * dp)) if f.overlap_grad_reduce else None


def _parallel(f: PretrainFlags, world_size: int) -> ParallelConfig:
    """pp, dp = world / pp and ep, fitting the world size, the experts and the global batch."""
    from megapipe.parallel.config import ParallelConfig

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
        parallel = ParallelConfig(pp=pp, dp=world_size // pp, ep=ep)
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


def _tokenizer_and_data(f: PretrainFlags, vocab_size: int | None
                        ) -> tuple[TokenizerConfig, DataConfig]:
    """The tokenizer, read once, and the data it reads (raw text: byte level; indexed:
    Megatron's files, splits that hold tokens, the type preprocess-data used). The model's
    vocabulary: ``vocab_size``, else the tokenizer's padded as Megatron pads it."""
    from megapipe.data.errors import DataError  # torch-free
    from megapipe.data.tokenizer import build_tokenizer, padded_vocab_size

    data = DataConfig(f.data_path, f.micro_batch_size, f.global_batch_size, f.eval_interval,
                      f.eval_iters, values_are_indexed(f.data_path), f.split or DEFAULT_SPLIT,
                      f.data_cache_path)
    kind = f.tokenizer_type or "ByteTokenizer"
    path = None if f.tokenizer_model is None else os.path.abspath(f.tokenizer_model)
    try:
        tokenizer = build_tokenizer(kind, path)
        if data.indexed:
            _check_indexed(f, data, tokenizer)
        else:
            _check_text(f)
    except DataError as err:
        raise ArgsError(str(err).splitlines()[0]) from None
    size = tokenizer.vocab_size
    padded = vocab_size or padded_vocab_size(size, f.make_vocab_size_divisible_by)
    return TokenizerConfig(kind, path, size, padded), data


def _check_text(f: PretrainFlags) -> None:
    """Raw text: read byte level, its own validation share, enough for two windows."""
    from megapipe.data.raw_text import check_corpus  # torch: only when flags are run

    if f.tokenizer_type not in (None, "ByteTokenizer"):
        raise ArgsError(f"--tokenizer-type {f.tokenizer_type} reads Megatron's indexed "
                        "datasets (megapipe preprocess-data makes them); raw text "
                        "--data-path files are read byte level (ByteTokenizer)")
    for flag, value in (("--split", f.split), ("--data-cache-path", f.data_cache_path)):
        if value is not None:
            raise ArgsError(f"{flag} {value} needs indexed datasets in --data-path "
                            "(raw text keeps its last 5% of windows for validation)")
    try:  # every --data-path names readable text, enough for two windows of seq-length + 1
        check_corpus(f.data_path, f.seq_length)
    except (OSError, ValueError) as err:
        raise ArgsError(str(err).splitlines()[0]) from None


def _check_indexed(f: PretrainFlags, data: DataConfig, tokenizer: Tokenizer) -> None:
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


def _model(f: PretrainFlags, vocab_size: int) -> GPTConfig:
    """The reference MoE GPT of ``vocab_size`` ids; one ArgsError line for a shape it cannot
    take."""
    from megapipe.models.config import GPTConfig

    first_dense, freq = parse_moe_layer_freq(f.moe_layer_freq, f.num_layers)
    full = f.recompute_granularity == "full"
    link = f.moe_emulated_link_gbps
    try:
        return GPTConfig(
            vocab_size=vocab_size, hidden_size=f.hidden_size, num_layers=f.num_layers,
            num_heads=f.num_attention_heads, seq_length=f.seq_length,
            ffn_hidden_size=f.ffn_hidden_size, num_experts=f.num_experts,
            moe_top_k=f.moe_router_topk, moe_ffn_hidden_size=f.moe_ffn_hidden_size,
            first_k_dense_layers=first_dense, moe_layer_freq=freq,
            moe_aux_loss_coeff=f.moe_aux_loss_coeff,
            moe_shared_expert_intermediate_size=f.moe_shared_expert_intermediate_size,
            moe_link=None if link is None else emulated_link(link, f.moe_emulated_link_latency_us),
            moe_capacity_factor=f.moe_expert_capacity_factor,
            moe_expert_rank_capacity_factor=f.moe_expert_rank_capacity_factor,
            moe_router_dtype=f.moe_router_dtype, moe_router_pre_softmax=f.moe_router_pre_softmax,
            recompute_modules=selective_recompute_modules(f),
            recompute_method=f.recompute_method if full else None,
            recompute_num_layers=(f.recompute_num_layers or 1) if full else 1, seed=f.seed,
            position_embedding_type=f.position_embedding_type, rotary_base=f.rotary_base,
            num_query_groups=(f.num_query_groups or 1) if f.group_query_attention else None,
            qk_layernorm=f.qk_layernorm, qk_layernorm_scope=f.qk_layernorm_scope,
            kv_channels=f.kv_channels, norm_eps=f.norm_epsilon,
            untie_embeddings_and_output_weights=f.untie_embeddings_and_output_weights,
        )
    except ValueError as err:
        raise ArgsError(str(err).splitlines()[0]) from None


def _schedule(f: PretrainFlags, parallel: ParallelConfig) -> tuple[ScheduleConfig, Schedule]:
    """The schedule to run (the flag, or Megatron's default for pp and vpp), built once; every
    stage gets layers, block recompute's N layers fit in the largest pipeline chunk, and tied
    embeddings run where they can."""
    from megapipe.models.split import split_layers

    pp, vpp = f.pipeline_model_parallel_size, f.virtual_pipeline_model_parallel_size or 1
    config = ScheduleConfig(f.pipeline_schedule or default_schedule_name(pp, vpp), pp, vpp,
                            f.global_batch_size // (f.micro_batch_size * parallel.dp),
                            f.overlap_moe_expert_parallel_comm, f.overlap_max_extra_in_flight)
    try:
        schedule = config.build()
    except ScheduleError as err:
        raise ArgsError(f"--pipeline-schedule {config.name}: {err}".splitlines()[0]) from None
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
    _check_tied_embeddings(f, schedule)
    return config, schedule


def _check_tied_embeddings(f: PretrainFlags, schedule: Schedule) -> None:
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


def _graphs(f: PretrainFlags, model: GPTConfig, schedule: Schedule) -> GraphConfig:
    """``--cuda-graph-impl`` / ``--cuda-graph-modules`` (or ``--cuda-graph-scope``) against the
    model's nodes and the schedule (``graphs.rules``)."""
    from megapipe.graphs.rules import (  # torch: only when flags are run
        coverage_problem,
        settings_problem,
        split_backward_problem,
    )

    if f.cuda_graph_modules and f.cuda_graph_scope:
        raise ArgsError("--cuda-graph-scope is Megatron 0.16-0.17's name of --cuda-graph-modules: "
                        "give one of them")
    config = GraphConfig(f.cuda_graph_impl, f.cuda_graph_modules or f.cuda_graph_scope)
    problem = settings_problem(config.impl, config.modules)
    if problem is None and config.impl != "none":
        if f.recompute_granularity == "full":
            raise ArgsError("--recompute-granularity full with --cuda-graph-impl local: a "
                            "recomputed node runs its forward again inside its backward, so it "
                            "is not captured (Megatron allows full recompute only with "
                            "whole-iteration graphs)")
        from megapipe.models.gpt import graph_holders

        split = any(c.kind is Kind.I for row in schedule.actions for a in row
                    for c in a.computations())
        problem = coverage_problem(config.modules, graph_holders(model)) or \
            split_backward_problem(  # auto runs plain steps too
                f"--pipeline-schedule {schedule.name}", split,
                f.overlap_moe_expert_parallel_comm and not f.overlap_moe_expert_parallel_comm_auto)
    if problem is not None:
        raise ArgsError(problem)
    return config


def parse_moe_layer_freq(value: str, num_layers: int) -> tuple[int, int]:
    """Megatron's --moe-layer-freq as (first_k_dense_layers, moe_layer_freq).

    An int N means layers 0, N, 2N, ... are MoE. A pattern ``[0,1,1,1]`` (one entry per layer,
    or ``([0]*1+[1]*3)``) must be dense layers first, then MoE every N layers.
    """
    text = value.strip()
    if re.fullmatch(r"\d+", text):
        freq = int(text)
        if freq < 1:
            raise ArgsError(f"--moe-layer-freq={value} must be >= 1")
        return 0, freq
    pattern = _expand_pattern(text)
    if pattern is None or len(pattern) != num_layers:
        raise ArgsError(
            f"--moe-layer-freq={value!r} must be an int or a 0/1 list with one entry per layer "
            f"(num_layers={num_layers})"
        )
    first = pattern.index(1) if 1 in pattern else num_layers
    moe = [i - first for i, v in enumerate(pattern) if v == 1]
    freq = moe[1] - moe[0] if len(moe) > 1 else 1
    rebuilt = [1 if i >= first and (i - first) % freq == 0 else 0 for i in range(num_layers)]
    if rebuilt != pattern:
        raise ArgsError(
            f"--moe-layer-freq={value!r}: only 'dense layers first, then MoE every N layers' "
            "patterns are supported"
        )
    return first, freq


def _expand_pattern(text: str) -> list[int] | None:
    """'[0,1,1]' or '([0]*1+[1]*3)' -> list of 0/1; None if it is neither form."""
    text = text.replace(" ", "")
    if re.fullmatch(r"\[[01](,[01])*\]", text):
        return [int(v) for v in text[1:-1].split(",")]
    inner = text[1:-1] if text.startswith("(") and text.endswith(")") else text
    out: list[int] = []
    for term in inner.split("+"):
        match = re.fullmatch(r"\[([01])\]\*(\d+)", term)
        if match is None:
            return None
        out.extend([int(match.group(1))] * int(match.group(2)))
    return out
