"""Host time per layer pair: Megatron-Core's own ``combined_1f1b`` beside megapipe's combined step.

``python benchmarks/host_cost.py --megatron`` runs this (needs megatron-core 0.16.1). Two gloo
processes (pp 1, ep 2), each with Megatron-Core's ``GPTModel`` built from the local layer spec
(``MOE_LAYERS`` MoE layers, tiny sizes so that the host's work dominates, fp32: bf16 matmuls are
slow compute on a CPU, not host cost), run the same training step of ``MICROBATCHES``
microbatches three ways, one after the other, for ``rounds`` rounds:

- ``megatron``: Megatron's ``get_forward_backward_func()`` with
  ``overlap_moe_expert_parallel_comm`` set on the model's config (its combined 1F1B: set after
  the config is built, since the config asserts bf16 while the path itself only casts the loss);
- ``megapipe``: megapipe's ``get_forward_backward_func(overlap_moe_expert_parallel_comm=True)``
  on the same chunks (its adapter, its combined step);
- ``megapipe-gpt``: megapipe's own MoE GPT of the same sizes through the same engine.

Megatron's CUDA streams are the host thread on CPU (``tests/support/megatron_cpu``), so its
comm and compute run on one thread; megapipe runs here with the same one-thread streams (both
``InlineStream``), as a GPU host issues both streams from one thread. Measured: the CPU time of
that thread per step (``time.thread_time``; other processes cannot change it), median over the
rounds, divided by ``MICROBATCHES x MOE_LAYERS`` (one layer's forward and backward of one
microbatch: a layer pair's worth). Rank 0 prints; the last line is ``host ratio
megapipe/megatron: X.XX``: megapipe's step over Megatron's step of the same round, median over
the rounds, mean of the two ranks.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
MOE_LAYERS, MICROBATCHES, SEQ, MICRO_BATCH, VOCAB = 4, 8, 32, 2, 64
HIDDEN, HEADS, FFN, EXPERTS, TOPK = 64, 4, 128, 4, 2
LABELS = ("megatron", "megapipe", "megapipe-gpt")


def _setup() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from support import megatron_cpu

    megatron_cpu.apply()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random

    parallel_state.initialize_model_parallel(1, 1, None, expert_model_parallel_size=2,
                                             create_gloo_process_groups=False)
    random.model_parallel_cuda_manual_seed(1234)


def _mcore_model() -> Any:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=MOE_LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        ffn_hidden_size=FFN, num_moe_experts=EXPERTS, moe_router_topk=TOPK,
        moe_ffn_hidden_size=FFN, moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01,
        expert_model_parallel_size=2, pipeline_dtype=torch.float32,
        params_dtype=torch.float32, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0, add_bias_linear=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        masked_softmax_fusion=False, apply_rope_fusion=False,
        deallocate_pipeline_outputs=False,
    )
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    torch.manual_seed(0)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope")


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(MICROBATCHES):
        ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def _loss(output: torch.Tensor):
    total = output.float().sum()
    count = torch.tensor(output.numel(), dtype=torch.int)
    return total, count, {"lm loss": (total / count).detach()}


def _forward_step(data_iterator: Any, model: Any, return_schedule_plan: bool = False):
    tokens, labels = next(data_iterator)
    positions = torch.arange(SEQ).unsqueeze(0).expand_as(tokens)
    if return_schedule_plan:  # what Megatron's combined 1F1B asks for
        return model.build_schedule_plan(tokens, positions, None, labels=labels), _loss
    return model(tokens, positions, None, labels=labels), _loss


class _MegatronStep:
    """One training step of Megatron's GPT through Megatron's schedule or megapipe's."""

    def __init__(self, model: Any, func: Any, data: list) -> None:
        self.model, self.func, self.data = model, func, data

    def __call__(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self.func(forward_step_func=_forward_step, data_iterator=iter(self.data),
                  model=self.model, num_microbatches=MICROBATCHES, seq_length=SEQ,
                  micro_batch_size=MICRO_BATCH)


class _GptStep:
    """One training step of megapipe's own GPT through its executor (1F1B with overlap)."""

    def __init__(self, groups: Any, data: list) -> None:
        from megapipe.models import GPTConfig, build_stage
        from megapipe.models.gpt import gpt_loss
        from megapipe.pipeline.executor import PipelineExecutor
        from megapipe.pipeline.executor_options import ExecutorOptions
        from megapipe.schedule import build_schedule

        config = GPTConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=MOE_LAYERS,
                           num_heads=HEADS, seq_length=SEQ, ffn_hidden_size=FFN,
                           num_experts=EXPERTS, moe_top_k=TOPK, moe_ffn_hidden_size=FFN)
        self.stage = build_stage(config, 0, 1, ep_group=groups.ep)
        schedule = build_schedule("1f1b", 1, MICROBATCHES, overlap=True)
        self.executor = PipelineExecutor(schedule, {0: self.stage}, ExecutorOptions(
            groups=groups, loss_fn=gpt_loss, grad_reduction="none"))
        self.tokens = [t for t, _ in data]
        self.labels = [lab for _, lab in data]

    def __call__(self) -> None:
        self.stage.zero_grad(set_to_none=True)
        self.executor.step(self.tokens, self.labels)


