"""megatron: Megatron-Core's GPT through megapipe's combined step on the GPU, against Megatron's
own overlapped schedule (``combined_1f1b``), bitwise.

Megatron's overlap needs expert parallelism (ep > 1) and NCCL refuses two ranks on one GPU, so
two processes share the GPU over gloo (its ``all_to_all_single`` and ``all_reduce`` take CUDA
tensors), pp = 1, ep = 2 (Megatron's dp 2). Each rank builds the same small GPT (local spec,
first layer dense, then MoE layers of 4 experts top-2) in bf16 as a Megatron script does
(``config.bf16``, ``Float16Module``, DDP with fp32 gradient buffers; no ``finalize_model_grads``:
gloo has no coalesced all-reduce of CUDA tensors, so each rank's gradients are compared before
the data-parallel reduction),
runs one step of 4 microbatches with Megatron's ``get_forward_backward_func`` and
``overlap_moe_expert_parallel_comm=True``, then the same step with megapipe's
``get_forward_backward_func`` (combined 1f1b) on freshly built chunks with the same weights, all
under deterministic kernels (attention on the math backend). Losses and every fp32 main
gradient must be equal (``torch.equal``).

Where Megatron comes from: an importable ``megatron.core``, else a megatron-core wheel carried
to the machine (``$GPU_CHECK_WHEELS``, default ``.whl/`` in the repository, as the device
machine's notes say: ``pip download --no-deps --only-binary=:all: --python-version 3.12
megatron-core==0.16.1 -d .whl``), unpacked into the scratch folder and put on the path. Without
either the section is skipped and says how to carry one. On CPU (dry run) Megatron's CUDA
hard-codes are patched by the tests' ``support/megatron_cpu.py``; on a GPU only Megatron's
reference to ``te_general_gemm``, which only TransformerEngine's import defines, is filled in.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from megapipe.parallel.launch import RankExited, start_local_ranks

WORLD = 2
LAYERS, HIDDEN, VOCAB, SEQ, MICRO_BATCH, MICROBATCHES = 4, 64, 128, 32, 2, 4


@dataclass(frozen=True)
class Settings:
    cuda: bool
    out_dir: str
    repo: str


def run(ctx, result) -> None:  # noqa: ANN001
    where = _megatron_on_path(ctx)
    if where is None:
        result.skip_section(
            "megatron-core is not importable and no wheel was carried: run `pip download "
            "--no-deps --only-binary=:all: --python-version 3.12 megatron-core==0.16.1 -d .whl` "
            "in the repository before the GPU run and carry .whl")
        return
    import megatron.core

    result.figure("megatron_core", f"{megatron.core.__version__} ({where})")
    result.figure("setup", f"{WORLD} processes over gloo on {'one GPU' if ctx.cuda else 'CPU'}, "
                  f"pp 1, ep 2, {LAYERS} layers (1 dense) hidden {HIDDEN}, 4 experts top-2, "
                  f"{MICROBATCHES} microbatches of {MICRO_BATCH} x {SEQ}, bf16")
    out_dir = ctx.scratch / "megatron"
    out_dir.mkdir(exist_ok=True)
    try:
        start_local_ranks(_worker, WORLD, (Settings(ctx.cuda, str(out_dir), str(ctx.repo)),)
                          ).join()
    except RankExited as err:
        result.fail(f"{err} (its traceback is in gpu_check.log)")
        return
    for rank in range(WORLD):
        report = json.loads((out_dir / f"rank{rank}.json").read_text())
        result.check(f"rank {rank}: megapipe's combined step equals Megatron's combined_1f1b "
                     "bitwise (losses and fp32 main gradients, bf16)", report["same"],
                     report["detail"])


def _megatron_on_path(ctx) -> str | None:  # noqa: ANN001
    """Where megatron.core comes from ("installed" or the wheel's name), None if nowhere."""
    if importlib.util.find_spec("megatron") is not None:
        return "installed"
    folder = Path(os.environ.get("GPU_CHECK_WHEELS", ctx.repo / ".whl"))
    wheels = sorted(folder.glob("megatron_core-*.whl")) if folder.is_dir() else []
    if not wheels:
        return None
    site = ctx.scratch / "megatron-site"
    with zipfile.ZipFile(wheels[-1]) as wheel:
        wheel.extractall(site)
    sys.path.insert(0, str(site))  # spawned ranks inherit sys.path
    return wheels[-1].name


def _worker(rank: int, s: Settings) -> None:
    """One rank: Megatron's combined 1F1B, then megapipe's combined step, compared."""
    import torch.distributed as dist

    from megapipe.train.determinism import deterministic_kernels

    dist.init_process_group("gloo")
    if s.cuda:
        torch.cuda.set_device(0)
    _prepare_megatron(s)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random

    parallel_state.initialize_model_parallel(1, 1, None, expert_model_parallel_size=WORLD,
                                             create_gloo_process_groups=False)
    random.model_parallel_cuda_manual_seed(1234)
    with deterministic_kernels(strict=False):
        reference = _megatron_step(s)
        ours = _megapipe_step(s)
    same, detail = _compare(reference, ours)
    Path(s.out_dir, f"rank{rank}.json").write_text(json.dumps({"same": same, "detail": detail}))
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _prepare_megatron(s: Settings) -> None:
    if not s.cuda:
        sys.path.insert(0, str(Path(s.repo) / "tests"))
        from support import megatron_cpu

        megatron_cpu.apply()
        return
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # read by Megatron, defined only by TE's import


def _chunk(s: Settings, megatron_overlap: bool):  # noqa: ANN202
    """This rank's GPT chunk as a Megatron bf16 script builds it, weights keyed by global name."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=2 * HIDDEN,
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=HIDDEN,
        moe_layer_freq=[0] + [1] * (LAYERS - 1), moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01,
        expert_model_parallel_size=WORLD, pipeline_dtype=torch.bfloat16,
        params_dtype=torch.float32, bf16=True, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0, add_bias_linear=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        masked_softmax_fusion=False, apply_rope_fusion=False,
        overlap_moe_expert_parallel_comm=megatron_overlap,
    )
    # no finalize_model_grads: the ranks' fp32 main gradients are compared before any
    # reduction (gloo has no coalesced all-reduce of CUDA tensors, which Megatron's DDP uses)
    config.finalize_model_grads_func = None
    model = GPTModel(config, get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False),
                     vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope")
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    with torch.no_grad():
        for name, param in model.named_parameters():
            key = _global_name(name, ep_rank)
            generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            param.copy_(torch.randn(param.shape, generator=generator) * 0.02
                        + (1.0 if key.endswith("layernorm.weight") else 0.0))
    if s.cuda:
        model.cuda(torch.cuda.current_device())
    wrapped = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True),
        Float16Module(config, model),
    )
    return wrapped


def _global_name(name: str, ep_rank: int) -> str:
    """The parameter's name with the expert index made global (the same weights at any ep)."""
    import re

    local = 4 // WORLD
    return re.sub(r"local_experts\.(\d+)\.",
                  lambda m: f"local_experts.{ep_rank * local + int(m.group(1))}.", name)


def _data(s: Settings) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from megatron.core import parallel_state

    dp_rank = parallel_state.get_data_parallel_rank()
    device = torch.device("cuda", 0) if s.cuda else torch.device("cpu")
    out = []
    for i in range(MICROBATCHES):
        ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1),
                            generator=torch.Generator().manual_seed(100 * dp_rank + i))
        out.append((ids[:, :-1].to(device), ids[:, 1:].to(device)))
    return out


