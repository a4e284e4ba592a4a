"""No reference cycles through the Megatron-Core adapter (issue 41): after a step of megapipe's
front end on Megatron's own chunks (the adapter's layer nodes, its deferred weight gradients, the
pipelined combined steps), the cyclic garbage collector finds no megapipe object and no tensor on
any rank. The installed release, in the shared pool of 4 the adapter tests use."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "megatron.core",
    reason="megatron-core is not installed (pip install 'megapipe[megatron]')",
)

from support import mcore_cases
from support.mcore_models import McoreCase
from support.rank_pool import run_with_room


def test_a_step_on_megatron_chunks_leaves_no_cyclic_garbage(rank_pools):
    pool = rank_pools(4, None, env={"TORCHDYNAMO_DISABLE": "1", "NO_VCS_VERSION": "1"})
    run_with_room(pool, mcore_cases.warm_up, None)  # Megatron's import: minutes when busy
    # pipelined combined steps with I and W halves, Megatron's deferred weight gradients
    # driven by the adapter, shared experts, the node trace: one case (time)
    case = McoreCase(pp=2, vpp=2, ep=2, delay_wgrad=True, shared_expert=True, schedule="zb1p")
    assert run_with_room(pool, mcore_cases.cyclic_garbage_case, case, True) == [{}] * 4
