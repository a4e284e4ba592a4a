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
    SectionSpec("env", 60, 20, "device, clocks, memory, versions; copy bandwidth and bf16 GEMM "
                "TFLOP/s (the ceilings the other sections compare with)", needs_cuda=False),
    SectionSpec("tests", 150, 30, "pytest tests/gpu -rA", needs_cuda=False),
    SectionSpec("syncs", 60, 20, "every host sync during one combined step, as file:line"),
    SectionSpec("streams", 75, 25, "profiler trace of one combined step: the stream of each "
                "node's kernels, milliseconds of compute and comm kernels at once"),
    SectionSpec("overlap", 210, 60, "ep = 1 MoE layer pair and step, sequential vs combined, "
                "all-to-all modelled on the comm stream"),
    SectionSpec("gemm", 45, 15, "per-expert loop vs grouped GEMM: TFLOP/s, host us per call"),
    SectionSpec("kernels", 60, 20, "Triton permute/unpermute forward and backward: GB/s vs torch "
                "and vs the copy bandwidth; compile times",
                env=(("TRITON_CACHE_DIR", "{scratch}/triton-cache-kernels"),)),
    SectionSpec("executor", 75, 25, "pp = 1, 1f1b, 8 microbatches: plain vs combined bitwise, "
                "step times, GPU idle share",
                env=(("CUBLAS_WORKSPACE_CONFIG", ":4096:8"),)),
    SectionSpec("ep_gloo", 75, 25, "two processes on one GPU over gloo: ep = 2 vs ep = 1, "
                "combined vs plain", env=(("CUBLAS_WORKSPACE_CONFIG", ":4096:8"),)),
    SectionSpec("pretrain", 120, 40, "world size 1 on NCCL, 20 iterations, save and resume "
                "bitwise, tokens/s", env=(("CUBLAS_WORKSPACE_CONFIG", ":4096:8"),)),
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
