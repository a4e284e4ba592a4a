"""A Megatron-style training loop that runs on megapipe by changing one import.

The script below is what a Megatron-Core user already has: a ``forward_step_func`` that reads
a batch and returns ``(output_tensor, loss_func)``, a list of model chunks under virtual
pipelining, and a call to the function ``get_forward_backward_func`` returns. Only the import
changes:

    # from megatron.core.pipeline_parallel import get_forward_backward_func
    from megapipe import get_forward_backward_func

Run it on CPU (it starts 4 gloo processes: pp=2, vpp=2, dp=2, ep=2, tiny MoE GPT):

    python examples/megatron_front_end.py [--iters 3]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import torch
import torch.distributed as dist

from megapipe import get_forward_backward_func  # the one line a Megatron user changes
from megapipe.models.config import GPTConfig
from megapipe.models.gpt import gpt_loss
from megapipe.models.split import build_stage
from megapipe.parallel import ParallelConfig, create_groups, start_local_ranks

PP, VPP, DP, EP = 2, 2, 2, 2
NUM_MICROBATCHES, MICRO_BATCH_SIZE = 4, 2
CONFIG = GPTConfig(num_layers=6, seq_length=16)


# ---- unchanged Megatron-style user code ---------------------------------------------------
def loss_func(labels: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron's 3-tuple form: (summed loss, number of tokens, values to log)."""
    loss = gpt_loss(output_tensor, labels)
    num_tokens = torch.tensor(float(labels.numel()))
    return loss * num_tokens, num_tokens, {"lm loss": loss.detach()}


def forward_step(data_iterator, model):
    """Read one microbatch; a chunk after the first uses the tensor set by set_input_tensor."""
    tokens, labels = next(data_iterator)
    output_tensor = model(tokens if model.is_first else None)
    return output_tensor, partial(loss_func, labels)


def batches(dp_rank: int, iteration: int):
    g = torch.Generator().manual_seed(1000 * iteration + dp_rank)
    for _ in range(NUM_MICROBATCHES):
        ids = torch.randint(0, CONFIG.vocab_size, (MICRO_BATCH_SIZE, CONFIG.seq_length + 1), generator=g)
        yield ids[:, :-1], ids[:, 1:]


# ---- the training loop ----------------------------------------------------------------------
def train(rank: int, iters: int) -> None:
    dist.init_process_group("gloo")  # torchrun's variables, set by start_local_ranks
    groups = create_groups(ParallelConfig(pp=PP, dp=DP, ep=EP))
    # chunk j of pipeline rank r is model part r + j * PP (Megatron's virtual pipeline order)
    model = [
        build_stage(CONFIG, groups.pp_rank + j * PP, PP * VPP, ep_group=groups.ep)
        for j in range(VPP)
    ]
    params = [p for chunk in model for p in chunk.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1)
    forward_backward_func = get_forward_backward_func(pp=PP, vpp=VPP, groups=groups)
    for iteration in range(iters):
        optimizer.zero_grad(set_to_none=True)
        data_iterator = [batches(groups.dp_rank, iteration) for _ in model]  # one per chunk
        losses = forward_backward_func(
            forward_step_func=forward_step,
            data_iterator=data_iterator,
            model=model,
            num_microbatches=NUM_MICROBATCHES,
            seq_length=CONFIG.seq_length,
            micro_batch_size=MICRO_BATCH_SIZE,
        )
        optimizer.step()
        # each of this rank's MoE layers' router loss over the call (the front end empties the
        # layers' logs after every call, as Megatron clears its tracker)
        aux = forward_backward_func.aux_losses()
        if losses and groups.dp_rank == 0:  # the last pipeline stage holds the loss dicts
            mean = sum(d["lm loss"].item() for d in losses) / len(losses)
            aux_text = f", router loss {sum(a.item() for a in aux) / len(aux):.4f}" if aux else ""
            print(f"iteration {iteration}: lm loss {mean:.4f}{aux_text}", flush=True)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args(argv)
    start_local_ranks(train, PP * DP, (args.iters,)).join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
