"""The training app's configuration as typed parts, made from the validated flags.

``job_config(args)`` splits a ``PretrainArgs`` (every flag, flat, under Megatron's names) into
what each part of ``build_job`` needs, so that no part reads a flag it does not own:

- ``ScheduleConfig``: which pipeline schedule, its sizes and the overlap pass's budget;
- ``OverlapConfig``: the combined step's options (the executor's overlap keywords);
- ``model``: the ``GPTConfig`` of the reference MoE GPT (``models.config``);
- ``OptimizerConfig``: AdamW, the learning-rate schedule, clipping, mixed precision;
- ``CheckpointConfig``: where to save and load, how often, how many to keep.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megapipe.models.config import GPTConfig
    from megapipe.schedule import Schedule
    from megapipe.train.args import PretrainArgs


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
    """The combined step: on or off, deferred expert weight gradients, all-to-all chunks, the
    node trace (the log's hidden and exposed all-to-all time), the process groups whose
    collectives go on a high-priority stream."""

    enabled: bool
    delay_wgrad_compute: bool = False
    moe_a2a_chunks: int = 1
    high_priority_stream_groups: tuple[str, ...] = ()

    @property
    def record_trace(self) -> bool:
        return self.enabled


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW (fp32 main weights and moments with ``bf16``), its learning-rate schedule (linear
    warm-up to ``lr``, then ``decay_style`` down to ``min_lr`` at ``decay_end``), clipping."""

    lr: float
    min_lr: float
    warmup_iters: int
    decay_end: int
    decay_style: str
    weight_decay: float
    clip_grad: float
    bf16: bool


@dataclass(frozen=True)
class CheckpointConfig:
    """``--save`` / ``--load`` folders, ``--save-interval``, ``--keep-last``."""

    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    keep_last: int | None = None


@dataclass(frozen=True)
class JobConfig:
    """The parts ``build_job`` reads (module docstring)."""

    schedule: ScheduleConfig
    overlap: OverlapConfig
    model: "GPTConfig"
    optimizer: OptimizerConfig
    checkpoint: CheckpointConfig


def job_config(args: "PretrainArgs") -> JobConfig:
    """The typed parts of validated flags."""
    overlap = args.overlap_moe_expert_parallel_comm
    return JobConfig(
        schedule=ScheduleConfig(args.schedule_name, args.pp, args.vpp, args.num_microbatches,
                                overlap, args.overlap_max_extra_in_flight),
        overlap=OverlapConfig(overlap, args.delay_wgrad_compute, args.moe_a2a_chunks,
                              args.high_priority_stream_groups),
        model=args.gpt_config(),
        optimizer=OptimizerConfig(
            args.lr, args.min_lr, args.lr_warmup_iters, args.lr_decay_iters or args.train_iters,
            args.lr_decay_style, args.weight_decay, args.clip_grad, args.bf16),
        checkpoint=CheckpointConfig(args.save, args.load, args.save_interval, args.keep_last),
    )
