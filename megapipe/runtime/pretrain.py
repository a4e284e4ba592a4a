"""Megatron-style MoE GPT pretraining: the train loop behind ``megapipe pretrain``.

``main(argv)`` validates every flag first (one line and exit 2 on a bad one, before any process
group), then either runs this process as one rank (when torchrun or srun launched it) or starts
``world_size`` processes itself (spawn) and runs one rank in each. ``train(args)`` is one rank's
run: process groups, the schedule, this rank's stages of the model, the executor, the data
shard, AdamW with the LR schedule and global-norm clipping, evaluation, checkpoints and the log.
It returns the losses so tests can compare runs bitwise.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from megapipe.models.gpt import gpt_loss
from megapipe.models.split import build_stage
from megapipe.parallel.groups import ProcessGroups, create_groups
from megapipe.parallel.launch import init_distributed
from megapipe.parallel.testing import free_port
from megapipe.runtime.args import (
    ArgsError,
    PretrainArgs,
    args_from_namespace,
    launched_world_size,
    parse_pretrain_args,
)
from megapipe.runtime.checkpoint import (
    CheckpointError,
    CheckpointLayout,
    check_layout,
    latest_iteration,
    load_checkpoint,
    save_checkpoint,
)
from megapipe.runtime.data import (
    Microbatch,
    TrainBatches,
    load_tokens,
    resolve_data_files,
    split_corpus,
    validation_batches,
)
from megapipe.runtime.executor import PipelineExecutor, StepResult
from megapipe.runtime.logging import NonFiniteLossError, TrainingLogger, check_finite_loss
from megapipe.runtime.optim import (
    LRSchedule,
    build_optimizer,
    clip_grads,
    global_grad_norm,
    unique_params,
)
from megapipe.runtime.p2p import TensorSpec
from megapipe.schedule import build_schedule


@dataclass
class TrainResult:
    """What one rank saw: the global mean loss of every iteration run, and the evaluations."""

    first_iteration: int = 0
    losses: list[float] = field(default_factory=list)
    aux_losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    valid_losses: dict[int, float] = field(default_factory=dict)
    saved: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


def checkpoint_layout(args: PretrainArgs) -> CheckpointLayout:
    return CheckpointLayout(
        pp=args.pp, vpp=args.vpp, ep=args.ep, dp=args.dp, num_layers=args.num_layers,
        hidden_size=args.hidden_size, num_experts=args.num_experts,
        ffn_hidden_size=args.ffn_hidden_size, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
    )


def _global_mean(values: Sequence[torch.Tensor], device: torch.device) -> float:
    """Mean of ``values`` over every rank that holds some (sum and count, all-reduced)."""
    local = torch.zeros(2, dtype=torch.float64, device=device)
    if values:
        local[0] = torch.stack([v.detach().double() for v in values]).sum().to(device)
        local[1] = len(values)
    dist.all_reduce(local)
    return float(local[0] / local[1]) if local[1] > 0 else float("nan")


def _exposed_a2a(step: StepResult, device: torch.device) -> float | None:
    """Share of all ranks' all-to-all time during which no compute ran (from the node traces)."""
    local = torch.zeros(2, dtype=torch.float64, device=device)
    if step.a2a_time is not None and step.exposed_comm_fraction is not None:
        local[0] = step.a2a_time * step.exposed_comm_fraction
        local[1] = step.a2a_time
    dist.all_reduce(local)
    return float(local[0] / local[1]) if local[1] > 0 else None


def _moe_layers(stages: dict[int, torch.nn.Module]) -> list[torch.nn.Module]:
    return [layer for stage in stages.values() for layer in stage.moe_layers()]


def _pop_aux(stages: dict[int, torch.nn.Module]) -> list[torch.Tensor]:
    values = []
    for layer in _moe_layers(stages):
        mean = layer.aux_loss_log.pop_mean()
        if mean is not None:
            values.append(mean)
    return values


