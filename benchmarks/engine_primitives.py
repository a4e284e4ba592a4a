"""Count the engine's own CUDA-host work per node of a combined step, on CPU.

The combined step's CUDA path runs here with the ``torch.cuda`` calls it makes replaced by
counting stand-ins (the streams are fake, the work runs inline on the host on CPU tensors), so
the count is of the live code's calls, not of a table: per F or B node of one forward of two MoE
layers of the reference GPT beside the backward of two (the executor's steady state), with
deferred weight gradients, it prints the events made, the events recorded, the stream switches,
the event waits, the ``record_stream`` calls (tensors handed across streams), the host waits on
an event and the calls into autograd's engine. The same script counts an older engine's calls
(``--tree`` of another checkout, e.g. ``git worktree add /tmp/before <commit>``), for a side by
side; every count is deterministic.

    python benchmarks/engine_primitives.py [--tree PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import sys
from collections import Counter
from pathlib import Path
from typing import Any

PRIMITIVES = ("events made", "events recorded", "stream switches", "event waits",
              "record_stream", "host waits", "autograd calls")


class _FakeEvent:
    def __init__(self, counts: Counter, *args: Any, **kwargs: Any) -> None:
        self.counts = counts
        counts["events made"] += 1

    def record(self, stream: Any = None) -> None:
        self.counts["events recorded"] += 1

    def synchronize(self) -> None:
        self.counts["host waits"] += 1

    def query(self) -> bool:
        return True


class _FakeStream:
    def __init__(self, counts: Counter, name: str) -> None:
        self.counts, self.name = counts, name

    def wait_event(self, event: Any) -> None:
        self.counts["event waits"] += 1


def count(rounds: int = 3) -> tuple[dict[str, float], int]:
    """Per node of a steady combined step: each primitive's count (module docstring)."""
    import torch

    import megapipe.overlap.combined as combined
    import megapipe.overlap.tape as tape_module
    from megapipe.models import GPTConfig, build_stage
    from megapipe.overlap import record_forward
    from megapipe.overlap.streams import Streams
    from megapipe.overlap.wgrad import WeightGradQueue

    try:  # CUDA's streams in their own module; an older --tree has them in streams.py
        import megapipe.overlap.cuda_streams as cuda_streams_module
    except ImportError:
        import megapipe.overlap.streams as cuda_streams_module
    CudaStream = cuda_streams_module.CudaStream

    counts: Counter = Counter()
    patches = contextlib.ExitStack()

    @contextlib.contextmanager
    def switch(stream: Any):
        counts["stream switches"] += 1
        yield

    def record_use(self: Any, values: Any) -> None:
        counts["record_stream"] += len(cuda_streams_module.tensors_in(values))

    real_backward = tape_module._run_backward

    def run_backward(*args: Any) -> Any:
        counts["autograd calls"] += 1
        return real_backward(*args)

    patches.enter_context(_patched(torch.cuda, "Event", lambda *a, **k: _FakeEvent(counts)))
    patches.enter_context(_patched(torch.cuda, "stream", switch))
    patches.enter_context(_patched(torch.cuda, "current_stream", lambda *a: fake_compute))
    patches.enter_context(_patched(CudaStream, "record_use", record_use))
    patches.enter_context(_patched(tape_module, "_run_backward", run_backward))
    fake_compute = _FakeStream(counts, "compute")
    device = torch.device("cpu")
    extra = {"current": True} if "current" in inspect.signature(CudaStream).parameters else {}
    streams = Streams(CudaStream("compute", device, stream=fake_compute, **extra),
                      CudaStream("comm", device, stream=_FakeStream(counts, "comm")))
    config = GPTConfig(vocab_size=32, hidden_size=16, num_layers=6, num_heads=2, seq_length=8,
                       ffn_hidden_size=32, num_experts=2, moe_top_k=1, moe_ffn_hidden_size=16,
                       first_k_dense_layers=0)
    stage = build_stage(config, 1, 3)  # a middle stage: two MoE layers, no embedding or head
    plans = stage.layer_plans()
    nodes = 0
    with patches:
        for r in range(rounds + 1):
            x_b = torch.randn(2, 8, 16, requires_grad=True)
            (out,), tape = record_forward(plans, (x_b,))
            x_f = torch.randn(2, 8, 16, requires_grad=True)
            if r == 1:  # the first round plans and makes the pools: not counted
                counts.clear()
            step = combined.CombinedStep(streams, combined.BackwardHalf(
                tape, (torch.ones_like(out),), wgrad=WeightGradQueue()))
            values = (x_f,)
            for plan in plans:
                values = step.run_layer(plan, values)
            step.finish()
            if r >= 1:
                nodes += sum(len(layer.nodes) for layer in tape.layers) * 2
    return {name: counts[name] / nodes for name in PRIMITIVES}, nodes


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any):
    had = name in vars(owner)
    old = getattr(owner, name, None)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if had:
            setattr(owner, name, old)
        else:
            delattr(owner, name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", default=None,
                        help="count the engine of another checkout (its repository root)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.tree:
        sys.path.insert(0, str(Path(args.tree).resolve()))
        for module in [m for m in sys.modules if m == "megapipe" or m.startswith("megapipe.")]:
            del sys.modules[module]
    per_node, nodes = count(args.rounds)
    import megapipe

    print(f"engine primitives per node of a combined step (CUDA path, counted on CPU; "
          f"{nodes} F+B nodes of two MoE layers beside two; {Path(megapipe.__file__).parent}):")
    for name, value in per_node.items():
        print(f"  {name:<16} {value:5.2f}")
    print("engine primitives per combined node: " +
          f"{sum(per_node[n] for n in PRIMITIVES if n != 'host waits'):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
