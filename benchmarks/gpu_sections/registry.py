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


SECTIONS: tuple[SectionSpec, ...] = (
    SectionSpec("env", 40, 15, "device, clocks, memory, versions; copy bandwidth and bf16 GEMM "
                "TFLOP/s (the ceilings the other sections compare with)", needs_cuda=False),
    SectionSpec("tests", 120, 30, "pytest tests/gpu -rA", needs_cuda=False),
    SectionSpec("syncs", 45, 15, "host syncs of one combined step: every host read by node (only "
                "the dispatch's documented one), sync-debug sites, the host's wait in the read"),
    SectionSpec("streams", 50, 20, "profiler trace of one combined step: the stream of each "
                "node's kernels, milliseconds of compute and comm kernels at once"),
    SectionSpec("overlap", 180, 60, "ep = 1 MoE layer pair and step in bf16, sequential vs "
                "combined (also deferred wgrad, chunked all-to-alls), all-to-all modelled on "
                "the comm stream"),
    SectionSpec("gemm", 35, 10, "experts' GEMMs, per-expert loop vs grouped_mm: TFLOP/s, host "
                "us per call"),
    SectionSpec("kernels", 50, 15, "Triton permute/unpermute forward and backward: GB/s vs torch "
                "and vs the copy bandwidth; compile times",
                env=(("TRITON_CACHE_DIR", "{scratch}/triton-cache-kernels"),)),
    SectionSpec("executor", 60, 20, "pp = 1, 1f1b, 8 microbatches, bf16: plain vs combined "
                "bitwise, step times without and with a modelled link, GPU idle share",
                env=(("CUBLAS_WORKSPACE_CONFIG", ":4096:8"),)),
    SectionSpec("ep_gloo", 60, 20, "two processes on one GPU over gloo: ep = 2 vs ep = 1, "
                "combined vs plain, fp32 and bf16", env=(("CUBLAS_WORKSPACE_CONFIG", ":4096:8"),)),
    SectionSpec("pretrain", 90, 40, "world size 1 on NCCL, bf16, 20 iterations; exit, save and "
                "resume bitwise; tokens/s", env=(("CUBLAS_WORKSPACE_CONFIG", ":4096:8"),)),
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
