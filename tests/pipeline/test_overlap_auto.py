"""The overlap's auto mode alone: which executor each step gets, when it decides, what it logs
(one process; the pretrain tests run it across ranks)."""

import pytest

from megapipe.pipeline.overlap_auto import OverlapAuto
from support.scripted_clock import ScriptedClock


class _Executor:
    def __init__(self, name):
        self.name, self.closed = name, 0

    def close(self):
        self.closed += 1


def _steps(auto, n):
    modes, lines = [], []
    for _ in range(n):
        modes.append(auto.executor.name)
        auto.start()
        line = auto.finish()
        if line is not None:
            lines.append(line)
    return modes, lines


@pytest.mark.parametrize("seconds, on", [({False: 2.0, True: 1.0}, True),
                                         ({False: 1.0, True: 1.5}, False),
                                         ({False: 1.0, True: 1.0}, False)])  # a tie: plain
def test_keeps_the_faster_mode_and_checks_again(seconds, on):
    auto = OverlapAuto(_Executor("plain"), _Executor("combined"), interval=8,
                       clock=ScriptedClock(seconds))
    modes, lines = _steps(auto, 16)
    kept = "combined" if on else "plain"
    trial = ["plain"] * 3 + ["combined"] * 3
    assert modes == trial + [kept] * 2 + trial + [kept] * 2
    word = "on" if on else "off"
    assert lines == [
        f"overlap auto: {word} (combined {seconds[True]:.4g} s vs plain {seconds[False]:.4g} s "
        f"per step, slowest rank, steps 1-6; next check at step 9)",
        f"overlap auto: {word} (combined {seconds[True]:.4g} s vs plain {seconds[False]:.4g} s "
        f"per step, slowest rank, steps 9-14; next check at step 17)"]
    assert auto.decisions == [(on, seconds[False], seconds[True])] * 2
    auto.close()
    assert [e.closed for e in auto.executors.values()] == [1, 1]


def test_a_mode_counts_its_faster_step_after_the_warm_up():
    times = iter([0, 5, 5, 7, 10, 19, 20, 23])  # start/end of the counted steps 2, 3, 5, 6
    auto = OverlapAuto(_Executor("plain"), _Executor("combined"), interval=0,
                       clock=lambda: next(times))
    modes, lines = _steps(auto, 9)
    assert auto.decisions == [(False, 2.0, 3.0)]  # plain: min(5, 2); combined: min(9, 3)
    assert modes == ["plain"] * 3 + ["combined"] * 3 + ["plain"] * 3
    assert lines[0].endswith("steps 1-6; no further check)")


@pytest.mark.parametrize("interval", [-1, 1, 5])
def test_an_interval_shorter_than_a_trial_is_refused(interval):
    with pytest.raises(ValueError, match=f"interval={interval} must be 0"):
        OverlapAuto(_Executor("plain"), _Executor("combined"), interval=interval)
