"""--profile-trace: one trace of a real 2-rank run, its summary, and the bad values."""

import json
import re

import pytest

from megapipe.cli import main as cli_main
from megapipe.schedule import build_schedule
from megapipe.train.config.parse import ArgsError, parse_pretrain_args
from megapipe.train.loop import train
from megapipe.train.observe.profiling import torch_trace_path
from support.pretrain_flags import TINY

PP2 = TINY + ["--nproc", "2", "--expert-model-parallel-size", "1",
              "--virtual-pipeline-model-parallel-size", "1", "--eval-interval", "0",
              "--train-iters", "4", "--profile-step-start", "2", "--profile-step-end", "3"]


def _train(argv):
    return train(parse_pretrain_args(argv, env={}), write=lambda line: None)


@pytest.fixture(scope="module")
def traced(rank_pools, tmp_path_factory):
    """One pp 2 run tracing iterations 2-3, with the PyTorch profiler beside it."""
    path = str(tmp_path_factory.mktemp("trace") / "run.json")
    results = rank_pools(2).run(_train, PP2 + ["--profile-trace", path,
                                               "--use-pytorch-profiler"])
    with open(path) as f:
        return path, json.load(f), results


def _slices(document, **match):
    return [e for e in document["traceEvents"] if e["ph"] == "X"
            and all(e.get(k) == v for k, v in match.items())]


