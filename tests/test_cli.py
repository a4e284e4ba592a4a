"""The ``megapipe`` command: grid and metrics printed, files written, one-line errors."""

import dataclasses
import subprocess
import sys

import pytest

from megapipe import cli
from megapipe.cli import main
from megapipe.schedule.ir import read_csv
from megapipe.schedule.registry import build_schedule
from megapipe.subcommand import Subcommand


def test_schedule_prints_grid_and_metrics(capsys):
    assert main(["schedule", "interleaved-1f1b", "--pp", "4", "--vpp", "2", "-m", "8",
                 "--overlap"]) == 0
    out = capsys.readouterr().out
    assert "interleaved-1f1b + overlap: pp=4 vpp=2 microbatches=8" in out
    assert "#     rank 0" in out and "(0F7;4B0)OVERLAP_F_B" in out
    assert "makespan          57" in out
    assert "bubble per rank   9 9 9 9" in out  # (pp-1)(F+B) with the default costs 1,2,1


def test_costs_with_all_to_all(capsys):
    assert main(["schedule", "1f1b", "--pp", "2", "-m", "4", "--costs", "1,2,1,0.5"]) == 0
    out = capsys.readouterr().out
    assert "exposed a2a frac  100.0%" in out
    assert "dispatch=0.5 combine=0.5" in out


def test_csv_and_trace_are_written(tmp_path, capsys):
    """(The PNG is tested in tests/sim; drawing costs seconds.)"""
    csv, trace = tmp_path / "s.csv", tmp_path / "s.json"
    assert main(["schedule", "zb1p", "--pp", "2", "--vpp", "2", "-m", "4", "--csv", str(csv),
                 "--trace", str(trace)]) == 0
    loaded = read_csv(str(csv))
    assert loaded.actions == build_schedule("zb1p", 2, 4, vpp=2).actions
    assert trace.read_text().startswith('{"traceEvents"')
    assert f"wrote {csv}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["schedule", "nope", "--pp", "2", "-m", "4"], "unknown schedule 'nope'"),
        (["schedule", "dualpipe", "--pp", "3", "-m", "8"], "needs an even pp"),
        (["schedule", "1f1b", "--pp", "2", "-m", "4", "--max-extra-in-flight", "-1"],
         "--max-extra-in-flight=-1 must be >= 0"),
        (["schedule", "1f1b", "--pp", "0", "-m", "4"], "--pp=0 must be >= 1"),
        (["schedule", "1f1b", "--pp", "2"], "required: -m/--num-microbatches"),
        (["schedule", "1f1b", "--pp", "2", "-m", "4", "--costs", "1,2,3"], "must not exceed"),
        (["schedule", "1f1b", "--pp", "2", "-m", "4", "--costs", "a"], "F,B,W or F,B,W,A2A"),
        (["schedule", "1f1b", "--pp", "2", "-m", "4", "--moe-layers", "-1"],
         "--moe-layers=-1 must be >= 0"),
        (["schedule", "1f1b", "--pp", "2", "-m", "4", "--png", "/nonexistent/x.png"],
         "folder '/nonexistent' does not exist"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "required: COMMAND"),
    ],
)
def test_bad_arguments_give_one_line(argv, message, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megapipe: error: ")
    assert message in lines[0]


def test_entry_point_runs_as_a_process():
    proc = subprocess.run(
        [sys.executable, "-m", "megapipe.cli", "schedule", "1f1b", "--pp", "2", "-m", "x"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "megapipe: error: argument -m/--num-microbatches: invalid int value: 'x'"
    ]


def test_budget_prints_peaks_and_the_makespan_of_every_budget(capsys):
    assert main(["schedule", "1f1b", "--pp", "4", "-m", "8", "--max-extra-in-flight", "1",
                 "--costs", "1,2,1,0.5"]) == 0
    out = capsys.readouterr().out
    assert "1f1b + overlap (K=1): pp=4" in out
    assert "peak in flight plain     4 3 2 1" in out
    assert "peak in flight combined  4 4 2 2" in out  # within +1 on every rank
    table = out.split("the trade by in-flight budget")[1].splitlines()[2:]
    labels = [line.split()[0] for line in table]
    assert labels == ["plain", "0", "1", "2", "3", "4", "unbounded"]
    unbounded = table[-1].split()
    assert unbounded[3:7] == ["8", "6", "4", "2"]  # the chain doubles rank 0's peak


def _refused_before_running(command):
    def run(checked):
        raise AssertionError(f"{command.name} ran with a bad argument")
    return dataclasses.replace(command, run=run)


# one bad argument per subcommand, and the value its one-line refusal must name
BAD_ARGUMENT = {
    "schedule": (["1f1b", "--pp", "2", "-m", "-3"], "--num-microbatches=-3"),
    "pretrain": (["--global-batch-size", "30"], "--global-batch-size=30"),
    "trace": (["summarize", "{d}/none.json"], "{d}/none.json"),
    "train-tokenizer": (["--input", "{d}", "--output", "{d}/t", "--vocab-size", "100"],
                        "--vocab-size=100"),
    "preprocess-data": (["--input", "{d}/x.jsonl", "--tokenizer-type", "ByteTokenizer",
                         "--output-prefix", "{d}/o", "--log-interval", "0"], "--log-interval=0"),
    "export-hf": (["--load", "{d}", "--out", "{d}/o", "--max-shard-size-mb", "0"],
                  "--max-shard-size-mb=0"),
}


def test_every_subcommand_is_declared_one_way_and_has_a_bad_argument_case():
    assert all(isinstance(c, Subcommand) for c in cli.SUBCOMMANDS)
    assert sorted(c.name for c in cli.SUBCOMMANDS) == sorted(BAD_ARGUMENT)


@pytest.mark.parametrize("name", sorted(BAD_ARGUMENT))
def test_a_bad_argument_is_one_line_naming_the_value_before_anything_runs(
        name, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "SUBCOMMANDS",
                        tuple(_refused_before_running(c) for c in cli.SUBCOMMANDS))
    argv, value = BAD_ARGUMENT[name]
    assert main([name, *(a.format(d=tmp_path) for a in argv)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megapipe: error: "), lines
    assert value.format(d=tmp_path) in lines[0]
