"""Launches one MoE layer's combined step issues outside CUDA graphs, counted on the live code.

``host_cost.py --launches`` prints it as ``launches per MoE layer outside CUDA graphs: N``: the
demo's layer with ``--moe-expert-rank-capacity-factor`` (static shapes, no host read),
``--cuda-graph-modules attn moe`` (the layer graphed whole) and fp32 main gradients (a bf16
run's, and the data-parallel buffers'), its graphs replayed by the CPU graph stand-in
(``tests/support/fake_graphs.py``, which replays below every dispatch mode), each replay counted
as one launch and every other operator the host dispatches as one
(``launch_count.LaunchCounter``'s rule). What is left (docs/cuda-graphs.md): the six replays,
the layer input's copy into its static buffer, the incoming gradient's, the input gradient's
copy into ``.grad`` at the layer boundary, the auxiliary-loss log's copy; at ep > 1 the
all-to-alls run eager besides (on the comm stream) and their results are copied in.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from launch_count import LaunchCounter, combined, demo_layer

RANK_CAPACITY = 2.0  # the rank capacity factor of the count outside graphs (never overflows)
WHOLE_LAYER = ("attn", "moe")  # --cuda-graph-modules of the count: the MoE layer graphed whole
PARTIAL_LAYER = ("attn", "moe_router", "moe_preprocess")  # the attention node alone
GRAPH_REPLAY = "graph_replay"  # the name a replay is counted under


def _replay_counting_api() -> Any:
    """The CPU graph stand-in (``tests/support/fake_graphs.py``), counting each replay as one
    launch of the counter in ``.counter`` (None: not counted)."""
    root = str(Path(__file__).resolve().parents[1] / "tests")
    if root not in sys.path:
        sys.path.insert(0, root)
    from support.fake_graphs import FakeGraphApi

    class ReplayCounting(FakeGraphApi):
        counter: LaunchCounter | None = None

        def replay(self, graph: Any) -> None:
            if self.counter is not None and self.counter in _get_current_dispatch_mode_stack():
                self.counter.launch(GRAPH_REPLAY)  # while the counter counts, as an operator
            super().replay(graph)

    return ReplayCounting()


def launches_outside_graphs(stage: Any | None = None, modules: Sequence[str] = WHOLE_LAYER,
                            main_grads: bool = True) -> tuple[int, LaunchCounter]:
    """Launches the host issues for one MoE layer's combined step (F of one microbatch beside
    B of another) with ``--moe-expert-rank-capacity-factor`` and ``--cuda-graph-modules
    modules`` (the demo's layer alone in its stage, ep 1; ``main_grads``: its parameters given
    fp32 ``main_grad`` buffers, as a bf16 run's, else gradients in ``.grad``), counted on the
    live code: the graphs captured in a first round, the second counted, where each replay
    counts one and every operator the host issues besides counts one (copies into static
    buffers, the all-to-all nodes, the gradients' accumulation outside the graphs). Returns
    (the count, its counter)."""
    from megapipe.graphs.nodes import NodeGraphs
    from megapipe.precision.main_grad import attach_main_grads

    if stage is None:
        stage = demo_layer(moe_expert_rank_capacity_factor=RANK_CAPACITY)
        if main_grads:
            attach_main_grads(stage.parameters())
    api = _replay_counting_api()
    graphs = NodeGraphs(modules, api)
    plans = [graphs.plan(plan) for plan in stage.layer_plans()]
    torch.manual_seed(0)
    counter = None
    for counted in (False, True):  # the first round captures
        counter = None
        gc.collect()  # the first round's autograd records (its counter keeps them) gone
        counter = LaunchCounter()
        api.counter = counter if counted else None
        captured = graphs.captured
        combined(counter, stage, plans)
        stage.zero_grad(set_to_none=True)
        for layer in stage.moe_layers():
            layer.aux_loss_log.pop_all()
    if graphs.captured != captured:
        raise RuntimeError("the counted round captured graphs: it would count their capture")
    return counter.total(), counter
