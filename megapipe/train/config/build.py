"""The config checked and built in one pass: each part made once, checked as it is made.

``job_config(flags, world_size)`` makes the parallel layout and checks the rules between flags
(``checks``), then reads the tokenizer once and checks the data against it (``checked_data``),
builds the model config once (``checked_model``), the schedule once (and the stages it gives),
and checks CUDA graphs against those two. Every refusal is an ``ArgsError`` of one line, raised
before any process group exists; the parts returned are the ones checked, and every derived
value (dp, the schedule's name and microbatches, the bucket size, the padded vocabulary) is
computed in this pass and nowhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING

from megapipe.schedule import Kind, ScheduleError
from megapipe.schedule.registry import default_schedule_name
from megapipe.train.config.checked_data import tokenizer_and_data
from megapipe.train.config.checked_model import model_config
from megapipe.train.config.checks import check_flags
from megapipe.train.config.declare import ArgsError
from megapipe.train.config.flag_checks import HIGH_PRIORITY_GROUPS
from megapipe.train.config.flags import PretrainFlags
from megapipe.train.config.job_config import (
    CheckpointConfig,
    CollectorConfig,
    DataParallelConfig,
    FailureConfig,
    GraphConfig,
    JobConfig,
    LoggingConfig,
    OptimizerConfig,
    OverlapConfig,
    PrecisionConfig,
    ScheduleConfig,
)

if TYPE_CHECKING:  # the model and process-group modules import torch; the CLI stays light
    from megapipe.models.config import GPTConfig
    from megapipe.parallel.config import ParallelConfig
    from megapipe.schedule import Schedule


def job_config(f: PretrainFlags, world_size: int, vocab_size: int | None = None) -> JobConfig:
    """The checked typed parts of ``f`` for ``world_size`` ranks (module docstring); the model's
    vocabulary is ``vocab_size`` when given (``--load-hf``'s), else the tokenizer's padded."""
    parallel = _parallel(f, world_size)
    check_flags(f, parallel)
    tokenizer, data = tokenizer_and_data(f, vocab_size)
    model = model_config(f, tokenizer.padded_vocab_size)
    schedule_config, schedule = _schedule(f, parallel)
    graphs = _graphs(f, model, schedule)
    return JobConfig(
        seed=f.seed,
        train_iters=f.train_iters,
        parallel=parallel,
        schedule=schedule_config,
        overlap=_overlap(f),
        model=model,
        tokenizer=tokenizer,
        optimizer=OptimizerConfig(
            f.lr,
            f.min_lr,
            f.lr_warmup_iters,
            f.lr_decay_iters or f.train_iters,
            f.lr_decay_style,
            f.weight_decay,
            f.clip_grad,
        ),
        precision=PrecisionConfig(f.bf16, f.deterministic_mode),
        data_parallel=DataParallelConfig(
            f.overlap_grad_reduce,
            f.use_distributed_optimizer,
            f.overlap_param_gather,
            bucket_size(f, parallel.dp),
            f.dp_emulated_link_gbps,
        ),
        data=data,
        checkpoint=CheckpointConfig(f.save, f.load, f.save_interval, f.keep_last, f.load_hf),
        logging=LoggingConfig(
            f.log_interval,
            f.tensorboard_dir,
            f.log_activation_memory,
            f.profile_trace,
            f.profile_step_start,
            f.profile_step_end or f.profile_step_start,
            f.use_pytorch_profiler,
        ),
        failures=FailureConfig(
            timedelta(minutes=f.distributed_timeout_minutes),
            f.exit_signal_handler,
            f.exit_interval,
            f.exit_duration_in_mins,
        ),
        graphs=graphs,
        collector=CollectorConfig(
            f.manual_gc, f.manual_gc_interval, f.manual_gc_eval, f.heap_trim_interval
        ),
    )


def _overlap(f: PretrainFlags) -> OverlapConfig:
    """The combined step's part; the high-priority groups in megapipe's names."""
    high_priority = tuple(HIGH_PRIORITY_GROUPS[g] for g in f.high_priority_stream_groups)
    return OverlapConfig(
        f.overlap_moe_expert_parallel_comm,
        f.delay_wgrad_compute,
        f.moe_a2a_waves,
        high_priority,
        f.overlap_moe_expert_parallel_comm_auto,
        f.overlap_auto_interval,
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

    pp, vpp, ep = (
        f.pipeline_model_parallel_size,
        f.virtual_pipeline_model_parallel_size or 1,
        f.expert_model_parallel_size,
    )
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


def _schedule(f: PretrainFlags, parallel: ParallelConfig) -> tuple[ScheduleConfig, Schedule]:
    """The schedule to run (the flag, or Megatron's default for pp and vpp), built once; every
    stage gets layers, block recompute's N layers fit in the largest pipeline chunk, and tied
    embeddings run where they can."""
    from megapipe.models.split import split_layers

    pp, vpp = f.pipeline_model_parallel_size, f.virtual_pipeline_model_parallel_size or 1
    config = ScheduleConfig(
        f.pipeline_schedule or default_schedule_name(pp, vpp),
        pp,
        vpp,
        f.global_batch_size // (f.micro_batch_size * parallel.dp),
        f.overlap_moe_expert_parallel_comm,
        f.overlap_max_extra_in_flight,
    )
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
        raise ArgsError(
            f"{tied} with --pipeline-schedule {schedule.name}: each model part has "
            "two copies there; pass --untie-embeddings-and-output-weights"
        )
    if f.use_distributed_optimizer:
        raise ArgsError(
            f"{tied} with --use-distributed-optimizer: the two copies' gradients "
            "are sharded differently and are not summed; pass "
            "--untie-embeddings-and-output-weights"
        )
    if schedule.num_stages == 1 and f.overlap_moe_expert_parallel_comm:
        raise ArgsError(
            f"{tied} in a model of one stage with --overlap-moe-expert-parallel-"
            "comm: the combined step adds the weight's two gradients in another "
            "order than the plain step (not bitwise); untie them, or pass "
            "--no-overlap-moe-expert-parallel-comm"
        )


def _graphs(f: PretrainFlags, model: GPTConfig, schedule: Schedule) -> GraphConfig:
    """``--cuda-graph-impl`` / ``--cuda-graph-modules`` (or ``--cuda-graph-scope``) against the
    model's nodes and the schedule (``graphs.rules``)."""
    from megapipe.graphs.rules import (  # torch: only when flags are run
        coverage_problem,
        settings_problem,
        split_backward_problem,
    )

    if f.cuda_graph_modules and f.cuda_graph_scope:
        raise ArgsError(
            "--cuda-graph-scope is Megatron 0.16-0.17's name of --cuda-graph-modules: "
            "give one of them"
        )
    config = GraphConfig(f.cuda_graph_impl, f.cuda_graph_modules or f.cuda_graph_scope)
    problem = settings_problem(config.impl, config.modules)
    if problem is None and config.impl != "none":
        if f.recompute_granularity == "full":
            raise ArgsError(
                "--recompute-granularity full with --cuda-graph-impl local: a "
                "recomputed node runs its forward again inside its backward, so it "
                "is not captured (Megatron allows full recompute only with "
                "whole-iteration graphs)"
            )
        from megapipe.models.gpt import graph_holders

        split = any(
            c.kind is Kind.I for row in schedule.actions for a in row for c in a.computations()
        )
        problem = coverage_problem(
            config.modules, graph_holders(model)
        ) or split_backward_problem(  # auto runs plain steps too
            f"--pipeline-schedule {schedule.name}",
            split,
            f.overlap_moe_expert_parallel_comm and not f.overlap_moe_expert_parallel_comm_auto,
        )
    if problem is not None:
        raise ArgsError(problem)
    return config
