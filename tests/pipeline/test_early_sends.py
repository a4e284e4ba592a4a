"""Early sends: each half of an OVERLAP sends its result from inside the pair, deadlock-free."""

import pytest

from megapipe.schedule import build_schedule
from megapipe.schedule.errors import ScheduleError
from megapipe.schedule.p2p.comm_check import check_batches
from megapipe.schedule.p2p.early_sends import (
    EACH,
    SINGLE,
    WHOLE,
    candidates,
    choose_early_sends,
    early_posting,
)
from megapipe.schedule.rank_views import lower_schedule
from support.combined_cases import early_send_order
from support.pipeline_cases import Case

# (schedule, pp, vpp, microbatches, the rule the proof allows)
SCHEDULES = [
    ("1f1b", 2, 1, 4, EACH), ("1f1b", 8, 1, 32, EACH),
    ("interleaved-1f1b", 4, 1, 8, EACH), ("interleaved-1f1b", 2, 2, 8, SINGLE),
    ("interleaved-1f1b", 8, 2, 32, SINGLE),
    ("zb1p", 4, 1, 8, EACH), ("zb1p", 4, 2, 16, SINGLE),
    ("zbv", 2, 2, 8, EACH), ("zbv", 8, 2, 32, EACH),
    ("dualpipev", 4, 2, 16, WHOLE), ("dualpipe", 4, 2, 16, WHOLE),
]


@pytest.mark.parametrize("name,pp,vpp,m,rule", SCHEDULES, ids=lambda v: str(v))
def test_early_sends_are_proven_deadlock_free_for_every_combined_schedule(name, pp, vpp, m, rule):
    lowered = lower_schedule(build_schedule(name, pp, m, vpp=vpp, overlap=True))
    early, found = choose_early_sends(lowered)
    assert found == rule
    # raises ScheduleError if it could deadlock
    check_batches(lowered, early_posting(lowered, early))
    if rule == WHOLE:
        assert early == {}  # each pair's whole batch goes once both halves are done
    if rule == SINGLE:
        assert early and all(len(sends) == 1 for sends in early.values())
    if rule != EACH:
        # why not each half: two neighbours that both send early wait on each other
        with pytest.raises(ScheduleError, match="deadlocks"):
            check_batches(lowered, early_posting(lowered, candidates(lowered)))


def test_each_half_sends_before_its_pair_ends(rank_pools):
    # 1F1B at pp = 2 proves "each half": rank 0's forward output and rank 1's input gradient
    # leave from inside the pair (before its held weight gradients and the end of the step)
    case = Case("1f1b", 2, ep=2, dp=2, microbatches=4)
    results = [r for r in rank_pools(8).run(early_send_order, case) if r is not None]
    assert len(results) == 4
    for rank, result in enumerate(results):
        assert result["differences"] == [], result["differences"]
        log = result["log"]
        pair_ends = [i for i, (what, _) in enumerate(log) if what == "pair end"]
        assert pair_ends, log
        before = 0
        for end in pair_ends:
            previous = max([i for i in pair_ends if i < end], default=-1)
            sends = [
                text for what, text in log[previous + 1 : end] if what == "post" and "SEND" in text
            ]
            before += bool(sends)
        # every pair hands something on before it ends (rank 0: SEND_F, rank 1: SEND_B)
        assert before == len(pair_ends), (rank, log)
