"""Every figure that matters from one GPU, in one command (``scripts/gpu_check.sh`` runs it).

Sections, ordered by value, each in its own process with its own timeout within ``--budget``
(the modules are in ``benchmarks/gpu_sections/``, one per section; ``registry.py`` lists them
with their caps; ``budget.py`` says how the budget is shared):

    env       device, clocks, memory, versions; copy bandwidth, bf16 GEMM TFLOP/s
    executor  pp = 1, 1f1b, 8 microbatches, stages built on the device: step times at hidden
              1024 and 4096, link off/on, CUDA graphs off/on: combined / plain, host issue
              time vs kernel time, exposed all-to-all, GPU idle share
    graphs    the executor's step on a rank-capacity model, hidden 1024 and 4096: MoE layers
              graphed whole vs partial graphs vs eager, combined vs plain
    kernels   every fused operator: GPU ms, share of HBM bandwidth, host us per launch
    bitwise   the executor's runs bit for bit, with a plain-vs-plain control: combined,
              deferred wgrad, slow comm stream (race detector), CUDA graphs on
    syncs     host reads of one combined step by node (only the documented one), no
              synchronizing CUDA call, the host's wait in the documented read
    tests     pytest tests/gpu -rA
    pretrain  world size 1 on NCCL, --deterministic-mode, 20 iterations: exit, save and resume
              bitwise (with a control), tokens/s
    (the sections above always get their caps in the default 420 s; the ones below run in
    what they leave)
    streams   profiler trace of one combined step: streams per node, concurrent kernel ms
    overlap   ep = 1 MoE layer pair and step, sequential vs combined (also deferred wgrad and
              all-to-alls in waves), modelled all-to-all, node timeline of the headline pair
    gemm      experts' GEMMs: per-expert loop vs grouped_mm (megapipe's grouped_gemm)
    ep_gloo   two processes on one GPU over gloo: ep = 2 vs ep = 1, combined vs plain
    megatron  Megatron-Core's GPT (when a megatron-core wheel was carried): megapipe's combined
              step vs Megatron's combined_1f1b, bitwise
    replay    the DeepSeek-V3 replay on the machine's cores (CPU only)

Everything that trains or times runs in bf16 with fp32 main gradients (``--bf16``).

``--dry-run`` runs every section on the CPU with tiny sizes (the GPU hidden), reporting the
GPU-only parts as skipped with the reason and stating what each section would be allowed on
the device with the same budget; the test suite runs it.

Writes at most four files into ``--out``: ``gpu_check.json`` (everything), ``gpu_check.md`` (the
readable report), ``gpu_check.log`` (every section's output) and ``streams_trace.json.gz`` (the
profiler trace of one combined step); ``scripts/gpu_check.sh`` adds ``setup.log``. Both reports
are rewritten after each section, and the running section writes its figures as they come to
``gpu_check.current.json`` there (folded into the reports when it ends), so a run killed at any
moment keeps what it measured. Prints a table at
the end; the last line is ``N passed, N failed, N skipped``; exit code 1 when a section failed.

    python benchmarks/gpu_check.py --out DIR [--budget 420] [--dry-run] [--sections a,b]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_sections import report  # noqa: E402
from gpu_sections.budget import Budget  # noqa: E402
from gpu_sections.registry import CHECK_S, SECTIONS, select  # noqa: E402
from gpu_sections.result import FAILED  # noqa: E402
from gpu_sections.runner import RunSettings, run_all  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for the reports (created)")
    parser.add_argument("--budget", type=float, default=float(CHECK_S),
                        help=f"seconds for all sections together (default {CHECK_S}; "
                        "scripts/gpu_check.sh passes what its set-up left of its BUDGET)")
    parser.add_argument("--dry-run", action="store_true",
                        help="every section on the CPU with tiny sizes")
    parser.add_argument("--sections", default=None,
                        help="comma list of sections to run (default: all, in priority order); "
                        "with --budget, a rerun of a subset in the time left")
    parser.add_argument("--keep-scratch", action="store_true",
                        help="keep the scratch folder (per-section JSON, checkpoints)")
    parser.add_argument("--list", action="store_true", help="list the sections and exit")
    args = parser.parse_args(argv)
    if not args.list and not args.out:
        parser.error("--out DIR is required")
    if not args.budget > 0:
        parser.error(f"--budget={args.budget} must be > 0 seconds")
    try:
        args.specs = select(args.sections)
    except ValueError as err:
        parser.error(str(err))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.list:
        for spec in SECTIONS:
            print(f"{spec.name:<9} cap {spec.cap_s:>4.0f} s, min {spec.min_s:>3.0f} s  {spec.what}")
        return 0
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.log").write_text("")
    scratch = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "mode": "dry run (CPU, tiny sizes)" if args.dry_run else "GPU",
        "host": f"{platform.node()}, {platform.machine()}, Python {platform.python_version()}",
        "command": "python benchmarks/gpu_check.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "budget": f"{args.budget:.0f} s",
    }
    settings = RunSettings(out=out, scratch=scratch, dry_run=args.dry_run, repo=REPO)

    def publish(done: list[dict]) -> None:
        meta.update(report.device_facts(done))
        report.write(out, meta, done)

    try:
        results = run_all(args.specs, settings, Budget(args.budget), publish)
    finally:
        if not args.keep_scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    for name, allowed in report.device_rows(results):
        print(f"[gpu_check] on the device, {name}: {allowed}")
    print(report.text_table(results))
    print(f"reports: {out / 'gpu_check.md'}, {out / 'gpu_check.json'}")
    print(report.summary_line(results))
    return 1 if report.counts(results)[FAILED] else 0


if __name__ == "__main__":
    sys.exit(main())
