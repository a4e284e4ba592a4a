"""The sections of the GPU check, in priority order, with their time caps and minimums."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SectionSpec:
    """One section: module ``gpu_sections.sec_<name>``; ``cap_s``/``min_s`` feed the budget;
    ``needs_cuda``: outside a dry run, skipped whole without a GPU; ``env``: extra environment
    for its process ("{scratch}" is replaced by the run's scratch folder)."""

    name: str
    cap_s: float
    min_s: float
    what: str
    needs_cuda: bool = True
    env: tuple[tuple[str, str], ...] = ()

    @property
    def module(self) -> str:
        return f"gpu_sections.sec_{self.name}"


DETERMINISTIC = (("CUBLAS_WORKSPACE_CONFIG", ":4096:8"),)  # before the process's first GEMM

# Ordered by value: the evidence that megapipe is right on a GPU first (tests, syncs, the
# executor's bitwise runs), then what it buys (streams, overlap), then the parts around it.
SECTIONS: tuple[SectionSpec, ...] = (
    SectionSpec("env", 30, 10, "device, clocks, memory, versions; copy bandwidth and bf16 GEMM "
                "TFLOP/s (the ceilings the other sections compare with)", needs_cuda=False),
    SectionSpec("tests", 80, 20, "pytest tests/gpu -rA", needs_cuda=False),
    SectionSpec("syncs", 30, 10, "host syncs of one combined step: every host read by node (only "
                "the dispatch's documented one), no synchronizing CUDA call, the host's wait in "
                "the read"),
    SectionSpec("executor", 120, 35, "pp = 1, 1f1b, 8 microbatches, bf16, deterministic "
                "kernels: plain vs combined bitwise, CUDA graphs off and on (with a "
                "plain-vs-plain control, and with a slow comm stream as race detector); step "
                "times at hidden 1024 and 4096, graphs off and on: host issue time, kernel time, "
                "exposed all-to-all, GPU idle share, the graphs' memory", env=DETERMINISTIC),
    SectionSpec("streams", 30, 10, "profiler trace of one combined step: the stream of each "
                "node's kernels, milliseconds of compute and comm kernels at once"),
    SectionSpec("overlap", 75, 30, "ep = 1 MoE layer pair and step in bf16, sequential vs "
                "combined (also deferred wgrad, all-to-alls in waves), all-to-all modelled on "
                "the comm stream; the two most telling shapes"),
    SectionSpec("replay", 120, 40, "the DeepSeek-V3 replay (overlap.py --replay) on the "
                "machine's cores: the engine's issue order with a core per thread",
                needs_cuda=False),
    SectionSpec("gemm", 25, 8, "experts' GEMMs, per-expert loop vs grouped_mm: TFLOP/s, host "
                "us per call"),
    SectionSpec("kernels", 35, 10, "Triton permute/unpermute forward and backward: GB/s vs torch "
                "and vs the copy bandwidth; compile times",
                env=(("TRITON_CACHE_DIR", "{scratch}/triton-cache-kernels"),)),
    SectionSpec("pretrain", 75, 30, "world size 1 on NCCL, bf16, --deterministic-mode, 20 "
                "iterations; exit, save and resume bitwise; tokens/s", env=DETERMINISTIC),
    SectionSpec("ep_gloo", 40, 15, "two processes on one GPU over gloo: ep = 2 vs ep = 1, "
                "combined vs plain, fp32 and bf16", env=DETERMINISTIC),
    SectionSpec("megatron", 45, 15, "Megatron-Core's GPT (a carried megatron-core wheel) on two "
                "processes over gloo on the GPU, bf16, pp = 1, ep = 2: megapipe's combined step "
                "vs Megatron's own combined_1f1b, bitwise", env=DETERMINISTIC),
)


def select(names: str | None) -> tuple[SectionSpec, ...]:
    """The sections named in a comma list (in priority order), all of them for None."""
    if not names:
        return SECTIONS
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = {s.name for s in SECTIONS}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise ValueError(
            f"--sections: unknown section(s) {', '.join(unknown)}; known: "
            f"{', '.join(s.name for s in SECTIONS)}"
        )
    return tuple(s for s in SECTIONS if s.name in wanted)