def _loss_func(output: torch.Tensor):  # noqa: ANN202
    total = output.float().sum()
    tokens = torch.tensor(output.numel(), dtype=torch.int, device=output.device)
    return total, tokens, {"lm loss": (total / tokens).detach()}


def _forward_step(data_iterator, model, return_schedule_plan: bool = False):  # noqa: ANN001, ANN202
    tokens, labels = next(data_iterator)
    positions = torch.arange(SEQ, device=tokens.device).unsqueeze(0).expand_as(tokens)
    if return_schedule_plan:  # what Megatron's own combined 1F1B asks for
        return model.build_schedule_plan(tokens, positions, None, labels=labels), _loss_func
    return model(tokens, positions, None, labels=labels), _loss_func


def _step(s: Settings, func, chunk) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:  # noqa: ANN001
    chunk.zero_grad_buffer()
    losses = func(forward_step_func=_forward_step, data_iterator=iter(_data(s)), model=chunk,
                  num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=MICRO_BATCH)
    grads = {name: p.main_grad.detach().float().cpu().clone()
             for name, p in chunk.named_parameters() if getattr(p, "main_grad", None) is not None}
    return [d["lm loss"].detach().float().cpu() for d in losses], grads


def _megatron_step(s: Settings):  # noqa: ANN202
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return _step(s, get_forward_backward_func(), _chunk(s, megatron_overlap=True))


def _megapipe_step(s: Settings):  # noqa: ANN202
    from megapipe import get_forward_backward_func
    from megapipe.parallel.config import ParallelConfig
    from megapipe.parallel.groups import create_groups

    groups = create_groups(ParallelConfig(pp=1, dp=WORLD, ep=WORLD))
    func = get_forward_backward_func(pp=1, groups=groups, timeout=120.0,
                                     overlap_moe_expert_parallel_comm=True, reduce_grads=False)
    try:
        return _step(s, func, _chunk(s, megatron_overlap=False))
    finally:
        func.close()


def _compare(reference, ours) -> tuple[bool, str]:  # noqa: ANN001
    (ref_losses, ref_grads), (losses, grads) = reference, ours
    losses_same = len(losses) == len(ref_losses) == MICROBATCHES and all(
        torch.equal(a, b) for a, b in zip(ref_losses, losses))
    differ = sorted(
        n for n in ref_grads if n not in grads or not torch.equal(ref_grads[n], grads[n])
    )
    detail = (
        f"{len(losses)} losses ({'equal' if losses_same else 'differ'}), "
        f"{len(ref_grads)} gradients" + (f"; differ: {', '.join(differ[:5])}" if differ else "")
    )
    return losses_same and not differ and len(grads) == len(ref_grads) > 0, detail
