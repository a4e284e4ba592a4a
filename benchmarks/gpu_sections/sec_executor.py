"""executor: the pipeline executor's step on one GPU -- pp = 1, 1f1b, 8 microbatches of the
reference MoE GPT in bf16 (fp32 main gradients, ``cast_to_bf16``), built on the device
(``executor_steps.bf16_stage``), plain schedule vs its combined variant. The first section
after ``env``: these are the figures the check is for.

- Step times at hidden 1024 and 4096, CUDA graphs off and on: plain and combined steps
  alternating, median GPU milliseconds and host milliseconds per step (issue time: until
  ``step`` returned), the summed kernel time of a step (torch.profiler) and the host's share of
  it, the device allocations (``cudaMalloc``) a warm step makes; without a link (ep = 1: the
  comm nodes move nothing, so the ratio is the co-scheduling's own cost) and with megapipe's
  ``EmulatedLink`` making each all-to-all last the mean experts node (comm ~ compute: the whole
  pipeline step's gain from hiding it); the graphs' instances and private-pool memory.
- GPU idle share and exposed all-to-all of a combined step, from the executor's own node trace
  (``record_trace``: CUDA events around every node on the streams).

The bitwise comparisons of the same executor runs are the ``bitwise`` section's.
"""

from __future__ import annotations

from gpu_sections.executor_steps import describe, step_times
from megapipe.models.config import GPTConfig

REAL = (GPTConfig(hidden_size=1024, num_heads=16, num_layers=4, seq_length=1024,
                  ffn_hidden_size=4096, num_experts=8, moe_top_k=2, moe_ffn_hidden_size=2048,
                  first_k_dense_layers=1), 2)
WIDE = (GPTConfig(hidden_size=4096, num_heads=32, num_layers=3, seq_length=1024,
                  ffn_hidden_size=8192, num_experts=8, moe_top_k=2, moe_ffn_hidden_size=2048,
                  first_k_dense_layers=1), 2)
DRY = (GPTConfig(hidden_size=32, num_heads=2, num_layers=2, seq_length=16, ffn_hidden_size=64,
                 num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32, first_k_dense_layers=1), 2)


def run(ctx, result) -> None:  # noqa: ANN001
    config, micro_batch = REAL if ctx.cuda else DRY
    result.figure("model", describe(config, micro_batch))
    shapes = (REAL, WIDE) if ctx.cuda else (DRY,)  # a dry run checks the code: one shape
    measured = {}
    for index, (config, micro_batch) in enumerate(shapes):
        h = config.hidden_size
        if index:
            result.figure(f"model_h{h}", describe(config, micro_batch))
        if ctx.enough_time(result, f"step times, hidden {h}", (30.0, 45.0)[index] if ctx.cuda
                           else 2.0):
            measured[index] = step_times(ctx, result, config, micro_batch,
                                         f"h{h}_" if index else "")
    _targets(ctx, result, measured)


def _targets(ctx, result, measured: dict) -> None:  # noqa: ANN001
    """Issue 30's GPU goals, with CUDA graphs on (reported, never failing the section)."""
    if not ctx.cuda:
        return
    link = "sleep link, comm ~ experts"
    if 0 in measured:
        speedup, host_share = measured[0][("no link", True)]
        result.target("combined / plain step, hidden 1024, nothing to hide, graphs on", speedup,
                      ">= 0.97", speedup >= 0.97)
        result.target("host issue / kernel time, combined step, hidden 1024, graphs on",
                      host_share, "<= 0.6", None if host_share is None else host_share <= 0.6)
    if 1 in measured:
        speedup, _ = measured[1][(link, True)]
        result.target("combined / plain step, hidden 4096, sleep link, graphs on", speedup,
                      ">= 1.4", speedup >= 1.4)
