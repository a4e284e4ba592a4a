"""The GPU check runs: timeouts stop whole process groups, the modelled links change no bits,
the node timeline of a combined step, and the whole dry run through the set-up script from a
Python that has torch but not megapipe."""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from gpu_sections.fused_ops import OPERATORS  # noqa: E402
from gpu_sections.link_model import make_link  # noqa: E402
from gpu_sections.moe_bench import PairBench, Shape, Variant, build_layers  # noqa: E402
from gpu_sections.registry import SECTIONS  # noqa: E402
from gpu_sections.result import empty  # noqa: E402
from gpu_sections.runner import finish_result, run_child  # noqa: E402
from megapipe.moe.link import EmulatedLink  # noqa: E402
from megapipe.overlap import make_streams  # noqa: E402
from megapipe.overlap.sequential import record_forward, run_backward  # noqa: E402
from megapipe.precision.main_grad import accumulated_grad  # noqa: E402

CPU = torch.device("cpu")
TINY = Shape(hidden=16, heads=2, experts=4, top_k=2, ffn=8, tokens=16, batch=2)


def test_a_timed_out_child_is_stopped_with_everything_it_started(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    script = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "print('started', flush=True)\n"
        "time.sleep(60)\n"
    )
    log = tmp_path / "log"
    start = time.monotonic()
    code, timed_out = run_child(
        [sys.executable, "-c", script], dict(os.environ), tmp_path, log, 3.0
    )
    assert timed_out and time.monotonic() - start < 20
    assert "started" in log.read_text()
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # reaped by init shortly after its parent died
        if not Path(f"/proc/{grandchild}").exists() or "Z" in _state(grandchild):
            break
        time.sleep(0.1)
    assert not Path(f"/proc/{grandchild}").exists() or "Z" in _state(grandchild)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0]
    except OSError:
        return "Z"


def test_a_timeout_or_a_crash_becomes_the_sections_error():
    data = empty("overlap")
    data["figures"]["speedup"] = {"value": 1.5}
    timed_out = finish_result(data, None, True, 61.0, 60.0)
    assert "timed out after 60 s" in timed_out["error"] and timed_out["figures"]  # partial kept
    crashed = finish_result(empty("gemm"), -9, False, 5.0, 60.0)
    assert "exited with code -9" in crashed["error"]
    assert finish_result(empty("env"), 0, False, 2.0, 60.0)["error"] is None


@dataclass(frozen=True)
class _CountingLink(EmulatedLink):
    """A link that only counts the bytes of the exchanges it is asked to stretch."""

    exchanges: list = field(default_factory=list)

    def wait_rest(self, num_bytes, started, device=None):
        self.exchanges.append(num_bytes)
        return 0.0


def _pair_grads(bench, plans, tape):
    """Forward of microbatch 1 and backward of microbatch 0 on the tape; (output, gradients)."""
    (out,) = record_forward(plans, (bench.x_fwd,))[0]
    input_grads = run_backward(tape, (bench.grad,))
    grads = [accumulated_grad(p).clone() for layer in bench.layers for p in layer.parameters()]
    for layer in bench.layers:
        for p in layer.parameters():
            p.main_grad.zero_()
    return [out] + list(input_grads) + grads


def test_the_modelled_link_runs_in_forward_and_backward_and_changes_no_bits():
    layers = build_layers(TINY, 2, CPU, torch.bfloat16)
    with make_streams(CPU) as streams:
        bench = PairBench(layers, TINY, streams, CPU, torch.bfloat16)
        plain = _pair_grads(bench, *bench.prepare(on_streams=False))
        link = _CountingLink(bandwidth_bytes_per_s=1e9)
        bench.set_link(link)
        linked = _pair_grads(bench, *bench.prepare(on_streams=False))
        rows_bytes = TINY.payload_bytes(torch.bfloat16)
        # two tapes' forwards (dispatch, combine per layer) and one backward (the reverse)
        assert link.exchanges == [rows_bytes] * (3 * 2 * len(layers))
        assert all(torch.equal(a, b) for a, b in zip(plain, linked))
        link.exchanges.clear()
        bench.prepare(Variant(waves=2))  # the plans in waves reach the link too, per wave
        assert sum(link.exchanges) == 2 * len(layers) * rows_bytes and len(link.exchanges) == 8