def _placement_line(args: PretrainArgs) -> str:
    """Which ranks run on which node (gathered from every rank)."""
    me = (dist.get_rank(), os.environ.get("SLURMD_NODENAME") or socket.gethostname())
    everyone: list[tuple[int, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, me)
    nodes: dict[str, list[int]] = {}
    for rank, node in sorted(e for e in everyone if e is not None):
        nodes.setdefault(node, []).append(rank)
    placed = "; ".join(f"{node}: ranks {','.join(map(str, ranks))}" for node, ranks in nodes.items())
    return f"placement: {len(nodes)} node(s): {placed}"


def _device() -> torch.device:
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _to(batch: list[Microbatch], device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [t.to(device) for t, _ in batch], [lab.to(device) for _, lab in batch]


def train(args: PretrainArgs, write: Callable[[str], None] = print) -> TrainResult:
    """Run one rank of the job (the default process group is started here if needed)."""
    if not dist.is_initialized():
        init_distributed()
    rank = dist.get_rank()
    result = TrainResult()

    def say(line: str) -> None:
        result.lines.append(line)
        if rank == 0:
            write(line)

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    device = _device()
    groups: ProcessGroups = create_groups(args.parallel)
    schedule = build_schedule(args.schedule_name, args.pp, args.num_microbatches, args.vpp,
                              overlap=args.overlap_moe_expert_parallel_comm)
    config = args.gpt_config()
    my_stages = schedule.stages_of_rank(groups.pp_rank)
    stages = {
        s: build_stage(config, schedule.model_part(s), schedule.stages_per_pipeline,
                       ep_group=groups.ep).to(device)
        for s in my_stages
    }
    executor = PipelineExecutor(
        schedule, stages, groups=groups, loss_fn=gpt_loss,
        spec=TensorSpec((args.micro_batch_size, args.seq_length, args.hidden_size)),
        delay_wgrad_compute=args.delay_wgrad_compute,
        record_trace=args.overlap_moe_expert_parallel_comm,
    )
    files = resolve_data_files(args.data_path)
    splits = split_corpus(load_tokens(files), args.seq_length)
    batches = TrainBatches(splits, args.global_batch_size, args.micro_batch_size, args.dp,
                           groups.dp_rank, args.seed)
    valid = validation_batches(splits, args.eval_iters, args.global_batch_size,
                               args.micro_batch_size, args.dp, groups.dp_rank)
    modules = [stages[s] for s in sorted(stages)]
    optimizer = build_optimizer(modules, args.lr, args.weight_decay)
    decay_end = args.lr_decay_iters or args.train_iters
    lr_schedule = LRSchedule(args.lr, args.min_lr, args.lr_warmup_iters,
                             max(1, decay_end - args.lr_warmup_iters), args.lr_decay_style)
    all_params = unique_params(modules)
    # each model part counted once per pipeline: DualPipe's mirror stages are copies
    norm_params = unique_params([stages[s] for s in sorted(stages)
                                 if s < schedule.stages_per_pipeline])
    layout = checkpoint_layout(args)

    local_params = sum(p.numel() for p in all_params)
    say(f"megapipe pretrain: world {args.world_size} = pp {args.pp} x dp {args.dp} (ep {args.ep}), "
        f"vpp {args.vpp}, schedule {schedule.name}"
        f"{' with overlap' if args.overlap_moe_expert_parallel_comm else ''}"
        f"{', delayed wgrad' if args.delay_wgrad_compute else ''}; "
        f"{args.num_microbatches} microbatches of {args.micro_batch_size} x {args.seq_length} "
        f"tokens per dp rank per step")
    say(f"model: {args.num_layers} layers, hidden {args.hidden_size}, {args.num_experts} experts "
        f"top-{args.moe_router_topk}; {local_params:,} parameters on rank 0; data: {len(files)} "
        f"files, {splits.tokens.numel():,} byte tokens, {splits.num_train:,} train / "
        f"{splits.num_valid:,} validation windows; device {device.type}")
    link = args.emulated_link()
    if link is not None:
        say(link.describe())
    say(_placement_line(args))

    iteration = 0
    if args.load is not None and latest_iteration(args.load) is not None:
        extra = {"scheduler": lr_schedule.state_dict(), "data": batches.state_dict()}
        iteration, loaded = load_checkpoint(args.load, stages, optimizer, extra, layout,
                                            groups.ep_rank)
        lr_schedule.load_state_dict(loaded["scheduler"])
        batches.load_state_dict(loaded["data"])
        say(f"resumed from {args.load} at iteration {iteration}")
    elif args.load is not None:
        say(f"--load {args.load}: no checkpoint yet, starting from scratch")
    result.first_iteration = iteration

    logger = TrainingLogger(args.train_iters, args.log_interval, enabled=rank == 0,
                            tensorboard_dir=args.tensorboard_dir, write=say)
    tokens_per_iter = args.global_batch_size * args.seq_length
    last_saved = None
    started = time.perf_counter()
    try:
        while iteration < args.train_iters:
            start = time.perf_counter()
            tokens, labels = _to(batches.next_batch(), device)
            optimizer.zero_grad(set_to_none=True)
            step = executor.step(tokens, labels)
            loss = _global_mean(list(step.losses.values()), device)
            aux = _global_mean(_pop_aux(stages), device)
            exposed = _exposed_a2a(step, device) if executor.record_trace else None
            check_finite_loss(loss, iteration + 1)
            lr = lr_schedule.step(optimizer)
            norm = global_grad_norm(norm_params, groups.pp, groups.ep, device)
            clip_grads(all_params, args.clip_grad, norm)
            optimizer.step()
            iteration += 1
            elapsed = time.perf_counter() - start
            result.losses.append(loss)
            result.aux_losses.append(aux)
            result.grad_norms.append(norm)
            logger.record(iteration, loss=loss, aux_loss=aux if aux == aux else None, lr=lr,
                          grad_norm=norm, step_time=elapsed, tokens=tokens_per_iter,
                          exposed_a2a=exposed)
            if args.eval_interval and args.eval_iters and iteration % args.eval_interval == 0:
                result.valid_losses[iteration] = evaluate(executor, stages, valid, device)
                logger.evaluation(iteration, result.valid_losses[iteration])
            if args.save and args.save_interval and iteration % args.save_interval == 0:
                result.saved.append(_save(args, iteration, stages, optimizer, lr_schedule,
                                          batches, layout, groups, schedule.name))
                last_saved = iteration
                say(f"saved checkpoint {result.saved[-1]}")
        if args.save and result.losses and last_saved != iteration:
            result.saved.append(_save(args, iteration, stages, optimizer, lr_schedule, batches,
                                      layout, groups, schedule.name))
            say(f"saved checkpoint {result.saved[-1]}")
        if result.losses:
            say(f"done: iterations {result.first_iteration + 1}-{iteration} in "
                f"{time.perf_counter() - started:.0f} s; loss {result.losses[0]:.4f} -> "
                f"{result.losses[-1]:.4f}")
    finally:
        logger.close()
        executor.close()  # its communication-stream thread
    return result


def evaluate(executor: PipelineExecutor, stages: dict[int, torch.nn.Module],
             batches: list[list[Microbatch]], device: torch.device) -> float:
    """Mean validation loss over ``batches`` (forward only, no activations kept)."""
    losses: list[torch.Tensor] = []
    for batch in batches:
        tokens, labels = _to(batch, device)
        losses.extend(executor.step(tokens, labels, forward_only=True).losses.values())
    _pop_aux(stages)  # evaluation's router losses are not training's
    return _global_mean(losses, device)


def _save(args: PretrainArgs, iteration: int, stages, optimizer, lr_schedule: LRSchedule,
          batches: TrainBatches, layout: CheckpointLayout, groups: ProcessGroups,
          schedule_name: str) -> str:
    extra = {"scheduler": lr_schedule.state_dict(), "data": batches.state_dict()}
    info = {"schedule": schedule_name, "overlap": args.overlap_moe_expert_parallel_comm,
            "train_iters": args.train_iters}
    assert args.save is not None
    path = save_checkpoint(args.save, iteration, stages, optimizer, extra, layout,
                           groups.ep_rank, info)
    return str(path)


def _spawned_rank(local_rank: int, args: PretrainArgs, port: int) -> None:
    """Entry point of a process started by ``main`` (one rank on this machine)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    os.environ.update(RANK=str(local_rank), WORLD_SIZE=str(args.world_size),
                      LOCAL_RANK=str(local_rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _run_rank(args)


def _run_rank(args: PretrainArgs) -> None:
    """Train as this rank; a NaN loss (seen by every rank alike) ends it with one line."""
    try:
        train(args)
    except NonFiniteLossError as err:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"megapipe pretrain: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    """``examples/pretrain_moe_gpt.py``: parse, validate, launch, train; returns the exit code."""
    return _validate_then_run(parse_pretrain_args, argv)


def main_from_namespace(ns: argparse.Namespace) -> int:
    """``megapipe pretrain`` (the CLI parsed the flags with ``build_parser(add_help=False)``)."""
    return _validate_then_run(args_from_namespace, ns)


def _validate_then_run(to_args: Callable[[Any], PretrainArgs], source: Any) -> int:
    """Turn flags into PretrainArgs (one clear line and exit code 2 if they are bad), then run."""
    try:
        args = to_args(source)
    except ArgsError as err:
        print(f"megapipe pretrain: error: {err}", file=sys.stderr)
        return 2
    return run(args)


def run(args: PretrainArgs) -> int:
    """Check a checkpoint to resume from, then train as this rank or start the ranks here."""
    try:
        if args.load is not None and latest_iteration(args.load) is not None:
            check_layout(args.load, checkpoint_layout(args))
    except CheckpointError as err:
        print(f"megapipe pretrain: error: {err}", file=sys.stderr)
        return 2
    if launched_world_size() is not None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if not torch.cuda.is_available():
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
        _run_rank(args)
        return 0
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        mp.start_processes(_spawned_rank, args=(args, free_port()), nprocs=args.world_size,
                           join=True, start_method="spawn")
    except mp.ProcessExitedException as err:
        print(f"megapipe pretrain: error: rank {err.error_index} exited with code "
              f"{err.exit_code}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
