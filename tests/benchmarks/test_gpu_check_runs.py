"""The GPU check runs: timeouts stop whole process groups, the modelled link changes no bits,
the node timeline of a combined step, the whole dry run, and the offline set-up script."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from gpu_sections.gpu_timing import EventTrace, TimedStreams  # noqa: E402
from gpu_sections.link_model import LinkModel, with_link  # noqa: E402
from gpu_sections.registry import SECTIONS  # noqa: E402
from gpu_sections.result import empty  # noqa: E402
from gpu_sections.runner import finish_result, run_child  # noqa: E402

from megapipe.overlap import Node, NodeKind, combined_step, make_streams  # noqa: E402
from megapipe.overlap.tape import record_forward, run_backward  # noqa: E402


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
    code, timed_out = run_child([sys.executable, "-c", script], dict(os.environ), tmp_path, log, 3.0)
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


class _CountingLink:
    """Stands in for a LinkModel: counts the payloads it would spend time on."""

    def __init__(self):
        self.shapes = []

    def spend(self, payload):
        self.shapes.append(tuple(payload.shape))


def _toy_plan():
    weight = torch.nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))

    def mix(state, tensors):
        return (torch.tanh(tensors[-1] @ weight),)

    def move(state, tensors):
        return (tensors[-1] * 1.0,)

    kinds = [("attention", NodeKind.COMPUTE, mix), ("dispatch", NodeKind.COMM, move),
             ("experts", NodeKind.COMPUTE, mix), ("combine", NodeKind.COMM, move)]
    return [Node(n, k, f) for n, k, f in kinds], weight


def test_the_modelled_link_runs_in_forward_and_backward_and_changes_no_bits():
    plan, weight = _toy_plan()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    link = _CountingLink()
    (plain,), tape = record_forward([plan], (x,))
    (grad_x_plain,) = run_backward(tape, (torch.ones(4, 8),))
    grad_plain, weight.grad = weight.grad, None
    (linked,), tape = record_forward([with_link(plan, link)], (x,))
    assert link.shapes == [(4, 8), (4, 8)]  # dispatch and combine, forward
    (grad_x_linked,) = run_backward(tape, (torch.ones(4, 8),))
    assert len(link.shapes) == 4  # and their reverse exchanges in backward
    assert torch.equal(plain, linked) and torch.equal(grad_plain, weight.grad)
    assert torch.equal(grad_x_plain, grad_x_linked)
    with pytest.raises(ValueError, match="link kind"):
        LinkModel("carrier-pigeon", 1.0)


def test_event_trace_gives_the_node_timeline_of_a_combined_step_on_cpu():
    plan, _ = _toy_plan()
    device = torch.device("cpu")
    x = torch.randn(4, 8, requires_grad=True)
    with make_streams(device) as streams:
        timed = TimedStreams.of(streams)
        _, tape, _ = combined_step([with_link(plan, LinkModel("sleep", 5.0))], (x,), None, None, timed)
        trace = EventTrace(device)
        combined_step([plan], (x,), tape, (torch.ones(4, 8),), timed, trace=trace,
                      fwd_microbatch=1, bwd_microbatch=0)
    spans = trace.gpu_spans()
    labels = {s.label for s in spans}
    assert {"F1.0.attention", "F1.0.dispatch", "B0.0.combine", "B0.0.attention"} <= labels
    assert all(s.end >= s.start >= 0 for s in spans)
    comm = [s for s in spans if s.label.startswith("B") and s.kind == "comm"]
    assert comm and min(s.duration for s in comm) >= 4.0  # the backward link slept 5 ms each
    assert len(timed.waits) == 2  # the two combined steps' final waits


def test_the_copy_link_kernel_copies_its_payload_under_the_triton_interpreter():
    pytest.importorskip("triton")
    code = (
        "import torch\n"
        "from gpu_sections.link_model import link_copy\n"
        "src = torch.arange(3000, dtype=torch.float32).reshape(100, 30)\n"
        "out = link_copy(src, sms=3, repeats=2)\n"
        "assert torch.equal(out, src.reshape(-1)), out\n"
        "print('copied')\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO / "benchmarks"))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "copied" in done.stdout, done.stdout + done.stderr


def test_the_dry_run_runs_every_section_and_reports_the_gpu_parts_as_skipped(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(out),
         "--budget", "500"],
        capture_output=True, text=True, timeout=560, cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    log = (out / "gpu_check.log").read_text() if (out / "gpu_check.log").exists() else ""
    assert done.returncode == 0, done.stdout + done.stderr + log[-3000:]
    data = json.loads((out / "gpu_check.json").read_text())
    sections = data["sections"]
    assert [s["name"] for s in sections] == [s.name for s in SECTIONS]
    assert data["failed"] == 0 and data["passed"] >= 8, data["summary"]
    skipped_parts = {s["name"]: s["skipped_parts"] for s in sections}
    for name in ("syncs", "streams", "overlap", "kernels"):
        assert any("dry run" in part["reason"] or "CUDA" in part["reason"]
                   for part in skipped_parts[name]), (name, skipped_parts[name])
    assert all(c["ok"] for s in sections for c in s["checks"])
    last = done.stdout.strip().splitlines()[-1]
    assert last == data["summary"]
    assert (out / "gpu_check.md").read_text().strip().splitlines()[-1] == last
    files = sorted(p.name for p in out.iterdir())
    assert files == ["gpu_check.json", "gpu_check.log", "gpu_check.md", "streams_trace.json.gz"]


@pytest.mark.parametrize("mode", ["links", "venv"])
def test_the_set_up_makes_megapipe_importable_offline(tmp_path, mode):
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_SETUP=mode,
               GPU_CHECK_VENV=str(tmp_path / "venv"), PIP_NO_INDEX="1")
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(tmp_path / "out"),
                           "--setup-only"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    python, pythonpath = lines["python"], lines.get("PYTHONPATH", "")
    if mode == "venv":
        assert python == str(tmp_path / "venv" / "bin" / "python")
    else:
        assert python == sys.executable and pythonpath
    check = subprocess.run(
        [python, "-c", "import os, megapipe.kernels as k; print(os.path.realpath(k.__file__))"],
        cwd="/", env=dict(os.environ, PYTHONPATH=pythonpath), capture_output=True, text=True,
        timeout=120)
    assert check.stdout.strip() == str(REPO / "kernels" / "__init__.py"), check.stderr
