"""Train Megatron-Core's own MoE GPT through megapipe, with the all-to-all overlapped.

A Megatron-Core script keeps its model (``GPTModel`` chunks), its ``forward_step_func`` and its
loop; it swaps one import and turns the overlap on:

    # from megatron.core.pipeline_parallel import get_forward_backward_func
    from megapipe import get_forward_backward_func
    forward_backward_func = get_forward_backward_func(
        pp=PP, vpp=VPP, groups=groups, overlap_moe_expert_parallel_comm=True)

megapipe wraps each chunk in its adapter (``megapipe.megatron.mcore_adapter``), so the combined
schedule co-schedules one microbatch's forward with another's backward, layer by layer, and
gradients come out as Megatron's own schedules give them.

CPU (starts 4 gloo processes: pp=2, vpp=2, dp=2, ep=2; Megatron's CUDA hard-codes are patched
by ``tests/support/megatron_cpu.py``, which this script imports only on CPU):

    python examples/megatron_core_gpt.py [--iters 3] [--schedule zbv]

GPUs (no patches; NCCL), 4 GPUs:

    torchrun --nproc-per-node 4 examples/megatron_core_gpt.py

Needs ``pip install 'megapipe[megatron]'`` (any megatron-core release from 0.16.1 to 0.19.2).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from megapipe import get_forward_backward_func  # the one line a Megatron user changes
from megapipe.parallel import ParallelConfig, create_groups, start_local_ranks
from megapipe.parallel.launch import init_distributed
from megapipe.schedule import build_schedule

PP, VPP, EP = 2, 2, 2
NUM_MICROBATCHES, MICRO_BATCH_SIZE, SEQ, VOCAB = 4, 2, 32, 256


def use_megatron_on_cpu() -> None:
    """Megatron-Core assumes CUDA in places that do not change the numbers; patch them."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from support import megatron_cpu

    megatron_cpu.apply()


def make_config(device: torch.device):
    """8 layers: a dense first layer (``moe_layer_freq``), then MoE layers with 4 experts (top
    2) and a shared expert."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=8, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64,
        moe_layer_freq=[0] + [1] * 7, moe_shared_expert_intermediate_size=64,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.01, pipeline_model_parallel_size=PP,
        virtual_pipeline_model_parallel_size=VPP, expert_model_parallel_size=EP,
        pipeline_dtype=torch.float32, use_cpu_initialization=device.type == "cpu",
        hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, masked_softmax_fusion=False, apply_rope_fusion=False,
    )


def part_spec(config, part: int, num_parts: int):
    """The layer specs of model part ``part``: Megatron's per-layer specs, which honour
    ``moe_layer_freq`` (one layer spec for all layers would make every layer MoE)."""
    from megatron.core.models.gpt.gpt_layer_specs import LNImpl, get_gpt_decoder_layer_specs
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    specs = list(get_gpt_decoder_layer_specs(config, use_transformer_engine=False))
    per_part = len(specs) // num_parts
    return TransformerBlockSubmodules(
        layer_specs=specs[part * per_part:(part + 1) * per_part], layer_norm=LNImpl
    )


def build_model(device: torch.device, schedule: str | None) -> list[torch.nn.Module]:
    """Megatron's MoE GPT, one chunk per virtual stage, as a Megatron script builds it, with
    the model parts megapipe's schedule places on this rank (V placement for zbv/dualpipev)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = make_config(device)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    placement = build_schedule(schedule or "interleaved-1f1b", PP, NUM_MICROBATCHES, vpp=VPP)
    chunks = []
    for j, stage in enumerate(placement.stages_of_rank(pp_rank)):  # loop: part r + j * PP
        part = placement.model_part(stage)
        chunks.append(GPTModel(
            config, part_spec(config, part, PP * VPP), vocab_size=VOCAB,
            max_sequence_length=SEQ, pre_process=part == 0, post_process=part == PP * VPP - 1,
            position_embedding_type="rope", vp_stage=j,
        ).to(device))
    return chunks


def forward_step(data_iterator, model):
    """Megatron's forward_step_func: read a batch, run the chunk, hand back the loss function."""
    tokens, labels = next(data_iterator)
    positions = torch.arange(SEQ, device=tokens.device).unsqueeze(0).expand_as(tokens)
    output = model(tokens, positions, None, labels=labels)

    def loss_func(output_tensor):
        total = output_tensor.float().sum()
        num_tokens = torch.tensor(output_tensor.numel(), dtype=torch.int, device=total.device)
        return total, num_tokens, {"lm loss": (total / num_tokens).detach()}

    return output, loss_func


def batches(dp_rank: int, iteration: int, device: torch.device):
    g = torch.Generator().manual_seed(1000 * iteration + dp_rank)
    for _ in range(NUM_MICROBATCHES):
        ids = torch.randint(0, VOCAB, (MICRO_BATCH_SIZE, SEQ + 1), generator=g).to(device)
        yield ids[:, :-1], ids[:, 1:]


def train(rank: int | None, iters: int, schedule: str | None) -> None:
    info = init_distributed()
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", info.local_rank) if on_gpu else torch.device("cpu")
    if not on_gpu:
        use_megatron_on_cpu()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(1, PP, VPP, expert_model_parallel_size=EP)
    model_parallel_cuda_manual_seed(1234)
    dp = dist.get_world_size() // PP
    groups = create_groups(ParallelConfig(pp=PP, dp=dp, ep=EP))  # Megatron's rank order too
    model = build_model(device, schedule)
    optimizer = torch.optim.AdamW([p for c in model for p in c.parameters()], lr=1e-3)
    forward_backward_func = get_forward_backward_func(
        pp=PP, vpp=VPP, schedule=schedule, groups=groups, overlap_moe_expert_parallel_comm=True,
    )
    for iteration in range(iters):
        optimizer.zero_grad(set_to_none=True)
        losses = forward_backward_func(
            forward_step_func=forward_step,
            data_iterator=[batches(groups.dp_rank, iteration, device) for _ in model],
            model=model, num_microbatches=NUM_MICROBATCHES, seq_length=SEQ,
            micro_batch_size=MICRO_BATCH_SIZE,
        )  # gradients averaged over DP by megapipe (reduce_grads=True, the default)
        optimizer.step()
        if losses and groups.dp_rank == 0:
            mean = sum(d["lm loss"].item() for d in losses) / len(losses)
            print(f"iteration {iteration}: lm loss {mean:.4f}", flush=True)
    forward_backward_func.close()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--schedule", default=None,
                        help="a megapipe schedule (default: interleaved-1f1b), e.g. zbv, dualpipev")
    args = parser.parse_args(argv)
    if "RANK" in os.environ:  # torchrun (or srun through torchrun's variables)
        train(None, args.iters, args.schedule)
    else:
        start_local_ranks(train, PP * 2, (args.iters, args.schedule)).join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
