"""The schedule layer gives exactly the outputs it gave before issue 17 made it fast.

``golden_sweep.txt`` holds digests of every output (schedule text, timeline, lowered text,
validation, two simulations, and the errors on perturbed copies; see ``sweep_outputs``) for every
registry schedule, pp 1-8, microbatches 1-24, vpp 1-3, overlap off and on. The default run
checks a spread of that sweep in a few seconds; ``MEGAPIPE_FULL_SWEEP=1`` checks all of it
(about a minute).
"""

from __future__ import annotations

import os

import pytest

from sweep_outputs import MICROBATCHES, group_digests, group_key, groups, read_golden

FULL = os.environ.get("MEGAPIPE_FULL_SWEEP") == "1"
QUICK_PP = (1, 2, 3, 4, 8)
QUICK_MICROBATCHES = (1, 2, 3, 5, 8, 12, 16, 24)

GOLDEN = read_golden()


def test_golden_file_covers_the_sweep():
    assert set(GOLDEN) == {group_key(*g) for g in groups()}
    assert all(len(v) == len(MICROBATCHES) for v in GOLDEN.values())


@pytest.mark.parametrize("name, pp, vpp, overlap", list(groups()))
def test_outputs_match_the_golden_digests(name, pp, vpp, overlap):
    if not FULL and pp not in QUICK_PP:
        pytest.skip("part of the full sweep (MEGAPIPE_FULL_SWEEP=1)")
    expected = GOLDEN[group_key(name, pp, vpp, overlap)]
    wanted = MICROBATCHES if FULL else QUICK_MICROBATCHES
    got = group_digests(name, pp, vpp, overlap, wanted)
    for m, digest in zip(wanted, got):
        assert digest == expected[m - 1], f"{name} pp={pp} m={m} vpp={vpp} overlap={overlap}"
