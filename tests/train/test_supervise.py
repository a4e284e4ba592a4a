"""Choosing the one line a failed run prints, and a rank's own report (no processes needed)."""

import signal
from pathlib import Path

import megapipe.train.main as pretrain
from megapipe.train.supervise import Report, explain, read_reports, supervise, write_report


class _Proc:
    """A rank process that has exited with ``code`` after ``polls`` polls (None: never)."""

    def __init__(self, code, polls=0):
        self.code, self.polls, self.pid, self.killed = code, polls, None, False

    @property
    def exitcode(self):
        if self.killed:
            return -signal.SIGKILL
        if self.polls > 0:
            self.polls -= 1
            return None
        return None if self.code is None else self.code

    def kill(self):
        self.killed = True

    def join(self, timeout=None):
        pass


def test_a_rank_killed_without_a_report_is_the_cause():
    reports = [Report(0, "rank 0: the expert-parallel all-to-all (dispatch) failed: the "
                         "connection to a peer broke", 2.0, secondary=True)]
    line = explain([1, -signal.SIGKILL], reports, stopped=set())
    assert line == "rank 1 was killed by SIGKILL (it left no report: crashed or killed)"


def test_the_earliest_first_hand_report_wins_over_consequences():
    reports = [Report(2, "rank 2: connection broke", 1.0, secondary=True),
               Report(1, "rank 1: --data-path x: bad bytes", 2.0, secondary=False),
               Report(3, "rank 3: another", 3.0, secondary=False)]
    assert explain([1, 1, 1, 1], reports, stopped=set()) == "rank 1: --data-path x: bad bytes"


def test_after_a_timeout_the_ranks_still_running_are_named():
    reports = [Report(0, "rank 0: waited on the data-parallel gradient reduction and timed out",
                      1.0, secondary=False)]
    line = explain([1, -signal.SIGKILL], reports, stopped={1})
    assert line.endswith("timed out; rank(s) 1 still ran and were stopped")


def test_supervise_stops_the_others_after_the_first_failure(tmp_path):
    hung = _Proc(None)
    write_report(tmp_path, 0, "rank 0: boom", secondary=False)
    code, line = supervise([_Proc(1), hung], tmp_path, grace_s=0.0, poll_s=0.0)
    assert (code, line) == (1, "rank 0: boom") and hung.killed
    assert supervise([_Proc(0, polls=3), _Proc(0)], tmp_path, poll_s=0.0) == (0, None)
    assert [r.line for r in read_reports(tmp_path)] == ["rank 0: boom"]


def test_a_rank_reports_its_error_in_one_line(monkeypatch):
    def failing_train(args, choice=None):
        raise ValueError("the corpus has 3 tokens: too few for two windows\nsecond line")

    monkeypatch.setattr(pretrain, "train", failing_train)
    monkeypatch.setenv("RANK", "3")
    said = []
    assert (
        pretrain.run_rank(None, None, lambda line, secondary: said.append((line, secondary))) == 1
    )
    assert said == [("rank 3: the corpus has 3 tokens: too few for two windows", False)]


def test_report_files_are_whole_or_absent(tmp_path: Path):
    (tmp_path / "rank5.json").write_text("{half")
    write_report(tmp_path, 1, "rank 1: x", secondary=True)
    assert [(r.rank, r.secondary) for r in read_reports(tmp_path)] == [(1, True)]