def _one_thread_streams(device: Any = "cpu") -> Any:
    """Both streams on the calling thread, as Megatron's streams are on CPU (module docstring)."""
    from megapipe.overlap.streams import InlineStream, Streams

    return Streams(InlineStream("compute"), InlineStream("comm"))


def _rank(rank: int, rounds: int, out: str) -> None:
    import importlib
    import warnings

    import torch.distributed as dist

    from megapipe import get_forward_backward_func
    from megapipe.parallel import ParallelConfig, create_groups, init_distributed

    warnings.filterwarnings("ignore")  # Megatron's notes on Apex, deprecations
    init_distributed()
    torch.set_num_threads(1)
    _setup()
    executor_module = importlib.import_module("megapipe.pipeline.executor")
    executor_module.make_streams = _one_thread_streams  # module docstring
    from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_func

    groups = create_groups(ParallelConfig(pp=1, dp=2, ep=2))
    data = _batches(rank)
    model = _mcore_model()
    model.config.overlap_moe_expert_parallel_comm = True  # after __post_init__ (docstring)
    megapipe_func = get_forward_backward_func(pp=1, groups=groups, reduce_grads=False,
                                              overlap_moe_expert_parallel_comm=True)
    steps = {"megatron": _MegatronStep(model, megatron_func(), data),
             "megapipe": _MegatronStep(model, megapipe_func, data),
             "megapipe-gpt": _GptStep(groups, data)}
    times: dict[str, list[float]] = {label: [] for label in LABELS}
    for r in range(rounds + 1):  # the first round warms up
        for label in LABELS:
            dist.barrier()
            start = time.thread_time()
            steps[label]()
            if r:
                times[label].append(time.thread_time() - start)
    megapipe_func.close()
    steps["megapipe-gpt"].executor.close()
    medians = {label: statistics.median(v) for label, v in times.items()}
    # the ratio of each round (its steps minutes apart at most), median over rounds: steadier
    # than the ratio of medians where the machine's load changes during the run
    medians["ratio"] = statistics.median(m / g for m, g in zip(times["megapipe"],
                                                               times["megatron"]))
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, medians)
    if rank == 0:
        Path(out).write_text(repr(gathered))
    dist.barrier()  # neither rank tears gloo down while the other still uses it
    dist.destroy_process_group()


def run(rounds: int) -> int:
    """Start the two ranks, print the table and the ratio (module docstring)."""
    import tempfile
    import warnings

    from megapipe.parallel.launch import start_local_ranks

    try:
        with warnings.catch_warnings():  # Megatron's notes on Apex and TransformerEngine
            warnings.simplefilter("ignore")
            import megatron.core  # noqa: F401
    except ImportError:
        print("--megatron needs megatron-core (bash scripts/setup.sh installs 0.16.1)")
        return 2
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "medians")
        ranks = start_local_ranks(_rank, 2, (rounds, out), threads=1)
        for process in ranks.processes:
            process.join()
        if any(p.exitcode for p in ranks.processes):
            print(f"a rank failed: exit codes {[p.exitcode for p in ranks.processes]}")
            return 1
        per_rank = eval(Path(out).read_text())  # noqa: S307 - our own repr of floats
    pairs = MICROBATCHES * MOE_LAYERS
    print(f"Megatron-Core GPT (local spec), pp 1, ep 2, {MOE_LAYERS} MoE layers, hidden "
          f"{HIDDEN}, {MICROBATCHES} microbatches of {MICRO_BATCH} x {SEQ} tokens, fp32; host "
          f"CPU time of the issuing thread, median of {rounds} rounds, per layer pair "
          f"(ranks 0 / 1):")
    for label in LABELS:
        values = [m[label] * 1e3 / pairs for m in per_rank]
        print(f"  {label:<13} {values[0]:.3f} / {values[1]:.3f} ms per layer pair")
    ratio = statistics.mean(m["ratio"] for m in per_rank)
    print(f"host ratio megapipe/megatron: {ratio:.2f}")
    return 0
