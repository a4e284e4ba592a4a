"""The pretrain script's flags: one argparse table with Megatron's names and the demo's defaults.

``megapipe.train.args`` turns the parsed namespace into validated ``PretrainArgs``.
"""

from __future__ import annotations

import argparse

from megapipe.schedule import SCHEDULES

LR_DECAY_STYLES = ("cosine", "linear", "constant")
# Megatron's names for the groups a user may put on high-priority NCCL streams -> megapipe's
HIGH_PRIORITY_GROUPS = {"ep": "ep", "ep_dp": "expert_dp", "dp": "dp", "pp": "pp"}


def build_parser(prog: str = "megapipe pretrain", add_help: bool = True) -> argparse.ArgumentParser:
    """The argparse parser with Megatron's flag names (defaults: the built-in CPU demo).

    ``add_help=False`` gives a parent parser for ``megapipe pretrain``'s subcommand.
    """
    p = argparse.ArgumentParser(
        prog=prog,
        add_help=add_help,
        description="Pretrain an MoE GPT with pipeline x expert x data parallelism. With no "
        "flags: a small model on CPU, pp=2 vpp=2 ep=2, overlap on, 4 processes.",
    )
    model = p.add_argument_group("model")
    model.add_argument("--num-layers", type=int, default=6)
    model.add_argument("--hidden-size", type=int, default=96)
    model.add_argument("--num-attention-heads", type=int, default=4)
    model.add_argument("--ffn-hidden-size", type=int, default=192)
    model.add_argument("--seq-length", type=int, default=64)
    model.add_argument("--num-experts", type=int, default=4)
    model.add_argument("--moe-router-topk", type=int, default=2)
    model.add_argument("--moe-ffn-hidden-size", type=int, default=96)
    model.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    model.add_argument(
        "--moe-layer-freq", default="1",
        help="N: every Nth layer is MoE; or a 0/1 pattern per layer like '[0,1,1,1]' "
        "(dense layers first, then a period)",
    )
    model.add_argument("--moe-aux-loss-coeff", type=float, default=1e-2)
    model.add_argument("--moe-router-dtype", default=None,
                       help="fp32 or fp64: compute the router's logits in that precision "
                       "(default: the activations' dtype; softmax, top-k and the auxiliary "
                       "losses are always at least fp32)")
    model.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                       help="drop routing choices over capacity factor x tokens x top-k / "
                       "experts per expert, padding every expert to that capacity (default: "
                       "dropless)")
    model.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                       help="accepted for Megatron scripts: megapipe always pads to the "
                       "capacity (needs --moe-expert-capacity-factor)")
    precision = p.add_argument_group("precision")
    precision.add_argument("--bf16", action="store_true",
                           help="bf16 parameters and activations; fp32 main weights, AdamW "
                           "moments and gradient accumulation/reduction")
    precision.add_argument("--fp16", action="store_true",
                           help="not supported (one clear error): use --bf16")
    precision.add_argument("--deterministic-mode", action="store_true",
                           help="deterministic kernels only (torch's deterministic algorithms, "
                           "deterministic fused-attention backward, cuBLAS workspace setting), so "
                           "a GPU run repeats bit for bit and a resume equals the uninterrupted "
                           "run; an operation without a deterministic kernel is an error")
    train = p.add_argument_group("training")
    train.add_argument("--micro-batch-size", type=int, default=4)
    train.add_argument("--global-batch-size", type=int, default=32)
    train.add_argument("--train-iters", type=int, default=100)
    train.add_argument("--lr", type=float, default=3e-3)
    train.add_argument("--min-lr", type=float, default=3e-4)
    train.add_argument("--lr-warmup-iters", type=int, default=10)
    train.add_argument("--lr-decay-iters", type=int, default=None,
                       help="iteration at which the decay reaches --min-lr (default: train-iters)")
    train.add_argument("--lr-decay-style", default="cosine", choices=None,
                       help=f"one of {', '.join(LR_DECAY_STYLES)}")
    train.add_argument("--weight-decay", type=float, default=0.01)
    train.add_argument("--clip-grad", type=float, default=1.0, help="0 disables clipping")
    train.add_argument("--seed", type=int, default=1234)
    par = p.add_argument_group("parallelism")
    par.add_argument("--pipeline-model-parallel-size", type=int, default=2)
    par.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=2)
    par.add_argument("--expert-model-parallel-size", type=int, default=2)
    par.add_argument(
        "--overlap-moe-expert-parallel-comm", action=argparse.BooleanOptionalAction, default=True,
        help="co-schedule one microbatch's forward with another's backward to hide the "
        "all-to-all (default on; --no-overlap-moe-expert-parallel-comm turns it off)",
    )
    par.add_argument("--overlap-max-extra-in-flight", type=int, default=None, metavar="K",
                     help="with the overlap: at most K more microbatch-stages in flight on any "
                     "rank than the plain schedule (activation memory; default: no budget)")
    par.add_argument("--delay-wgrad-compute", action="store_true",
                     help="defer expert weight gradients to fill the backward all-to-all")
    par.add_argument("--moe-a2a-chunks", type=int, default=1,
                     help="split each MoE layer's all-to-alls into this many expert groups, so a "
                     "step with no partner overlaps its own chunks (needs the overlap; at most "
                     "the experts per EP rank; default 1: off)")
    par.add_argument("--pipeline-schedule", default=None,
                     help=f"one of {', '.join(SCHEDULES)} (default: interleaved-1f1b when "
                     "vpp > 1, else 1f1b)")
    par.add_argument("--nproc", type=int, default=None,
                     help="processes to start when not launched by torchrun or srun "
                     "(default: pp x ep)")
    par.add_argument("--high-priority-stream-groups", nargs="*", default=[],
                     help="process groups whose NCCL communicator runs on a high-priority CUDA "
                     f"stream, any of {', '.join(HIGH_PRIORITY_GROUPS)} (e.g. ep for the "
                     "token all-to-all; ignored on gloo)")
    par.add_argument("--moe-emulated-link-gbps", type=float, default=None,
                     help="emulate an all-to-all link of this many GB/s (CPU overlap studies; "
                     "off by default, the log says when it is on)")
    par.add_argument("--moe-emulated-link-latency-us", type=float, default=0.0,
                     help="latency per all-to-all of the emulated link, microseconds")
    _add_data_parallel_flags(p)
    _add_recompute_flags(p)
    io = p.add_argument_group("data, checkpoints, logging")
    io.add_argument("--data-path", nargs="+", default=[],
                    help="text files or directories (default: the Python standard library's "
                    "source files)")
    io.add_argument("--save", default=None)
    io.add_argument("--load", default=None)
    io.add_argument("--save-interval", type=int, default=None)
    io.add_argument("--eval-interval", type=int, default=50)
    io.add_argument("--eval-iters", type=int, default=2)
    io.add_argument("--log-interval", type=int, default=10)
    io.add_argument("--tensorboard-dir", default=None)
    io.add_argument("--log-activation-memory", action="store_true",
                    help="measure the bytes saved for backward or held by the pipeline each "
                    "step (act mem column; changes no bit, costs host time per saved tensor)")
    _add_fault_tolerance_flags(p)
    _add_profiling_flags(p)
    return p


