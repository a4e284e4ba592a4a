"""What a CUDA graph saves the host per captured node, counted on CPU.

Per node of the reference GPT that ``--cuda-graph-modules attn moe_router moe_preprocess mlp``
captures (a MoE layer's attention node, a dense layer), one forward and backward through the
tape's own calls (the node's function, then one autograd call for its outputs), in bf16 with
fp32 main gradients, as the GPU code path runs it: the ops that run a kernel (views and
``detach`` left out), eager against captured. Captured, the node's own ops run inside its two
graphs, which count one launch each; what stays outside is counted (input and gradient copies,
the auxiliary-loss copy, autograd's accumulation into ``main_grad``). The graph calls are a
counting stand-in (capture runs the function once, replay only counts), so no GPU is needed and
the count is of the live code.

    python benchmarks/graph_launches.py [--hidden 64]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.launches = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if not func.is_view and func.overloadpacket.__name__ != "detach":
            self.launches += 1
        return func(*args, **(kwargs or {}))


class _CountingGraphs:
    """The graph calls of ``megapipe.graphs.nodes.GraphApi``: a capture runs the function
    once (its results stand for the static buffers), a replay counts one launch."""

    def __init__(self) -> None:
        self.replays = 0

    def warm(self, fn: Callable[[], Any]) -> None:
        fn()

    def capture(self, fn: Callable[[], Any], pool: Any, mode: str,
                static: Any = ()) -> tuple[Any, Any]:
        return object(), fn()

    def pool(self, graph: Any) -> None:
        return None

    def replay(self, graph: Any) -> None:
        self.replays += 1

    def reserved(self) -> int:
        return 0


def count(hidden: int) -> dict[str, tuple[int, int]]:
    """Per captured node: (eager launches, launches with graphs) for one forward + backward."""
    from megapipe.graphs.nodes import NodeGraphs
    from megapipe.models import GPTConfig, build_stage
    from megapipe.overlap.tape import _run_backward
    from megapipe.train.optim.mixed_precision import cast_to_bf16

    config = GPTConfig(hidden_size=hidden, num_heads=4, num_layers=2, seq_length=64,
                       ffn_hidden_size=2 * hidden, num_experts=8, moe_top_k=2,
                       moe_ffn_hidden_size=hidden, first_k_dense_layers=1)
    stage = build_stage(config, 0, 1)
    cast_to_bf16([stage], list(stage.parameters()))
    api = _CountingGraphs()
    graphs = NodeGraphs(("attn", "moe_router", "moe_preprocess", "mlp"), api)
    out: dict[str, tuple[int, int]] = {}
    for plan in stage.layer_plans()[1:-1]:
        node, captured = plan[0], graphs.plan(plan)[0]
        x = torch.randn(2, config.seq_length, hidden, dtype=torch.bfloat16)

        def once(run: Any, leaf: torch.Tensor) -> tuple:
            outs = run.fn(plan.state_type(), (leaf,))  # the layer kind's state
            return tuple(o for o in outs if o.requires_grad)

        grads = tuple(torch.ones_like(o) for o in once(node, x.clone().requires_grad_()))
        launches = []
        for run in (node, captured):
            for _ in range(3):  # the first two warm up (and capture), the last is counted
                leaf = x.clone().requires_grad_()
                api.replays = 0
                with _Count() as c:
                    _run_backward(once(run, leaf), grads, False, False, (), True, True)
            launches.append(c.launches + api.replays)
        for layer in stage.moe_layers():
            layer.aux_loss_log.pop_all()
        out[node.name] = (launches[0], launches[1])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args(argv)
    results = count(args.hidden)
    print(f"launches per captured node, forward + backward, bf16, hidden {args.hidden}:")
    for name, (eager, graphed) in results.items():
        print(f"  {name}: eager {eager}, CUDA graphs {graphed} ({graphed / eager:.2f})")
    eager = sum(e for e, _ in results.values())
    graphed = sum(g for _, g in results.values())
    print(f"launches of the captured nodes: eager {eager}, CUDA graphs {graphed}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
