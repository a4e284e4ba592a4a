"""The adapter's layers on the CUDA path, held to CUDA's stream and allocator rules on CPU.

Megatron-Core's MoE layers end in their combine, a comm node, so their backward starts on the
comm stream reading the gradient the next layer (compute) gave: the case the stream checker
(``support.stream_checker``) found unkept. One combined step per case on Megatron's own chunks
(the installed release, in the shared pool of 4 the adapter tests use): no findings.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "megatron.core",
    reason="megatron-core is not installed (pip install 'megapipe[megatron]')",
)

from support import mcore_cases  # noqa: E402
from support.mcore_models import McoreCase  # noqa: E402
from support.rank_pool import run_with_room  # noqa: E402
from support.stream_cases import mcore_findings  # noqa: E402


def test_the_adapters_layers_keep_the_stream_rules(rank_pools):
    # the installed release's pool, as tests/megatron/test_mcore_adapter.py makes it
    pool = rank_pools(4, None, env={"TORCHDYNAMO_DISABLE": "1", "NO_VCS_VERSION": "1"})
    run_with_room(pool, mcore_cases.warm_up, None)  # Megatron's import: minutes when busy
    for case in (McoreCase(pp=2, vpp=2, ep=2),
                 McoreCase(pp=2, vpp=2, ep=2, delay_wgrad=True, shared_expert=True,
                           schedule="zb1p")):
        assert run_with_room(pool, mcore_findings, case) == [[]] * 4, case