def _union(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _uncovered(start, end, cover):
    """Length of [start, end] outside the (merged) cover, by direct clipping."""
    inside = sum(max(0.0, min(end, b) - max(start, a)) for a, b in cover)
    return (end - start) - inside


def test_trace_has_both_ranks_streams_labels_exposed_marks_and_the_simulation(traced):
    path, document, results = traced
    assert any(line.startswith(f"wrote profile trace {path}") for line in results[0].lines)
    meta = document["otherData"]["megapipe"]
    assert meta["schedule"] == "1f1b" and meta["steps"] == [2, 3]
    schedule = build_schedule("1f1b", 2, 4, overlap=True)
    for rank in (0, 1):
        compute, comm = _slices(document, pid=rank, tid=0), _slices(document, pid=rank, tid=1)
        assert {e["args"]["step"] for e in compute + comm} == {2, 3}  # only N..M
        actions = [e for e in compute if e["cat"] == "action"]
        assert sorted(e["name"] for e in actions) == sorted(
            str(a) for a in schedule.actions[rank] for _ in (2, 3))
        nodes = [e for e in compute if e["cat"] == "compute"]
        assert nodes and comm and all(e["cat"] == "comm" for e in comm)
        for e in nodes + comm:  # labelled: microbatch, stage (this rank's), layer, node
            args = e["args"]
            assert args["stage"] == rank and args["microbatch"] in range(4)
            assert e["name"] == f"{args['direction']}{args['microbatch']} s{rank} {args['node']}"
        # each exposed mark lies inside one of the rank's all-to-alls and beside no compute
        cover = _union((e["ts"], e["ts"] + e["dur"]) for e in nodes)
        for mark in _slices(document, pid=rank, tid=2):
            assert mark["cat"] == "exposed"
            assert any(c["ts"] <= mark["ts"] + 1e-3 and mark["ts"] + mark["dur"]
                       <= c["ts"] + c["dur"] + 1e-3 for c in comm)
            assert _uncovered(mark["ts"], mark["ts"] + mark["dur"], cover) == pytest.approx(
                mark["dur"], abs=2e-3)
    assert any(e["cat"] == "wait" for e in _slices(document, pid=1))  # rank 1 waits for inputs
    simulated = {e["pid"] for e in _slices(document) if e["cat"].startswith("simulated")}
    assert simulated == {2, 3}
    assert {t["node"] for t in meta["node_times"]} >= {"attention", "dispatch", "experts"}


def test_pytorch_profiler_traces_carry_the_node_names(traced):
    path, _, _ = traced
    for rank in (0, 1):
        with open(torch_trace_path(path, rank)) as f:
            names = {e.get("name", "") for e in json.load(f)["traceEvents"]}
        # the compute thread's nodes and actions (on CPU the comm thread is not profiled)
        assert any(re.fullmatch(r"megapipe B\d\.\d\.layer\d\.experts", n) for n in names)
        assert f"megapipe {rank}F0" in names


def test_summary_prints_the_figures_of_the_file(traced, capsys):
    path, document, _ = traced
    assert cli_main(["trace", "summarize", path]) == 0
    out = capsys.readouterr().out
    steps = {}
    for e in _slices(document, cat="action"):
        lo, hi = steps.get(e["args"]["step"], (float("inf"), 0.0))
        steps[e["args"]["step"]] = (min(lo, e["ts"]), max(hi, e["ts"] + e["dur"]))
    measured = sum(hi - lo for lo, hi in steps.values()) / len(steps) / 1e3
    simulated = document["otherData"]["megapipe"]["simulated"]["makespan_ms"]
    assert (f"step time: measured {measured:.2f} ms (mean of 2), simulated {simulated:.2f} ms, "
            f"measured/simulated {measured / simulated:.2f}") in out
    for rank in (0, 1):
        exposed = total = 0.0
        for step in (2, 3):
            nodes = _slices(document, pid=rank, cat="compute")
            cover = _union((e["ts"], e["ts"] + e["dur"]) for e in nodes
                           if e["args"]["step"] == step)
            for c in _slices(document, pid=rank, cat="comm"):
                if c["args"]["step"] == step:
                    total += c["dur"]
                    exposed += _uncovered(c["ts"], c["ts"] + c["dur"], cover)
        line = re.search(rf"rank {rank} \(pp {rank}, dp 0\): exposed all-to-all ([\d.]+) ms of "
                         rf"([\d.]+) ms per step \(([\d.]+)%\)", out)
        assert line, out
        assert float(line.group(1)) == pytest.approx(exposed / 2e3, abs=0.011)
        assert float(line.group(2)) == pytest.approx(total / 2e3, abs=0.011)
        assert float(line.group(3)) == pytest.approx(100 * exposed / total, abs=0.11)
    bubbles = re.findall(r"  bubble ([\d.]+) ms \(iteration (\d), at \+[\d.]+ ms\): (.+)", out)
    assert len(bubbles) == 6 and float(bubbles[0][0]) >= float(bubbles[1][0])
    assert any("waits for 1RECV_F" in cause for _, _, cause in bubbles), out


@pytest.mark.parametrize("flags,message", [
    (["--profile-step-start", "3", "--profile-step-end", "2"],
     "--profile-step-start=3 is after --profile-step-end=2"),
    (["--profile-step-end", "9"], "--profile-step-end=9 is beyond --train-iters=4"),
    (["--profile-step-start", "0"], "--profile-step-start=0 must be >= 1"),
])
def test_bad_profile_steps_are_one_line(flags, message, tmp_path):
    argv = TINY + ["--train-iters", "4", "--profile-trace", str(tmp_path / "t.json")] + flags
    with pytest.raises(ArgsError) as err:
        parse_pretrain_args(argv, env={})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_unwritable_trace_path_and_lone_pytorch_profiler_are_one_line(tmp_path):
    with pytest.raises(ArgsError, match=r"--profile-trace .*/nowhere/t.json: folder .* does not"):
        parse_pretrain_args(TINY + ["--profile-trace", str(tmp_path / "nowhere" / "t.json")],
                            env={})
    with pytest.raises(ArgsError, match="--profile-trace .* is a directory"):
        parse_pretrain_args(TINY + ["--profile-trace", str(tmp_path)], env={})
    with pytest.raises(ArgsError, match="--use-pytorch-profiler needs --profile-trace FILE"):
        parse_pretrain_args(TINY + ["--use-pytorch-profiler"], env={})


def test_summarize_refuses_a_file_that_is_no_profile_trace(tmp_path, capsys):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"traceEvents": []}))
    assert cli_main(["trace", "summarize", str(other)]) == 2
    assert "is not a megapipe profile trace" in capsys.readouterr().err