def _add_data_parallel_flags(p: argparse.ArgumentParser) -> None:
    """Megatron's data-parallel flags: bucketed reductions, the distributed optimizer."""
    dp = p.add_argument_group("data parallelism")
    dp.add_argument("--overlap-grad-reduce", action="store_true",
                    help="reduce each bucket of gradients over data parallelism as soon as the "
                    "step's backward has finished it, on a communication stream, instead of "
                    "all gradients after the step")
    dp.add_argument("--use-distributed-optimizer", action="store_true",
                    help="shard the fp32 main weights and AdamW moments over the data-parallel "
                    "group (experts over expert-DP): reduce-scatter the gradients, all-gather "
                    "the updated weights")
    dp.add_argument("--overlap-param-gather", action="store_true",
                    help="with --use-distributed-optimizer and --overlap-grad-reduce: all-gather "
                    "the updated weights behind the next step's first forwards (each module "
                    "waits for its own buckets)")
    dp.add_argument("--ddp-bucket-size", type=int, default=None, metavar="N",
                    help="with --overlap-grad-reduce: parameters (elements) per bucket (default "
                    "Megatron's max(40M, 1M x dp))")
    dp.add_argument("--dp-emulated-link-gbps", type=float, default=None,
                    help="emulate a data-parallel link of this many GB/s for the bucketed "
                    "reductions and gathers (CPU overlap studies; off by default, the log says "
                    "when it is on)")


