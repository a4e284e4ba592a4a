"""The schedule layer gives exactly the outputs it gave before issue 17 made it fast.

``golden_sweep.txt`` holds digests of every output (schedule text, timeline, lowered text,
validation, two simulations, and the errors on perturbed copies; see ``sweep_outputs``) for every
registry schedule, pp 1-8, microbatches 1-24, vpp 1-3, overlap off and on. The default run
checks one microbatch count for every other (schedule, pp, vpp, overlap) in a few seconds
(``quick_microbatches``); ``MEGAPIPE_FULL_SWEEP=1`` checks everything (about five minutes).
"""

from __future__ import annotations

import os

import pytest

from sweep_outputs import MICROBATCHES, group_digests, group_key, groups, read_golden

FULL = os.environ.get("MEGAPIPE_FULL_SWEEP") == "1"
GROUPS = list(groups())

GOLDEN = read_golden()


def test_golden_file_covers_the_sweep():
    assert set(GOLDEN) == {group_key(*g) for g in groups()}
    assert all(len(v) == len(MICROBATCHES) for v in GOLDEN.values())


def quick_microbatches(group: int) -> tuple[int, ...]:
    """What the default run checks of group number ``group``: every other group (each schedule
    and pp keeps three of its six vpp and overlap settings), one microbatch count each, cycling
    through 1..24 so that every count is checked for every schedule."""
    if group % 2:
        return ()
    return (MICROBATCHES[(group // 2 * 7) % len(MICROBATCHES)],)


@pytest.mark.parametrize("group", range(len(GROUPS)), ids=lambda g: group_key(*GROUPS[g]))
def test_outputs_match_the_golden_digests(group):
    name, pp, vpp, overlap = GROUPS[group]
    if not FULL and not quick_microbatches(group):
        pytest.skip("checked with MEGAPIPE_FULL_SWEEP=1")
    expected = GOLDEN[group_key(name, pp, vpp, overlap)]
    wanted = MICROBATCHES if FULL else quick_microbatches(group)
    got = group_digests(name, pp, vpp, overlap, wanted)
    for m, digest in zip(wanted, got):
        assert digest == expected[m - 1], f"{name} pp={pp} m={m} vpp={vpp} overlap={overlap}"
