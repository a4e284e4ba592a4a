"""Preemption and early exits resume bitwise; a rank that stops calling is named by the others."""

from support.fault_cases import stuck_waits, train_with_signal
from support.pretrain_flags import TINY


def test_sigterm_exit_interval_and_duration_save_and_resume_bitwise(rank_pools, tmp_path):
    """One uninterrupted run against the same run cut four times: SIGTERM during iteration 2
    (--exit-signal-handler), --exit-interval 3, --exit-duration-in-mins reached after one
    iteration, then to the end. Every piece saves where it stops and the next resumes there;
    --keep-last 2 leaves the last two."""
    common = TINY + ["--train-iters", "5", "--eval-interval", "0"]
    full = rank_pools(4).run(train_with_signal, common)[0]
    save = str(tmp_path / "ckpt")
    resume = ["--save", save, "--load", save, "--keep-last", "2"]
    pieces = [
        (["--exit-signal-handler"], 2, "SIGTERM received", 2),
        (["--exit-interval", "3"], None, "--exit-interval=3 reached", 3),
        (["--exit-duration-in-mins", "1e-9"], None, "--exit-duration-in-mins=1e-09 reached", 4),
        ([], None, None, 5),
    ]
    losses = []
    for flags, signal_at, reason, stop in pieces:
        results = rank_pools(4).run(train_with_signal, common + resume + flags, signal_at)
        assert all(r.exit_reason == reason for r in results), flags
        result = results[0]
        assert result.saved[-1].endswith(f"iter_{stop:07d}"), flags
        if reason is not None:
            assert result.lines[-1] == (f"exiting after iteration {stop}: {reason}; saved "
                                        f"checkpoint {result.saved[-1]}")
        losses += result.losses
    assert losses == full.losses  # bitwise
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "iter_0000004", "iter_0000005", "latest_checkpointed_iteration.txt"]  # --keep-last 2


def test_a_rank_that_stops_calling_is_named_by_what_the_others_wait_on(rank_pools):
    outcome = rank_pools(4).run(stuck_waits, 1.0)[0]
    expected = {
        "pipeline receive": "1RECV_F0 (receive from rank 1)",
        "all-to-all": "waited on the expert-parallel all-to-all (dispatch) and timed out",
        "gradient reduction": "waited on the data-parallel gradient reduction and timed out",
    }
    for name, words in expected.items():
        line, seconds = outcome[name]
        assert line.startswith("rank 0: ") and words in line, line
        assert "\n" not in line and "Traceback" not in line
        assert 0.9 <= seconds < 5.0, (name, seconds)  # within the timeout, not forever
