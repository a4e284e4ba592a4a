import math

import pytest

from megapipe.train.observe.logging import NonFiniteLossError, TrainingLogger


def test_line_every_interval_with_means_and_na_fraction():
    lines = []
    log = TrainingLogger(train_iters=5, log_interval=2, write=lines.append)
    assert log.record(1, loss=3.0, aux_loss=0.1, lr=1e-3, grad_norm=2.0, step_time=0.5,
                      tokens=1000) is None
    line = log.record(2, loss=1.0, aux_loss=0.3, lr=2e-3, grad_norm=4.0, step_time=1.5,
                      tokens=1000, a2a_hidden=None, a2a_exposed=None)
    assert line == ("iter 2/5 | loss 2.0000 | aux 0.2000 | lr 1.50e-03 | grad norm 3.000 | "
                    "1,000 tok/s | step 1.000 s | a2a n/a | act mem n/a")
    assert lines == [line]
    assert log.overlap_summary() is None
    log.record(3, loss=1.0, step_time=1.0, tokens=10, a2a_hidden=0.030, a2a_exposed=0.010)
    log.record(4, loss=1.0, step_time=1.0, tokens=10, a2a_hidden=0.010, a2a_exposed=0.150,
               act_mem=3 * 2**20)
    assert lines[-1].endswith("a2a hidden 20 ms, exposed 80 ms | act mem 3.00 MiB")
    assert log.record(5, loss=1.0, step_time=1.0, tokens=10) is not None  # the last iteration
    assert log.overlap_summary() == "the overlap hid 0.04 s of 0.20 s of all-to-all per rank (20%)"


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_loss_stops_naming_the_iteration(bad):
    log = TrainingLogger(train_iters=10, log_interval=5, write=lambda s: None)
    with pytest.raises(NonFiniteLossError, match="at iteration 7"):
        log.record(7, loss=bad)


def test_disabled_logger_prints_nothing_and_eval_line():
    lines = []
    log = TrainingLogger(train_iters=2, log_interval=1, enabled=False, write=lines.append)
    log.record(1, loss=1.0)
    assert lines == []
    on = TrainingLogger(train_iters=2, log_interval=1, write=lines.append)
    assert on.evaluation(2, 0.0) == ("validation at iter 2 | loss 0.0000 per token | ppl 1.00 | "
                                     "bits per byte n/a")
    assert on.evaluation(2, math.log(2), 0.25) == (
        "validation at iter 2 | loss 0.6931 per token | ppl 2.00 | 0.2500 bits per byte")
