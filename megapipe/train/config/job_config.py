"""The training app's configuration: typed parts made once from the parsed flags.

``job_config(flags, world_size)`` turns ``PretrainFlags`` (every flag, flat, under Megatron's
names) into one small frozen part per concern, and computes every derived value (dp, the
schedule's name and microbatches, the bucket size, the model) here and nowhere else. After
parsing, the app reads only these parts (docs/pretraining.md lists which flag lands where).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Mapping

from megapipe.schedule.registry import default_schedule_name
from megapipe.train.config.declare import ArgsError
from megapipe.train.config.flags import HIGH_PRIORITY_GROUPS, PretrainFlags, values_are_indexed

if TYPE_CHECKING:  # the model and process-group modules import torch; the CLI stays light
    from megapipe.data.tokenizer import Tokenizer
    from megapipe.models.config import GPTConfig
    from megapipe.moe.link import EmulatedLink
    from megapipe.parallel.config import ParallelConfig
    from megapipe.schedule import Schedule

DEFAULT_SPLIT = "969,30,1"  # Megatron's --split


@dataclass(frozen=True)
class ScheduleConfig:
    """``--pipeline-schedule`` (or Megatron's default for pp and vpp), the sizes, the overlap."""

    name: str
    pp: int
    vpp: int
    num_microbatches: int
    overlap: bool
    max_extra_in_flight: int | None = None

    def build(self) -> "Schedule":
        from megapipe.schedule import build_schedule

        return build_schedule(self.name, self.pp, self.num_microbatches, self.vpp,
                              overlap=self.overlap, max_extra_in_flight=self.max_extra_in_flight)


@dataclass(frozen=True)
class OverlapConfig:
    """The combined step: on or off, deferred expert weight gradients, all-to-all waves, the
    node trace (the log's hidden and exposed all-to-all time), the process groups whose
    collectives go on a high-priority stream (megapipe's names); ``auto``: choose between plain
    and combined steps by timing both, again every ``auto_interval`` iterations
    (``pipeline.overlap_auto``)."""

    enabled: bool
    delay_wgrad_compute: bool = False
    moe_a2a_waves: int = 1
    high_priority_stream_groups: tuple[str, ...] = ()
    auto: bool = False
    auto_interval: int = 0

    @property
    def record_trace(self) -> bool:
        return self.enabled


@dataclass(frozen=True)
class GraphConfig:
    """CUDA graphs of static nodes (``graphs.nodes``): Megatron's ``--cuda-graph-impl`` and
    ``--cuda-graph-modules`` (or its older name ``--cuda-graph-scope``)."""

    impl: str = "none"
    modules: tuple[str, ...] = ()


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW; warm-up to ``lr``, then ``decay_style`` to ``min_lr`` at ``decay_end``; clipping."""

    lr: float
    min_lr: float
    warmup_iters: int
    decay_end: int
    decay_style: str
    weight_decay: float
    clip_grad: float


@dataclass(frozen=True)
class PrecisionConfig:
    """``--bf16`` (fp32 main weights, moments and gradients) and deterministic kernels."""

    bf16: bool = False
    deterministic: bool = False


@dataclass(frozen=True)
class DataParallelConfig:
    """Bucketed reductions and the distributed optimizer (``optim.dp_sync``); ``bucket_size``:
    elements per bucket, None (one bucket per stage) without ``overlap_grad_reduce``."""

    overlap_grad_reduce: bool = False
    distributed_optimizer: bool = False
    overlap_param_gather: bool = False
    bucket_size: int | None = None
    link_gbps: float | None = None

    @property
    def flat_grad_buffers(self) -> bool:
        """Whether gradients live in bucketed flat buffers (``optim.grad_buffers``)."""
        return self.overlap_grad_reduce or self.distributed_optimizer

    def link(self) -> "EmulatedLink | None":
        """The emulated data-parallel interconnect (CPU overlap studies), or None when off."""
        return None if self.link_gbps is None else _link(self.link_gbps, 0.0)


@dataclass(frozen=True)
class DataConfig:
    """``--data-path``: raw text files (empty: the standard library's sources, read byte level)
    or, ``indexed``, Megatron's dataset prefixes with optional weights, read through
    Megatron's ``GPTDataset`` with ``split`` and ``cache_path``; batches, validation."""

    paths: tuple[str, ...]
    micro_batch_size: int
    global_batch_size: int
    eval_interval: int
    eval_iters: int
    indexed: bool = False
    split: str = DEFAULT_SPLIT
    cache_path: str | None = None


@dataclass(frozen=True)
class TokenizerConfig:
    """``--tokenizer-type`` and ``--tokenizer-model`` (an absolute path), the tokenizer's own
    vocabulary and the model's, padded as Megatron pads it (``--make-vocab-size-divisible-by``)."""

    tokenizer_type: str = "ByteTokenizer"
    tokenizer_model: str | None = None
    vocab_size: int = 256
    padded_vocab_size: int = 256

    def build(self) -> "Tokenizer":
        from megapipe.data.tokenizer import build_tokenizer

        return build_tokenizer(self.tokenizer_type, self.tokenizer_model)

    def descriptor(self) -> dict[str, Any]:
        """What a checkpoint stores under ``model.tokenizer`` (``checkpoint.reader``)."""
        spec: dict[str, Any] = {"tokenizer_type": self.tokenizer_type}
        if self.tokenizer_model is not None:
            spec["tokenizer_model"] = self.tokenizer_model
        return {**spec, "vocab_size": self.vocab_size}


@dataclass(frozen=True)
class CheckpointConfig:
    """Save and load folders, interval, how many to keep; a Hugging Face start."""

    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    keep_last: int | None = None
    load_hf: str | None = None  # a Hugging Face directory whose weights start the run


@dataclass(frozen=True)
class LoggingConfig:
    """The log line's interval, TensorBoard, the activation-memory column; ``--profile-trace``
    of iterations ``profile_first..profile_last``, optionally with torch.profiler."""

    interval: int = 10
    tensorboard_dir: str | None = None
    activation_memory: bool = False
    profile_trace: str | None = None
    profile_first: int = 2
    profile_last: int = 2
    pytorch_profiler: bool = False


@dataclass(frozen=True)
class FailureConfig:
    """How long a wait for another rank may take; when to save and exit early."""

    timeout: timedelta = timedelta(minutes=10)
    exit_signal_handler: bool = False
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None


@dataclass(frozen=True)
class CollectorConfig:
    """Megatron's ``--manual-gc``: the automatic garbage collector off, a collection every
    ``interval`` iterations (0: none between iterations) and around evaluations (``at_eval``);
    and megapipe's ``--heap-trim-interval``: the C heap's free pages handed back every
    ``trim_interval`` iterations (0: never), with or without ``manual``."""

    manual: bool = False
    interval: int = 0
    at_eval: bool = True
    trim_interval: int = 0


@dataclass(frozen=True)
class JobConfig:
    """Every part ``build_job`` and the loop read (module docstring)."""

    seed: int
    train_iters: int
    parallel: "ParallelConfig"
    schedule: ScheduleConfig
    overlap: OverlapConfig
    model: "GPTConfig"
    tokenizer: TokenizerConfig
    optimizer: OptimizerConfig
    precision: PrecisionConfig
    data_parallel: DataParallelConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    failures: FailureConfig
    graphs: GraphConfig = GraphConfig()
    collector: CollectorConfig = CollectorConfig()


def job_config(f: PretrainFlags, world_size: int) -> JobConfig:
    """The typed parts of checked flags (``checks.validate``) for ``world_size`` ranks."""
    parallel = parallel_config(f, world_size)
    overlap = f.overlap_moe_expert_parallel_comm
    high_priority = tuple(HIGH_PRIORITY_GROUPS[g] for g in f.high_priority_stream_groups)
    tokenizer = tokenizer_config(f)
    return JobConfig(
        seed=f.seed, train_iters=f.train_iters, parallel=parallel,
        schedule=schedule_config(f, parallel.dp),
        overlap=OverlapConfig(overlap, f.delay_wgrad_compute, f.moe_a2a_waves, high_priority,
                              f.overlap_moe_expert_parallel_comm_auto, f.overlap_auto_interval),
        model=model_config(f, tokenizer.padded_vocab_size), tokenizer=tokenizer,
        optimizer=OptimizerConfig(f.lr, f.min_lr, f.lr_warmup_iters,
                                  f.lr_decay_iters or f.train_iters, f.lr_decay_style,
                                  f.weight_decay, f.clip_grad),
        precision=PrecisionConfig(f.bf16, f.deterministic_mode),
        data_parallel=DataParallelConfig(
            f.overlap_grad_reduce, f.use_distributed_optimizer, f.overlap_param_gather,
            bucket_size(f, parallel.dp), f.dp_emulated_link_gbps),
        data=data_config(f),
        checkpoint=CheckpointConfig(f.save, f.load, f.save_interval, f.keep_last, f.load_hf),
        logging=LoggingConfig(f.log_interval, f.tensorboard_dir, f.log_activation_memory,
                              f.profile_trace, f.profile_step_start,
                              f.profile_step_end or f.profile_step_start, f.use_pytorch_profiler),
        failures=FailureConfig(timedelta(minutes=f.distributed_timeout_minutes),
                               f.exit_signal_handler, f.exit_interval, f.exit_duration_in_mins),
        graphs=GraphConfig(f.cuda_graph_impl, f.cuda_graph_modules or f.cuda_graph_scope),
        collector=CollectorConfig(f.manual_gc, f.manual_gc_interval, f.manual_gc_eval,
                                  f.heap_trim_interval),
    )


def world_size_of(f: PretrainFlags, env: Mapping[str, str] | None = None) -> int:
    """The launcher's world size (torchrun, srun), else ``--nproc``, else pp x ep."""
    from megapipe.parallel.launch import launched_world_size  # torch: only when flags are run

    pp_ep = max(f.pipeline_model_parallel_size, 1) * max(f.expert_model_parallel_size, 1)
    return next(n for n in (launched_world_size(env), f.nproc, pp_ep) if n is not None)


def parallel_config(f: PretrainFlags, world_size: int) -> "ParallelConfig":
    """pp, dp = world / pp and ep (ValueError when ep does not divide dp)."""
    from megapipe.parallel.config import ParallelConfig

    pp = f.pipeline_model_parallel_size
    return ParallelConfig(pp=pp, dp=world_size // pp, ep=f.expert_model_parallel_size)


def bucket_size(f: PretrainFlags, dp: int) -> int | None:
    """Elements per gradient bucket: the flag, else Megatron's max(40M, 1M x dp); None (one
    bucket per stage) without ``--overlap-grad-reduce``."""
    return (f.ddp_bucket_size or max(40_000_000, 1_000_000 * dp)) if f.overlap_grad_reduce else None


def schedule_config(f: PretrainFlags, dp: int) -> ScheduleConfig:
    """The schedule to run: the flag, or Megatron's default for pp and vpp."""
    pp, vpp = f.pipeline_model_parallel_size, f.virtual_pipeline_model_parallel_size or 1
    return ScheduleConfig(f.pipeline_schedule or default_schedule_name(pp, vpp), pp, vpp,
                          f.global_batch_size // (f.micro_batch_size * dp),
                          f.overlap_moe_expert_parallel_comm, f.overlap_max_extra_in_flight)


def selective_recompute_modules(f: PretrainFlags) -> tuple[str, ...]:
    """The modules that recompute (selective granularity; Megatron's default core_attn)."""
    if f.recompute_granularity != "selective":
        return ()
    return ("core_attn",) if f.recompute_modules is None else f.recompute_modules


def data_config(f: PretrainFlags) -> DataConfig:
    """Raw text or Megatron's indexed datasets (``flags.values_are_indexed``), batches."""
    indexed = values_are_indexed(f.data_path)
    return DataConfig(f.data_path, f.micro_batch_size, f.global_batch_size, f.eval_interval,
                      f.eval_iters, indexed, f.split or DEFAULT_SPLIT, f.data_cache_path)


def tokenizer_config(f: PretrainFlags) -> TokenizerConfig:
    """The tokenizer the flags name (ByteTokenizer by default) and the model's vocabulary:
    its size padded as Megatron pads it. DataError for a tokenizer that cannot be read."""
    from megapipe.data.tokenizer import padded_vocab_size

    kind = f.tokenizer_type or "ByteTokenizer"
    model = None if f.tokenizer_model is None else os.path.abspath(f.tokenizer_model)
    size = TokenizerConfig(kind, model).build().vocab_size
    return TokenizerConfig(kind, model, size,
                           padded_vocab_size(size, f.make_vocab_size_divisible_by))


def model_config(f: PretrainFlags, vocab_size: int) -> "GPTConfig":
    """The reference MoE GPT of ``vocab_size`` ids (ValueError or ArgsError for a shape it
    cannot take)."""
    from megapipe.models.config import GPTConfig

    first_dense, freq = parse_moe_layer_freq(f.moe_layer_freq, f.num_layers)
    full = f.recompute_granularity == "full"
    link = f.moe_emulated_link_gbps
    return GPTConfig(
        vocab_size=vocab_size, hidden_size=f.hidden_size, num_layers=f.num_layers,
        num_heads=f.num_attention_heads, seq_length=f.seq_length,
        ffn_hidden_size=f.ffn_hidden_size, num_experts=f.num_experts,
        moe_top_k=f.moe_router_topk, moe_ffn_hidden_size=f.moe_ffn_hidden_size,
        first_k_dense_layers=first_dense, moe_layer_freq=freq,
        moe_aux_loss_coeff=f.moe_aux_loss_coeff,
        moe_shared_expert_intermediate_size=f.moe_shared_expert_intermediate_size,
        moe_link=None if link is None else _link(link, f.moe_emulated_link_latency_us),
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


def _link(gbps: float, latency_us: float) -> "EmulatedLink":
    from megapipe.moe.link import EmulatedLink

    return EmulatedLink(gbps * 1e9, latency_us * 1e-6)


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