def _add_profiling_flags(p: argparse.ArgumentParser) -> None:
    """One trace of the real run (all ranks, with the simulated schedule beside it)."""
    prof = p.add_argument_group("profiling")
    prof.add_argument("--profile-trace", default=None, metavar="FILE",
                      help="write one Perfetto/Chrome trace of every rank's steps "
                      "--profile-step-start..--profile-step-end to FILE (read it with "
                      "`megapipe trace summarize FILE`)")
    prof.add_argument("--profile-step-start", type=int, default=2,
                      help="first iteration traced (1-based, included; default 2)")
    prof.add_argument("--profile-step-end", type=int, default=None,
                      help="last iteration traced (included; default: the start)")
    prof.add_argument("--use-pytorch-profiler", action="store_true",
                      help="also run torch.profiler over the traced steps, writing one trace "
                      "per rank next to --profile-trace, with megapipe's node names as ranges")


def _add_recompute_flags(p: argparse.ArgumentParser) -> None:
    """Megatron's activation recompute flags (re-run inside the node's own backward)."""
    rc = p.add_argument_group("activation recompute")
    rc.add_argument("--recompute-granularity", default=None, choices=("full", "selective"),
                    help="selective: recompute --recompute-modules inside their node's backward; "
                    "full: whole layers, every compute node keeping only its inputs and running "
                    "again in its own backward (the all-to-alls never run again)")
    rc.add_argument("--recompute-method", default=None, choices=("uniform", "block"),
                    help="with --recompute-granularity full: uniform recomputes every layer of "
                    "each pipeline chunk, in groups of --recompute-num-layers (a group keeps no "
                    "layer output inside it); block recomputes the first --recompute-num-layers "
                    "layers of each chunk")
    rc.add_argument("--recompute-num-layers", type=int, default=None, metavar="N",
                    help="with --recompute-granularity full: layers per uniform group, or layers "
                    "recomputed per chunk with block (default 1)")
    rc.add_argument("--recompute-modules", nargs="*", default=None,
                    help="with selective granularity: any of core_attn, moe_act "
                    "(default: core_attn, as Megatron)")


def _add_fault_tolerance_flags(p: argparse.ArgumentParser) -> None:
    """Checkpoint retention, graceful exits (preemption) and the timeout of every wait."""
    ft = p.add_argument_group("failures and preemption")
    ft.add_argument("--keep-last", type=int, default=None,
                    help="keep only the N newest complete checkpoints in --save (default: all)")
    ft.add_argument("--exit-signal-handler", action="store_true",
                    help="on SIGTERM finish the current step, save a checkpoint, exit 0")
    ft.add_argument("--exit-interval", type=int, default=None,
                    help="save and exit 0 after every N-th iteration")
    ft.add_argument("--exit-duration-in-mins", type=float, default=None,
                    help="save and exit 0 after the first iteration ending past this many minutes")
    ft.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                    help="how long any rank waits for another (pipeline receive, all-to-all, "
                    "gradient reduction) before it stops naming what it waited on")
