"""CUDA graphs of static nodes on a GPU (``megapipe.graphs.nodes``; skipped without CUDA).

Under deterministic kernels, bf16 with fp32 main gradients, pp 1 and 1f1b with 4 microbatches:
graphs on give the losses and every main gradient of graphs off, in the plain and the combined
schedule (also with deferred expert weight gradients and a capacity), each against a control
(the eager run twice: if it differs, a kernel is non-deterministic and the comparison says
nothing); the combined step replays its graphs on its compute stream; the graphs' private pools
are reported. Every capture runs with torch's input-liveness check (``check_input_liveness``:
a replay whose graph reads a tensor freed since its capture raises). The same logic runs on CPU
with a stand-in (``tests/graphs/test_graphs.py``).
"""

import dataclasses
import inspect
import os

import pytest
import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from megapipe.models.config import GPTConfig  # noqa: E402
from megapipe.models.gpt import gpt_loss  # noqa: E402
from megapipe.models.split import build_stage  # noqa: E402
from megapipe.pipeline.executor import PipelineExecutor  # noqa: E402
from megapipe.pipeline.executor_options import ExecutorOptions  # noqa: E402
from megapipe.precision.main_grad import accumulated_grad  # noqa: E402
from megapipe.schedule import build_schedule  # noqa: E402
from megapipe.train.determinism import deterministic_kernels  # noqa: E402
from megapipe.train.optim.mixed_precision import cast_to_bf16  # noqa: E402

CONFIG = GPTConfig(vocab_size=256, hidden_size=128, num_layers=3, num_heads=4, seq_length=64,
                   ffn_hidden_size=256, num_experts=8, moe_top_k=2, moe_ffn_hidden_size=128,
                   first_k_dense_layers=1, seed=5)
MODULES = ("attn", "moe_router", "moe_preprocess", "mlp")
MICROBATCHES = 4


def _api():  # noqa: ANN202
    """The real graph calls with torch's input-liveness check on every capture."""
    from megapipe.graphs.nodes import GraphApi

    if "check_input_liveness" not in inspect.signature(
            torch.cuda.CUDAGraph.capture_begin).parameters:
        pytest.skip("this torch has no CUDA-graph input-liveness check (torch 2.13 has)")
    return GraphApi(torch.device("cuda"), check_input_liveness=True)


def _step(overlap: bool, graphs: bool, capacity=None, **options):  # noqa: ANN003, ANN202
    config = dataclasses.replace(CONFIG, moe_capacity_factor=capacity)
    stage = build_stage(config, 0, 1).cuda()
    cast_to_bf16([stage], list(stage.parameters()))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (MICROBATCHES, 2, CONFIG.seq_length + 1), generator=gen).cuda()
    extra = dict(cuda_graph_impl="local", cuda_graph_modules=MODULES,
                 graph_api=_api()) if graphs else {}
    with PipelineExecutor(build_schedule("1f1b", 1, MICROBATCHES, overlap=overlap), {0: stage},
                          ExecutorOptions(loss_fn=gpt_loss, **extra, **options)) as executor:
        for _ in range(2):  # the second step replays graphs captured in the first
            for p in stage.parameters():
                p.main_grad.zero_()
            result = executor.step([i[:, :-1] for i in ids], [i[:, 1:] for i in ids])
        torch.cuda.synchronize()
    return ([result.losses[m] for m in sorted(result.losses)],
            [accumulated_grad(p).clone() for p in stage.parameters()], result)


def _equal(a, b) -> bool:  # noqa: ANN001
    return all(torch.equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1]))


@pytest.mark.parametrize("capacity", [None, 1.0], ids=["dropless", "capacity"])
def test_graphs_on_give_the_bits_of_graphs_off(capacity) -> None:  # noqa: ANN001
    with deterministic_kernels(strict=False):
        eager = _step(False, False, capacity)
        if not _equal(eager, _step(False, False, capacity)):
            pytest.skip("control: two eager runs differ (a non-deterministic kernel)")
        for overlap, options in ((False, {}), (True, {}), (True, {"delay_wgrad_compute": True})):
            graphed = _step(overlap, True, capacity, **options)
            assert _equal(eager, graphed), f"overlap={overlap} {options}"
            assert graphed[2].graph_instances >= 2 and graphed[2].graph_bytes > 0


def test_a_graph_captured_on_the_side_stream_replays_on_the_current_one() -> None:
    """The replay follows the stream current at the call: a side stream's work and the graph's
    reads and writes are ordered by the usual stream waits."""
    from megapipe.graphs.nodes import Graphable, NodeGraphs
    from megapipe.overlap.plan import Node, NodeKind, Plan, run_nodes

    weight = torch.randn(64, 64, device="cuda", requires_grad=True)
    node = Node("n", NodeKind.COMPUTE, lambda s, t: (torch.tanh(t[0] @ weight),),
                graphable=Graphable(("attn",), (weight,)))
    plan = NodeGraphs(("attn",), _api()).plan(Plan([node]))
    other = torch.cuda.Stream()
    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    run_nodes(plan, (x,))[0].sum().backward()  # the capture
    other.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(other):
        y = run_nodes(plan, (x * 2,))[0]
        y.sum().backward()
    torch.cuda.current_stream().wait_stream(other)
    assert torch.equal(y, torch.tanh((x * 2) @ weight))
