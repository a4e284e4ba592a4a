"""The parallelism flags: pp, vpp, ep, the schedule and its overlap (``--help`` group
"parallelism"), and the data-parallel gradient and weight collectives ("data parallelism").
"""

from __future__ import annotations

from dataclasses import dataclass

from megapipe.schedule import SCHEDULES
from megapipe.train.config.declare import COUNT, POSITIVE, above, at_least, finite, flag
from megapipe.train.config.flag_checks import HIGH_PRIORITY_GROUPS, known_groups, known_schedule

PARALLEL, DP = "parallelism", "data parallelism"  # their --help groups


@dataclass(frozen=True)
class ParallelFlags:
    """The pipeline and expert layout, the schedule, the combined step and its all-to-alls."""

    pipeline_model_parallel_size: int = flag(2, "pp", POSITIVE, group=PARALLEL)
    virtual_pipeline_model_parallel_size: int | None = flag(
        2, "vpp: stages per rank (needs pp > 1)", POSITIVE, group=PARALLEL
    )
    expert_model_parallel_size: int = flag(
        2, "ep (divides dp = world / pp and the experts)", POSITIVE, group=PARALLEL
    )
    overlap_moe_expert_parallel_comm: bool = flag(
        True,
        "co-schedule one microbatch's forward with another's backward to hide the "
        "all-to-all (default on; --no-overlap-moe-expert-parallel-comm turns it off)",
        group=PARALLEL,
    )
    overlap_moe_expert_parallel_comm_auto: bool = flag(
        False,
        "time plain and combined steps over the first iterations and keep the faster "
        "(every rank agrees; same losses either way), checking again every "
        "--overlap-auto-interval iterations; each decision is logged as 'overlap auto:'",
        group=PARALLEL,
    )
    overlap_auto_interval: int = flag(
        500,
        "with --overlap-moe-expert-parallel-comm-auto: iterations from one timing trial's "
        "start to the next (0: time once; else at least the trial's 6)",
        COUNT,
        group=PARALLEL,
        metavar="N",
    )
    overlap_max_extra_in_flight: int | None = flag(
        None,
        "with the overlap: at most K more microbatch-stages in flight on any rank than the "
        "plain schedule (activation memory; default: no budget)",
        COUNT,
        group=PARALLEL,
        metavar="K",
    )
    delay_wgrad_compute: bool = flag(
        False, "defer expert weight gradients to fill the backward all-to-all", group=PARALLEL
    )
    moe_a2a_waves: int = flag(
        1,
        "send each MoE layer's all-to-alls in this many waves, one expert group each, so a "
        "forward or backward with no partner overlaps its own waves (needs the overlap; at most "
        "the experts per EP rank; default 1: off)",
        POSITIVE,
        group=PARALLEL,
    )
    pipeline_schedule: str | None = flag(
        None,
        f"one of {', '.join(SCHEDULES)} (default: interleaved-1f1b when vpp > 1, else 1f1b)",
        known_schedule,
        group=PARALLEL,
    )
    nproc: int | None = flag(
        None,
        "processes to start when not launched by torchrun or srun (default: pp x ep)",
        POSITIVE,
        group=PARALLEL,
    )
    high_priority_stream_groups: tuple[str, ...] = flag(
        (),
        "process groups whose NCCL communicator runs on a high-priority CUDA stream, any of "
        f"{', '.join(HIGH_PRIORITY_GROUPS)} (e.g. ep for the token all-to-all; ignored on gloo)",
        known_groups,
        group=PARALLEL,
    )
    moe_emulated_link_gbps: float | None = flag(
        None,
        "emulate an all-to-all link of this many GB/s (CPU overlap studies; off by "
        "default, the log says when it is on)",
        finite,
        above(0, "g"),
        group=PARALLEL,
    )
    moe_emulated_link_latency_us: float = flag(
        0.0,
        "latency per all-to-all of the emulated link, microseconds",
        finite,
        at_least(0, "g"),
        group=PARALLEL,
    )


@dataclass(frozen=True)
class DataParallelFlags:
    """Bucketed gradient reductions and the distributed optimizer."""

    overlap_grad_reduce: bool = flag(
        False,
        "reduce each bucket of gradients over data parallelism as soon as the step's "
        "backward has finished it, on a communication stream, instead of all gradients after "
        "the step",
        group=DP,
    )
    use_distributed_optimizer: bool = flag(
        False,
        "shard the fp32 main weights and AdamW moments over the data-parallel group "
        "(experts over expert-DP): reduce-scatter the gradients, all-gather the updated weights",
        group=DP,
    )
    overlap_param_gather: bool = flag(
        False,
        "with --use-distributed-optimizer and --overlap-grad-reduce: all-gather the "
        "updated weights behind the next step's first forwards (each module waits for its own "
        "buckets)",
        group=DP,
    )
    ddp_bucket_size: int | None = flag(
        None,
        "with --overlap-grad-reduce: parameters (elements) per bucket (default Megatron's "
        "max(40M, 1M x dp))",
        group=DP,
        metavar="N",
    )
    dp_emulated_link_gbps: float | None = flag(
        None,
        "emulate a data-parallel link of this many GB/s for the bucketed reductions and "
        "gathers (CPU overlap studies; off by default, the log says when it is on)",
        finite,
        above(0, "g"),
        group=DP,
    )
