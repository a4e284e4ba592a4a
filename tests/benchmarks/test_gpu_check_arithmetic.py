"""The GPU check's arithmetic, on CPU: node traces to timelines, exposed time and ceilings, the
budget, the sync-site parser, the profiler-trace reader, pytest's summary, the reports."""

import gzip
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from gpu_sections import fused_ops, report, timeline, trace_analysis  # noqa: E402
from gpu_sections.budget import Budget, allowance, device_plan  # noqa: E402
from gpu_sections.fused_ops import OPERATORS, Case, cases  # noqa: E402
from gpu_sections.gpu_timing import node_spans  # noqa: E402
from gpu_sections.registry import CHECK_S, GUARANTEED, SECTIONS, SETUP_S  # noqa: E402
from gpu_sections.result import FAILED, PASSED, SKIPPED, SectionResult, clean, status_of  # noqa: E402
from gpu_sections.sec_pretrain import tokens_per_second  # noqa: E402
from gpu_sections.sec_tests import PYTEST_OPTIONS, parse_outcomes, skip_reason, tally  # noqa: E402
from gpu_sections.sync_sites import SYNC_MESSAGE, SyncLog, capture_syncs, site_of  # noqa: E402
from gpu_sections.timeline import Span  # noqa: E402
from megapipe.overlap.node_trace import NodeTrace  # noqa: E402


# ---- timelines ------------------------------------------------------------------------------
def _combined_pair():
    """Four slots of 10 ms: comm beside compute, except 4 ms of the last comm node."""
    return [
        Span("compute", 0, 10, "F attention"), Span("comm", 0, 10, "B combine"),
        Span("compute", 10, 20, "B experts"), Span("comm", 10, 20, "F dispatch"),
        Span("compute", 20, 30, "F experts"), Span("comm", 20, 30, "B dispatch"),
        Span("compute", 30, 36, "B attention"), Span("comm", 30, 40, "F combine"),
    ]


def _trace_of(spans, offset_ms=5.0):
    """A NodeTrace holding ``spans`` (labels "F node"), recorded on a clock that reads their
    times shifted by ``offset_ms``, in seconds as the host clock gives them."""
    times = iter([(t + offset_ms) / 1e3 for s in spans for t in (s.start, s.end)])
    trace = NodeTrace(clock=lambda: next(times))
    for s in spans:
        direction, node = s.label.split(" ")
        with trace.span(1, 0, node, direction, s.kind, s.kind):
            pass
    return trace


def test_a_node_trace_becomes_spans_in_ms_from_its_first_node():
    trace = _trace_of(_combined_pair())
    spans = node_spans(trace)
    assert [(s.kind, s.label, s.stream) for s in spans][:2] == [
        ("compute", "F1.0.attention", "compute"), ("comm", "B1.0.combine", "comm")]
    expected = [(s.start, s.end) for s in _combined_pair()]
    assert [(s.start, s.end) for s in spans] == [pytest.approx(e) for e in expected]
    assert node_spans(NodeTrace()) == []


def test_exposed_comm_is_the_comm_time_no_compute_covers():
    spans = _combined_pair()
    assert timeline.busy_ms(spans, "comm") == 40
    assert timeline.concurrent_ms(spans) == 36
    # the exposed share the GPU check reports is megapipe's own, from the same trace
    assert _trace_of(spans).exposed_comm_fraction() == pytest.approx(0.1)


def test_overlapping_spans_of_one_kind_count_once():
    spans = [
        Span("compute", 0, 10),
        Span("compute", 5, 15),
        Span("comm", 8, 20),
        Span("comm", 9, 12),
    ]
    assert timeline.busy_ms(spans, "compute") == 15
    assert timeline.busy_ms(spans, "comm") == 12
    assert timeline.concurrent_ms(spans) == 7  # 8..15


def test_idle_share_counts_time_with_no_span_of_either_kind():
    spans = [Span("compute", 0, 4), Span("comm", 2, 6), Span("compute", 8, 10)]
    assert timeline.idle_share(spans) == pytest.approx(0.2)  # 6..8 of 0..10
    assert timeline.idle_share(spans, 0, 20) == pytest.approx(0.6)
    assert timeline.idle_share([]) == 0.0


