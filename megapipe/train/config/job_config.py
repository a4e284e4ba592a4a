"""The training app's configuration: one small frozen part per concern, and ``JobConfig``.

``build.job_config(flags, world_size)`` makes them from ``PretrainFlags`` (every flag, flat,
under Megatron's names), checking each as it is made; after parsing, the app reads only these
parts (docs/pretraining.md lists which flag lands where).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

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

    def build(self) -> Schedule:
        from megapipe.schedule import build_schedule

        return build_schedule(
            self.name,
            self.pp,
            self.num_microbatches,
            self.vpp,
            overlap=self.overlap,
            max_extra_in_flight=self.max_extra_in_flight,
        )


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

    def link(self) -> EmulatedLink | None:
        """The emulated data-parallel interconnect (CPU overlap studies), or None when off."""
        return None if self.link_gbps is None else emulated_link(self.link_gbps, 0.0)


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

    def build(self) -> Tokenizer:
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
    parallel: ParallelConfig
    schedule: ScheduleConfig
    overlap: OverlapConfig
    model: GPTConfig
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


def emulated_link(gbps: float, latency_us: float) -> EmulatedLink:
    """An emulated interconnect of ``gbps`` GB/s and ``latency_us`` per message (``moe.link``)."""
    from megapipe.moe.link import EmulatedLink

    return EmulatedLink(gbps * 1e9, latency_us * 1e-6)
