"""Published-style Hugging Face checkpoints for the ``--load-hf`` tests: tiny Qwen3-MoE (both
router forms), Mixtral and OLMoE models made and saved by transformers itself (random weights,
``save_pretrained``; one sharded into several files), and the rank-side code that starts a
pipeline/expert layout from them (``layout_run``)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from megapipe.hf.load_hf import hf_model_config, load_hf
from megapipe.models.gpt import gpt_loss
from megapipe.models.split import build_stage, copy_into_stage
from megapipe.parallel.config import ParallelConfig
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.pipeline.executor_options import ExecutorOptions
from megapipe.pipeline.p2p import TensorSpec
from megapipe.schedule import build_schedule
from megapipe.train.checkpoint.reader import CONFIG_KEY, TOKENIZER_KEY
from megapipe.train.checkpoint.state import save_checkpoint
from support.pipeline_cases import prepare_groups, subworld_groups

VOCAB, SEQ, MICRO_BATCH, MICROBATCHES = 300, 16, 2, 4
SHARED = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, max_position_embeddings=SEQ)
# name -> (transformers config class, its fields, save_pretrained's max_shard_size)
CASES = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        SHARED, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        head_dim=12, num_experts=4, mlp_only_layers=[0], norm_topk_prob=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0}), None),
    "qwen3_moe_renormalised": ("Qwen3MoeConfig", dict(
        SHARED, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_experts=4, norm_topk_prob=True, tie_word_embeddings=True), "40KB"),
    "mixtral": ("MixtralConfig", dict(SHARED, intermediate_size=16, num_hidden_layers=2,
                                      num_local_experts=4), None),
    "olmoe": ("OlmoeConfig", dict(SHARED, intermediate_size=16, num_hidden_layers=2,
                                  num_experts=4, eos_token_id=0), None),
}
LAYOUT = ParallelConfig(pp=2, dp=2, ep=2)  # 4 ranks: 2 stages, experts over 2 ranks


def save_published(name: str, directory: Path) -> None:
    """Case ``name`` made by transformers, its weights moved off their init (seeded noise;
    norms away from 1 so a swapped norm shows), saved with ``save_pretrained``."""
    import transformers

    kind, fields, shard = CASES[name]
    config = getattr(transformers, kind)(**fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param.dim() == 1:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.add_((0.3 if param_name.endswith("gate.weight") else 0.05)
                           * torch.randn_like(param))
    model.save_pretrained(directory, **({} if shard is None else {"max_shard_size": shard}))


def batch(dp_rank: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Microbatch ``index`` of data-parallel rank ``dp_rank``: (tokens, next tokens)."""
    g = torch.Generator().manual_seed(1000 * dp_rank + index)
    ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def transformers_model(directory: Path) -> torch.nn.Module:
    """The directory loaded by transformers (fp32, eval)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def transformers_loss(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor
                      ) -> float:
    """transformers' own causal-LM loss of ``labels`` after ``tokens`` (no shift)."""
    with torch.no_grad():
        return model(input_ids=tokens, labels=labels, shift_labels=labels).loss.item()


def layout_run(directories: dict[str, str], root: str) -> dict | None:
    """Every directory started in ``LAYOUT`` with the combined step (1F1B with the overlap):
    each rank reads only its stages' tensors; per case the step's losses, the names it read,
    and a checkpoint under ``root/NAME`` (for ``export-hf``)."""
    prepare_groups([LAYOUT])
    if dist.get_rank() >= LAYOUT.pp * LAYOUT.dp:
        return None
    groups = subworld_groups(LAYOUT)
    out: dict = {"dp_rank": groups.dp_rank, "pp_rank": groups.pp_rank, "cases": {}}
    for name, directory in directories.items():
        schedule = build_schedule("1f1b", LAYOUT.pp, MICROBATCHES, overlap=True)
        config = hf_model_config(directory)
        stages = {s: build_stage(config, schedule.model_part(s), schedule.stages_per_pipeline,
                                 groups.ep)
                  for s in schedule.stages_of_rank(groups.pp_rank)}
        names = {n for stage in stages.values() for n, _ in stage.named_parameters()}
        _, state = load_hf(directory, keep=names.__contains__)
        for stage in stages.values():
            copy_into_stage(stage, state)
        data = [batch(groups.dp_rank, i) for i in range(MICROBATCHES)]
        spec = TensorSpec((MICRO_BATCH, SEQ, config.hidden_size), torch.float32)
        options = ExecutorOptions(spec=spec, loss_fn=gpt_loss, groups=groups, timeout=30.0)
        with PipelineExecutor(schedule, stages, options) as executor:
            result = executor.step([d[0] for d in data], [d[1] for d in data])
        params = [p for stage in stages.values() for p in stage.parameters()]
        descriptor = {"model": {CONFIG_KEY: config.to_dict(),
                                TOKENIZER_KEY: {"tokenizer_type": "ByteTokenizer"}},
                      "parallel": {"pp": LAYOUT.pp, "vpp": 1, "ep": LAYOUT.ep, "dp": LAYOUT.dp,
                                   "world_size": LAYOUT.pp * LAYOUT.dp},
                      "info": {}}
        save_checkpoint(Path(root) / name, 1, stages, torch.optim.AdamW(params), {}, descriptor)
        out["cases"][name] = {"losses": {i: v.item() for i, v in result.losses.items()},
                              "read": sorted(state), "held": sorted(names)}
    return out