def test_ceiling_is_sequential_time_over_the_busier_stream():
    trace = _trace_of(_combined_pair())
    compute, comm = trace.total("compute") * 1e3, trace.total("comm") * 1e3
    assert (compute, comm) == (pytest.approx(36), pytest.approx(40))
    assert timeline.ceiling(76, compute, comm) == pytest.approx(1.9)
    with pytest.raises(ValueError, match="busy time"):
        timeline.ceiling(10, 0, 0)


def test_intersection_of_unsorted_interval_lists():
    assert timeline.intersection_length([(5, 9), (0, 2)], [(1, 6), (8, 20)]) == 1 + 1 + 1
    assert timeline.union([(3, 4), (0, 1), (1, 2), (5, 5)]) == [(0, 2), (3, 4)]


# ---- budget ---------------------------------------------------------------------------------
def test_a_section_gets_its_cap_or_what_is_left():
    assert allowance(left=500, cap=60, minimum=20).seconds == 60
    assert allowance(left=45, cap=60, minimum=20).seconds == 45


def test_a_section_is_skipped_when_less_than_its_minimum_is_left():
    got = allowance(left=12, cap=150, minimum=30)
    assert got.seconds is None
    assert "12 s left" in got.reason and "at least 30 s" in got.reason


def test_budget_counts_down_on_its_clock():
    now = [100.0]
    budget = Budget(300, clock=lambda: now[0])
    assert budget.for_section(60, 20).seconds == 60
    now[0] += 250  # 50 s left
    assert budget.for_section(200, 30).seconds == 50
    now[0] += 45
    assert budget.for_section(60, 20).seconds is None
    with pytest.raises(ValueError, match="budget"):
        Budget(0)
    with pytest.raises(ValueError, match="cap"):
        allowance(100, cap=10, minimum=20)


def test_the_sections_that_matter_most_always_get_their_caps_in_the_default_check():
    """Their caps and the set-up's fit the six-minute check, they come first, and the plan of a
    check where every section uses its whole allowance gives each of them its cap."""
    specs = {s.name: s for s in SECTIONS}
    assert [s.name for s in SECTIONS[:len(GUARANTEED)]] == list(GUARANTEED)
    assert SETUP_S + sum(specs[n].cap_s for n in GUARANTEED) <= CHECK_S == 420
    plan = device_plan([s.cap_s for s in SECTIONS], [s.min_s for s in SECTIONS],
                       CHECK_S - SETUP_S)
    assert plan[:len(GUARANTEED)] == [specs[n].cap_s for n in GUARANTEED]
    assert SECTIONS[-1].name == "replay" and not SECTIONS[-1].needs_cuda  # CPU-only: last
    assert device_plan([60, 60, 60], [20, 20, 20], 100) == [60, 40, None]


# ---- sync sites -----------------------------------------------------------------------------
def test_site_is_the_innermost_frame_inside_the_project(tmp_path):
    repo = str(tmp_path)
    frames = [(f"{repo}/benchmarks/x.py", 3), (f"{repo}/megapipe/moe/dispatcher.py", 40),
              (f"{repo}/megapipe/overlap/combined.py", 7), ("/usr/lib/torch/functional.py", 99)]
    assert site_of(frames, ("megapipe", "kernels"), repo) == "megapipe/overlap/combined.py:7"
    assert site_of(frames[:1], ("megapipe",), repo) == "benchmarks/x.py:3"
    assert site_of([("/elsewhere/y.py", 5)], ("megapipe",), repo) == "/elsewhere/y.py:5"
    assert site_of([], ("megapipe",), repo) == "<unknown>"


def test_sync_log_counts_sites_most_frequent_first(tmp_path):
    log = SyncLog(("megapipe",), str(tmp_path))
    for line in (5, 9, 9, 5, 9):
        log.add([(str(tmp_path / "megapipe" / "a.py"), line)])
    assert log.total == 5
    assert log.table() == [["megapipe/a.py:9", 3], ["megapipe/a.py:5", 2]]


def test_capture_syncs_names_the_project_line_that_led_to_the_warning(tmp_path):
    source = tmp_path / "megapipe" / "fake_dispatch.py"
    source.parent.mkdir()
    source.write_text(
        "import warnings\n"
        "def read_counts():\n"
        f"    warnings.warn({SYNC_MESSAGE!r})\n"
        "def other():\n"
        "    warnings.warn('something else')\n"
    )
    namespace = {}
    exec(compile(source.read_text(), str(source), "exec"), namespace)
    with capture_syncs(("megapipe",), str(tmp_path)) as log:
        namespace["read_counts"]()
        namespace["read_counts"]()
        with warnings.catch_warnings(record=True) as others:
            warnings.simplefilter("always")
            namespace["other"]()
    assert log.table() == [["megapipe/fake_dispatch.py:3", 2]]
    assert [str(w.message) for w in others] == ["something else"]