def test_the_node_timeline_of_a_combined_step_on_cpu():
    layers = build_layers(TINY, 1, CPU, torch.bfloat16)
    with make_streams(CPU) as streams:
        bench = PairBench(layers, TINY, streams, CPU, torch.bfloat16)
        bench.set_link(make_link("sleep", 5.0, CPU, TINY.payload_bytes(torch.bfloat16)))
        run = bench.traced(combined=True)
    labels = {s.label for s in run.spans}
    assert {"F1.0.layer0.attention", "F1.0.layer0.dispatch", "B0.0.layer0.combine",
            "B0.0.layer0.attention"} <= labels
    assert all(s.end >= s.start >= 0 for s in run.spans)
    comm = [s for s in run.spans if s.kind == "comm"]
    assert len(comm) == 4 and min(s.duration for s in comm) >= 4.0  # the link slept 5 ms each
    assert run.comm_ms == pytest.approx(sum(s.duration for s in comm))
    assert 0.0 <= run.exposed <= 1.0
    # on CPU the step returns once both streams are done: its host time covers every node
    assert run.host_ms >= max(s.end for s in run.spans)


def test_the_copy_link_copies_and_changes_no_bits_under_the_triton_interpreter():
    pytest.importorskip("triton")
    code = (
        "import torch\n"
        "from gpu_sections.link_model import CopyLink, copy_words\n"
        "src = torch.arange(3000, dtype=torch.float32).reshape(100, 30)\n"
        "assert torch.equal(copy_words(src, sms=3, repeats=2), src.reshape(-1))\n"
        "link = CopyLink(bandwidth_bytes_per_s=1e9, sms=3, repeats=1)\n"
        "x = torch.randn(10, 8, requires_grad=True)\n"
        "y = link.delay(x)\n"
        "y.backward(torch.ones_like(y))\n"
        "assert torch.equal(y, x) and torch.equal(x.grad, torch.ones_like(x))\n"
        "print('copied')\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO / "benchmarks"))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "copied" in done.stdout, done.stdout + done.stderr


# The dry run's sections in two halves run side by side (two cores; most sections use one):
# each half is a whole check of its own, and together they are every section.
_HALVES = (("env", "executor", "graphs", "kernels", "gemm", "megatron", "replay"),
           ("bitwise", "syncs", "tests", "pretrain", "streams", "overlap", "ep_gloo"))


@pytest.fixture(scope="module")
def torch_only_python(tmp_path_factory):
    """A Python that has torch (and this venv's other packages) but not megapipe, as a lent
    machine's: a venv of the base interpreter whose one ``.pth`` adds this venv's
    site-packages folders as plain paths (their own ``.pth`` files, megapipe's editable
    install among them, are not run)."""
    import site
    import venv

    folder = tmp_path_factory.mktemp("torch_only")
    venv.create(folder, with_pip=False, symlinks=True)
    python = folder / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; "
                              "print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "torch_only.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    probe = subprocess.run([str(python), "-c", "import torch\ntry:\n import megapipe\n"
                            "except ModuleNotFoundError:\n print('torch only')"],
                           cwd="/", env=_without_pythonpath(), capture_output=True, text=True)
    assert probe.stdout.strip() == "torch only", probe.stdout + probe.stderr
    return python


def _without_pythonpath() -> dict:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


# The default suite's dry run: the sections that come first by value (the executor's step, the
# fused kernels, the bitwise evidence); the others run in the heavy sweep.
_FIRST = ("executor", "kernels", "bitwise")


def test_the_dry_run_from_a_python_with_torch_only_runs_the_first_sections(tmp_path,
                                                                        torch_only_python):
    """``PYTHON=<torch only> bash scripts/gpu_check.sh OUT --dry-run --sections ...``: the
    set-up a lent machine gets, then the three sections the check is for."""
    sections, passed = _dry_run(tmp_path, torch_only_python, (_FIRST,))
    assert passed == len(_FIRST)
    _check_first_sections({s["name"]: s for s in sections})


@pytest.mark.heavy
def test_the_dry_run_from_a_python_with_torch_only_runs_every_section(tmp_path,
                                                                      torch_only_python):
    """The same, every section, in two halves side by side: no section fails, the GPU parts
    are reported as skipped with the reason, and each section says what it would be allowed
    on the device."""
    assert sorted(sum(_HALVES, ())) == sorted(s.name for s in SECTIONS)
    sections, passed = _dry_run(tmp_path, torch_only_python, _HALVES)
    assert passed >= 10
    by_name = {s["name"]: s for s in sections}
    _check_first_sections(by_name)
    for name in ("syncs", "streams", "overlap", "kernels"):
        assert any("dry run" in part["reason"] or "CUDA" in part["reason"]
                   for part in by_name[name]["skipped_parts"]), (name, by_name[name])
    files = sorted(p.name for out in tmp_path.glob("out*") for p in out.iterdir())
    assert files == sorted(["gpu_check.json", "gpu_check.log", "gpu_check.md", "setup.log"] * 2
                           + ["streams_trace.json.gz"])


def _dry_run(tmp_path, python, groups) -> tuple[list[dict], int]:
    """Each group of sections as one dry-run check of its own, side by side: the sections'
    reports in order and how many passed, after checking each check's set-up and report."""
    outs = [tmp_path / f"out{i}" for i in range(len(groups))]
    env = dict(_without_pythonpath(), PYTHON=str(python), OMP_NUM_THREADS="1", BUDGET="500")
    running = [subprocess.Popen(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), str(out), "--dry-run", "--sections",
         ",".join(half)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=tmp_path, env=env) for out, half in zip(outs, groups)]
    sections, passed = [], 0
    for process, out, half in zip(running, outs, groups):
        stdout, stderr = process.communicate(timeout=560)
        log = (out / "gpu_check.log").read_text() if (out / "gpu_check.log").exists() else ""
        assert process.returncode == 0, stdout + stderr + log[-3000:]
        setup = (out / "setup.log").read_text()
        assert f"megapipe from the checkout: PYTHONPATH={REPO}" in setup, setup
        assert f"running with {python}" in setup, setup
        data = json.loads((out / "gpu_check.json").read_text())
        assert [s["name"] for s in data["sections"]] == [s.name for s in SECTIONS
                                                        if s.name in half]
        assert data["failed"] == 0, data["summary"]
        last = stdout.strip().splitlines()[-1]
        assert last == data["summary"]
        markdown = (out / "gpu_check.md").read_text()
        assert markdown.strip().splitlines()[-1] == last and "## On the device" in markdown
        sections += data["sections"]
        passed += data["passed"]
    assert all(s["on_device"] for s in sections)
    assert all(c["ok"] for s in sections for c in s["checks"])
    return sections, passed


