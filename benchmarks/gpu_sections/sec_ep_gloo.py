"""ep_gloo: expert parallelism with two processes on the one GPU, over gloo.

NCCL refuses two ranks on one GPU; gloo's ``all_to_all_single`` takes CUDA tensors (staged
through the host), its send/recv do not, so pp = 1. Each rank runs the reference MoE GPT
(1f1b, 4 microbatches) through the executor with ep = 2 (experts split over the two ranks),
plain and combined, and the ep = 1 model (all experts local) on both ranks' batches, in fp32
and in bf16 (fp32 main gradients, ``cast_to_bf16``):

- combined equals plain, bitwise (losses and gradients), in both, under deterministic kernels
  (``megapipe.train.determinism``, attention on the math backend);
- ep = 2 equals ep = 1: the losses, the dense gradients (this rank's tokens only), and the
  expert gradients (this rank's experts, summed over both ranks' tokens); within 1e-6 in fp32;
  in bf16 within 2e-2 of each tensor's largest entry (docs/precision.md: with EP an expert's
  weight gradient is one bf16 GEMM over both ranks' rows instead of one per rank).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from megapipe.models.config import GPTConfig
from megapipe.parallel.launch import RankExited, start_local_ranks

WORLD = 2
TOLERANCE = {"fp32": 1e-6, "bf16": 2e-2}  # fp32: absolute; bf16: of each tensor's largest entry


@dataclass(frozen=True)
class Settings:
    config: GPTConfig
    micro_batch: int
    microbatches: int
    cuda: bool
    out_dir: str


REAL = (GPTConfig(hidden_size=256, num_heads=4, num_layers=3, seq_length=256,
                  ffn_hidden_size=1024, num_experts=8, moe_top_k=2, moe_ffn_hidden_size=512,
                  first_k_dense_layers=1), 2)
DRY = (GPTConfig(hidden_size=32, num_heads=2, num_layers=2, seq_length=16, ffn_hidden_size=64,
                 num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32, first_k_dense_layers=1), 2)


def run(ctx, result) -> None:  # noqa: ANN001
    config, micro_batch = REAL if ctx.cuda else DRY
    out_dir = ctx.scratch / "ep_gloo"
    out_dir.mkdir(exist_ok=True)
    settings = Settings(config, micro_batch, 4, ctx.cuda, str(out_dir))
    result.figure(
        "setup",
        f"{WORLD} processes, gloo, {'one GPU' if ctx.cuda else 'CPU'}; "
        f"{config.num_layers} layers, {config.num_experts} experts top-{config.moe_top_k}, "
        f"hidden {config.hidden_size}; fp32 and bf16",
    )
    try:
        start_local_ranks(_worker, WORLD, (settings,)).join()
    except RankExited as err:
        result.fail(f"{err} (its traceback is in gpu_check.log)")
        return
    for rank in range(WORLD):
        reports = json.loads((out_dir / f"rank{rank}.json").read_text())
        for precision, report in reports.items():
            tolerance = TOLERANCE[precision]
            result.check(f"rank {rank}, {precision}: combined equals plain bitwise (losses and "
                         "gradients)", report["combined_bitwise"], report["combined_detail"])
            result.check(f"rank {rank}, {precision}: ep = 2 equals ep = 1 within {tolerance:g}",
                         report["ep_max_diff"] <= tolerance,
                         f"largest difference {report['ep_max_diff']:.3g} at {report['ep_worst']}")
            result.figure(f"rank{rank}_{precision}_ep_max_diff", report["ep_max_diff"], "",
                          f"rank {rank}, {precision}: largest ep 2 - ep 1 difference",
                          headline=rank == 0)


def _worker(rank: int, s: Settings) -> None:
    """One rank (started by ``start_local_ranks``, torchrun's variables set)."""
    import torch.distributed as dist

    from megapipe.train.determinism import deterministic_kernels

    dist.init_process_group("gloo")
    device = torch.device("cuda", 0) if s.cuda else torch.device("cpu")
    if s.cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
    with deterministic_kernels(strict=False):  # attention on the math backend
        _compare_runs(rank, s, device)
    dist.barrier()
    dist.destroy_process_group()


def _compare_runs(rank: int, s: Settings, device: torch.device) -> None:
    from megapipe.parallel.config import ParallelConfig
    from megapipe.parallel.groups import create_groups

    groups = create_groups(ParallelConfig(pp=1, dp=WORLD, ep=WORLD))
    batches = [_batch(s, r, device) for r in range(WORLD)]
    reports = {}
    for precision in TOLERANCE:
        bf16 = precision == "bf16"
        plain = _step(s, batches[rank], device, groups, overlap=False, bf16=bf16)
        combined = _step(s, batches[rank], device, groups, overlap=True, bf16=bf16)
        references = [_step(s, b, device, None, overlap=False, bf16=bf16) for b in batches]
        reports[precision] = {**_bitwise(plain, combined),
                              **_ep_difference(plain, references, groups, relative=bf16)}
    Path(s.out_dir, f"rank{rank}.json").write_text(json.dumps(reports))


def _batch(s: Settings, rank: int, device: torch.device):  # noqa: ANN202
    generator = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(
        0,
        s.config.vocab_size,
        (s.microbatches * s.micro_batch, s.config.seq_length + 1),
        generator=generator,
    ).to(device)
    return list(ids[:, :-1].chunk(s.microbatches)), list(ids[:, 1:].chunk(s.microbatches))


def _step(s: Settings, batch, device: torch.device, groups, overlap: bool,  # noqa: ANN001, ANN202
          bf16: bool):
    """(losses, {name: (fp32 main gradient or gradient, is_expert)}) of one executor step;
    ``groups`` None: ep = 1."""
    from megapipe.models.gpt import gpt_loss
    from megapipe.models.split import build_stage
    from megapipe.pipeline.executor import PipelineExecutor
    from megapipe.pipeline.executor_options import ExecutorOptions
    from megapipe.precision.main_grad import accumulated_grad
    from megapipe.schedule import build_schedule
    from megapipe.train.optim.mixed_precision import cast_to_bf16

    stage = build_stage(s.config, 0, 1, groups.ep if groups is not None else None).to(device)
    if bf16:
        cast_to_bf16([stage], list(stage.parameters()))
    schedule = build_schedule("1f1b", 1, s.microbatches, overlap=overlap)
    options = ExecutorOptions(loss_fn=gpt_loss, groups=groups, grad_reduction="none")
    with PipelineExecutor(schedule, {0: stage}, options) as run_executor:
        result = run_executor.step(*batch)
    grads = {n: (accumulated_grad(p).detach().float().cpu(), getattr(p, "expert_parallel", False))
             for n, p in stage.named_parameters()}
    return [result.losses[m].detach().float().cpu() for m in sorted(result.losses)], grads


def _bitwise(plain, combined) -> dict:  # noqa: ANN001
    differ = [n for n, (g, _) in plain[1].items() if not torch.equal(g, combined[1][n][0])]
    losses = all(torch.equal(a, b) for a, b in zip(plain[0], combined[0]))
    detail = f"{len(plain[0])} losses, {len(plain[1])} gradients"
    if differ or not losses:
        detail += f"; losses equal: {losses}; gradients differ: {', '.join(differ[:5])}"
    return {"combined_bitwise": losses and not differ, "combined_detail": detail}


def _ep_difference(sharded, references, groups, relative: bool) -> dict:  # noqa: ANN001
    """Largest ep 2 - ep 1 difference over losses, dense and expert gradients (module
    docstring); ``relative``: each tensor's largest |difference| over its largest |entry|."""
    mine = references[groups.ep_rank]
    pairs = [("loss", a, b) for a, b in zip(sharded[0], mine[0])]
    for name, (grad, is_expert) in sharded[1].items():
        expected = mine[1][name][0]
        if is_expert:
            local = grad.shape[0]
            summed = sum(ref[1][name][0] for ref in references)
            expected = summed[groups.ep_rank * local:(groups.ep_rank + 1) * local]
        pairs.append((name, grad, expected))
    worst, where = 0.0, ""
    for name, got, expected in pairs:
        diff = (got - expected).abs().max().item()
        if relative:
            diff /= max(expected.abs().max().item(), 1e-30)
        if diff > worst:
            worst, where = diff, name
    return {"ep_max_diff": worst, "ep_worst": where}