# ---- profiler trace -------------------------------------------------------------------------
def _event(cat, name, ts, dur=None, **args):
    event = {"ph": "X", "cat": cat, "name": name, "ts": ts, "args": args}
    if dur is not None:
        event["dur"] = dur
    return event


def _trace_events():
    name = trace_analysis.annotation_name
    return [
        _event("user_annotation", name("F1.0.layer0.attention", "compute", "compute"), 0, 100),
        _event("user_annotation", name("F1.0.layer0.dispatch", "comm", "comm"), 100, 50),
        _event("user_annotation", "some other range", 10, 5),
        _event("cuda_runtime", "cudaLaunchKernel", 10, 2, correlation=1),
        _event("cuda_runtime", "cudaLaunchKernel", 120, 2, correlation=2),
        _event("cuda_driver", "cuLaunchKernel", 130, 2, correlation=3),
        _event("cuda_runtime", "cudaLaunchKernel", 300, 2, correlation=4),  # outside any node
        _event("kernel", "gemm", 200, 1000, stream=7, correlation=1),
        _event("kernel", "spin", 400, 2000, stream=13, correlation=2),
        _event("gpu_memcpy", "DtoH", 2400, 100, stream=13, correlation=3),
        _event("kernel", "loss", 2600, 50, stream=7, correlation=4),
    ]


def test_kernels_are_tied_to_the_node_around_their_launch():
    runs = trace_analysis.kernel_runs(_trace_events())
    nodes = {run.name: run.node.label if run.node else None for run in runs}
    assert nodes == {"gemm": "F1.0.layer0.attention", "spin": "F1.0.layer0.dispatch",
                     "DtoH": "F1.0.layer0.dispatch", "loss": None}
    roles = trace_analysis.stream_roles(runs)
    assert roles == {7: "compute", 13: "comm"}
    figures = trace_analysis.overlap_figures(runs, roles)
    assert figures["compute_kernels_ms"] == pytest.approx(1.05)  # 200..1200 and 2600..2650 us
    assert figures["comm_kernels_ms"] == pytest.approx(2.1)
    assert figures["concurrent_ms"] == pytest.approx(0.8)  # 400..1200 us
    assert trace_analysis.separate_streams(runs)[0]
    assert trace_analysis.node_streams(runs, roles) == [
        ["F attention", "compute", "compute", 1, 1.0], ["F dispatch", "comm", "comm", 2, 2.1]]


def test_nodes_sharing_a_stream_are_reported(tmp_path):
    events = _trace_events()
    events[8]["args"]["stream"] = 7  # the spin kernel on the compute stream
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    ok, detail = trace_analysis.separate_streams(
        trace_analysis.kernel_runs(trace_analysis.load_events(path))
    )
    assert not ok and "[7, 13]" in detail


# ---- pytest's summary, the pretrain log, the kernels' bytes ---------------------------------
PYTEST_OUTPUT = """\
...
=========================== short test summary info ============================
PASSED tests/gpu/test_kernels_gpu.py::test_triton_kernels_match_reference_on_cuda
FAILED tests/gpu/test_streams_gpu.py::test_x[moe-True] - AssertionError: cuda-streams
SKIPPED [2] tests/gpu/test_streams_gpu.py:64: needs CUDA
ERROR tests/gpu/test_other.py - ImportError
1 failed, 1 passed, 2 skipped, 1 error in 3.2s
"""


def test_pytest_summary_lines_are_counted():
    outcomes = parse_outcomes(PYTEST_OUTPUT)
    assert [o for o, _ in outcomes] == ["PASSED", "FAILED", "SKIPPED", "ERROR"]
    counts = tally(outcomes)
    assert (counts["PASSED"], counts["FAILED"], counts["SKIPPED"], counts["ERROR"]) == (1, 1, 2, 1)
    assert skip_reason(outcomes[2][1]) == "needs CUDA"


def test_tokens_per_second_comes_from_the_last_log_line_with_one():
    lines = [
        "iter 10/20 | loss 5.1 | 1,024 tok/s | step 1 s",
        "iter 20/20 | 32,768 tok/s |",
        "done",
    ]
    assert tokens_per_second(lines) == 32768.0
    assert tokens_per_second(["no rate"]) is None


