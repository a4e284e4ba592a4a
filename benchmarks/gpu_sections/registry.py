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
TRITON_CACHE = (("TRITON_CACHE_DIR", "{scratch}/triton-cache"),)  # one cache for all sections

CHECK_S = 420  # the whole check by default, set-up included (scripts/gpu_check.sh's BUDGET)
SETUP_S = 20  # what the set-up may take of it (measured: a few seconds)

# Ordered by value: the executor's step (what the check is for), then every fused kernel, then
# the bitwise evidence with its controls; the sections after GUARANTEED run in what is left,
# the CPU-only replay last.
SECTIONS: tuple[SectionSpec, ...] = (
    SectionSpec("env", 15, 5, "device, clocks, memory, versions; copy bandwidth and bf16 GEMM "
                "TFLOP/s (the ceilings the other sections compare with)", needs_cuda=False),
    SectionSpec("executor", 110, 45, "pp = 1, 1f1b, 8 microbatches, bf16, stages built on the "
                "device: step times at hidden 1024 and 4096, all-to-all link off and on, CUDA "
                "graphs off and on: combined / plain, host issue time vs kernel time, exposed "
                "all-to-all, GPU idle share, the graphs' memory", env=TRITON_CACHE),
    SectionSpec("graphs", 60, 25, "the executor's step on a rank-capacity model, hidden 1024 "
                "and 4096: MoE layers graphed whole vs partial graphs vs eager, combined vs "
                "plain; the graphs' instances and memory", env=TRITON_CACHE),
    SectionSpec("kernels", 35, 12, "every fused operator (megapipe.kernels): GPU ms, share of "
                "HBM bandwidth, host us per launch beside an aten op's; first-call seconds",
                env=TRITON_CACHE),
    SectionSpec("bitwise", 50, 25, "the executor's runs bit for bit under deterministic kernels, "
                "with a plain-vs-plain control: combined, deferred wgrad, a slow comm stream as "
                "race detector, CUDA graphs on", env=DETERMINISTIC + TRITON_CACHE),
    SectionSpec("syncs", 20, 8, "host syncs of one combined step: every host read by node (only "
                "the dispatch's documented one), no synchronizing CUDA call, the host's wait in "
                "the read", env=TRITON_CACHE),
    SectionSpec("tests", 50, 20, "pytest tests/gpu -rA", needs_cuda=False, env=TRITON_CACHE),
    SectionSpec("pretrain", 55, 30, "world size 1 on NCCL, bf16, --deterministic-mode, 20 "
                "iterations; exit, save and resume bitwise (with a control); tokens/s",
                env=DETERMINISTIC + TRITON_CACHE),
    SectionSpec("streams", 25, 10, "profiler trace of one combined step: the stream of each "
                "node's kernels, milliseconds of compute and comm kernels at once",
                env=TRITON_CACHE),
    SectionSpec("overlap", 60, 30, "ep = 1 MoE layer pair and step in bf16, sequential vs "
                "combined (also deferred wgrad, all-to-alls in waves), all-to-all modelled on "
                "the comm stream; the two most telling shapes", env=TRITON_CACHE),
    SectionSpec("gemm", 20, 8, "experts' GEMMs, per-expert loop vs grouped_mm: TFLOP/s, host "
                "us per call"),
    SectionSpec("ep_gloo", 35, 15, "two processes on one GPU over gloo: ep = 2 vs ep = 1, "
                "combined vs plain, fp32 and bf16", env=DETERMINISTIC + TRITON_CACHE),
    SectionSpec("megatron", 40, 15, "Megatron-Core's GPT (a carried megatron-core wheel) on two "
                "processes over gloo on the GPU, bf16, pp = 1, ep = 2: megapipe's combined step "
                "vs Megatron's own combined_1f1b, bitwise", env=DETERMINISTIC + TRITON_CACHE),
    SectionSpec("replay", 90, 40, "the DeepSeek-V3 replay (overlap.py --replay) on the "
                "machine's cores: the engine's issue order with a core per thread (CPU only)",
                needs_cuda=False),
)
# The sections whose caps, with the set-up's, fit the default check: they always run in full.
GUARANTEED = ("env", "executor", "graphs", "kernels", "bitwise", "syncs", "tests",
              "pretrain")


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