def _check_first_sections(by_name: dict) -> None:
    """What the executor, kernels and bitwise sections report in a dry run."""
    assert by_name["executor"]["on_device"] == "110 s (its cap)"
    kernels_skipped = [p["part"] for p in by_name["kernels"]["skipped_parts"]]
    assert kernels_skipped == [f"{op}: GPU ms, share of HBM bandwidth, host us per launch"
                               for op in OPERATORS]
    bitwise, executor = by_name["bitwise"], by_name["executor"]
    # without CUDA the runs with graphs are left out (they would run eager), and one shape is timed
    assert not any("CUDA graphs" in c["name"] for c in bitwise["checks"])
    assert len(bitwise["checks"]) == 4  # the control, combined, deferred wgrad, slow comm
    assert "CUDA graphs need CUDA: the runs with graphs are left out here" in bitwise["notes"]
    assert {t["title"]: [tuple(r[:2]) for r in t["rows"]] for t in executor["tables"]} == {
        "1f1b step, hidden 32, bf16": [("no link", "off"), ("sleep link, comm ~ experts", "off")]}


def test_a_check_killed_mid_section_leaves_the_finished_sections_and_the_running_ones_figures(
        tmp_path):
    """A kill of the whole check (the device machine's time limit) at any moment: the reports
    in the output folder hold every finished section, and the running one's figures so far are
    beside them in gpu_check.current.json."""
    out = tmp_path / "out"
    process = subprocess.Popen(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(out),
         "--sections", "env,tests", "--budget", "200"],
        cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    current = out / "gpu_check.current.json"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            if current.exists() and json.loads(current.read_text() or "{}").get("name") == "tests":
                break
            time.sleep(0.05)
        assert process.poll() is None, "the check ended before it could be killed mid-section"
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    report = json.loads((out / "gpu_check.json").read_text())
    assert [s["name"] for s in report["sections"]] == ["env"]
    assert report["sections"][0]["figures"]["copy_gbs"]["value"] > 0
    assert "## env: passed" in (out / "gpu_check.md").read_text()
    running = json.loads(current.read_text())
    assert running["name"] == "tests" and running["error"] is None