def test_a_kernel_moves_every_tensor_it_reads_and_writes_once():
    # 4 tokens of 16 bf16 values (32 bytes each), 8 int64 indices, top-2: 8 rows out
    case = Case("permute", lambda: None, (torch.zeros(4, 16, dtype=torch.bfloat16),
                                          torch.zeros(8, dtype=torch.int64), 2))
    assert case.moved_bytes(torch.zeros(8, 16, dtype=torch.bfloat16)) == 4 * 32 + 8 * 8 + 8 * 32
    assert case.moved_bytes((torch.zeros(2), None)) == 4 * 32 + 8 * 8 + 2 * 4


def test_every_fused_operator_has_a_kernels_case():
    from megapipe import kernels

    defined = {v._schema.name for v in vars(kernels).values()
               if isinstance(v, torch._ops.OpOverload) and v._schema.name.startswith("megapipe::")}
    assert {f"megapipe::{name}" for name in OPERATORS} == defined
    made = cases(fused_ops.DRY, torch.device("cpu"))
    assert [c.operator for c in made] == list(OPERATORS)
    assert all(c.moved_bytes(c.call()) > 0 for c in made)


# ---- results and reports --------------------------------------------------------------------
def test_status_follows_errors_checks_and_skips(tmp_path):
    result = SectionResult("overlap", tmp_path / "overlap.json")
    result.figure("speedup", 1.23456789, "x", headline=True)
    result.skip("copy link", "needs CUDA")
    assert result.status == PASSED
    saved = json.loads((tmp_path / "overlap.json").read_text())
    assert saved["figures"]["speedup"]["value"] == 1.235 and saved["skipped_parts"]
    result.check("bitwise", False, "3 differ")
    assert result.status == FAILED
    assert status_of({"checks": [], "skipped_reason": "no pytest"}) == SKIPPED
    assert status_of({"checks": [], "error": "timed out", "skipped_reason": "x"}) == FAILED
    assert clean([float("nan"), (1, 2.0)]) == [None, [1, 2.0]]


def test_a_table_with_the_same_title_is_replaced(tmp_path):
    result = SectionResult("overlap", None)
    result.table("pairs", ["a"], [[1]])
    result.table("other", ["b"], [[2]])
    result.table("pairs", ["a"], [[1], [3]])
    assert [(t["title"], t["rows"]) for t in result.data["tables"]] == [
        ("other", [[2]]),
        ("pairs", [[1], [3]]),
    ]


def test_report_ends_with_the_summary_table_and_the_counts_line(tmp_path):
    passed = SectionResult("env", None)
    passed.figure("device", "H100", headline=True)
    passed.data["seconds"] = 3.0
    failed = SectionResult("executor", None)
    failed.check("bitwise", False)
    failed.data["seconds"] = 9.0
    skipped = SectionResult("tests", None)
    skipped.skip_section("pytest is not installed")
    skipped.data["seconds"] = 0.0
    results = [passed.data, failed.data, skipped.data]
    report.write(tmp_path, {"mode": "GPU"}, results)
    text = (tmp_path / "gpu_check.md").read_text()
    assert text.rstrip().splitlines()[-1] == "1 passed, 1 failed, 1 skipped"
    assert "| env | passed | 3 | device H100 |" in text
    assert "| executor | failed | 9 | check failed: bitwise |" in text
    assert "skipped: pytest is not installed" in text
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert (data["passed"], data["failed"], data["skipped"]) == (1, 1, 1)
    assert report.text_table(results).splitlines()[1].startswith("env")


def test_the_gpu_tests_run_where_pytest_xdist_is_missing():
    """The section's pytest ignores pyproject.toml's ``-n 2``: with xdist unloadable (as on a
    lent machine without it) it still collects tests/gpu; the suite's own options would not."""
    repo = Path(__file__).resolve().parents[2]

    def collect(options):
        return subprocess.run([sys.executable, "-m", "pytest", "tests/gpu", "--collect-only",
                               *options], cwd=repo, capture_output=True, text=True, timeout=120)

    done = collect(PYTEST_OPTIONS)
    assert done.returncode == 0 and "tests/gpu" in done.stdout, done.stdout + done.stderr
    refused = collect(("-p", "no:xdist"))  # pyproject's -n 2 with no xdist to take it
    assert refused.returncode != 0 and "-n" in refused.stderr, refused.stdout + refused.stderr
