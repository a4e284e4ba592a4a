"""Count the kernel launches the host issues, on CPU, with a ``TorchDispatchMode``.

On a GPU each operator the host dispatches costs host time (about 15 us per op on the one H100
run, docs/gpu.md), so how many ops a layer's forward and backward issue is the number the host
pays for. This module counts them on CPU, where megapipe's code takes the same path as on CUDA
op for op (the device-specific parts are custom ops, below):

- **counted, 1 each**: every operator that runs a kernel on a GPU: arithmetic, reductions,
  GEMMs, copies and casts (``copy_``, ``clone``, ``_to_copy``), constructors that write
  (``zeros``, ``full``, ``arange``), in-place ops, collectives, and a device-to-host read
  (``_local_scalar_dense``);
- **counted, 1 each**: every custom op of megapipe (namespace ``megapipe``, made with
  ``torch.library.custom_op``): its CUDA implementation is one Triton kernel (a rule
  ``megapipe.kernels`` keeps and its tests check); the ops its CPU reference runs inside are
  not seen, as on a GPU;
- **not counted**: views and aliases (an op whose outputs all alias an input: ``view``,
  ``slice``, ``t``, ``transpose``, ``expand``, ``detach``, ``split``, ``unbind``... and
  ``_unsafe_view``), metadata (an op that returns no tensor, ``promote_types``), and
  constructors that allocate without writing (``empty``, ``empty_strided``, ``new_empty``,
  ``new_empty_strided``, ``empty_like``): none runs a kernel;
- a CUDA graph replay would count 1 and the ops captured in it 0 (megapipe has no graphs yet).

One op is one launch: a few torch ops launch more than one kernel on a GPU (``sort``, ``topk``
for large rows), and the host's cost per op is what this approximates. Engine primitives
(events, stream switches, ``record_stream``) are not ops and are not counted here.

``LaunchCounter`` also labels what it counts: ``with counter.label("attention F")`` names the
ops issued inside, and ``counter.adopt(outputs, label)`` names the autograd nodes that made
``outputs`` (walked back to leaves), so their backward is counted under ``label`` wherever it
runs (the plain tape or the combined step).
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ALLOCATE_ONLY = frozenset({"empty", "empty_strided", "new_empty", "new_empty_strided",
                           "empty_like"})
VIEW_LIKE = frozenset({"_unsafe_view", "_reshape_alias"})  # views their schema does not mark
HOST_READS = frozenset({"_local_scalar_dense"})
FUSED_NAMESPACE = "megapipe"
ENGINE = "engine"


def _returns_tensor(func: Any) -> bool:
    return any("Tensor" in str(r.type) for r in func._schema.returns)


def runs_kernel(func: Any) -> bool:
    """Whether the operator ``func`` launches a kernel on a GPU (the module's rule)."""
    name = func.overloadpacket.__name__
    if func.namespace == FUSED_NAMESPACE or name in HOST_READS:
        return True
    if name in ALLOCATE_ONLY or name in VIEW_LIKE or func.is_view:
        return False
    return _returns_tensor(func)


class LaunchCounter(TorchDispatchMode):
    """Per label, the ops that launch a kernel (``launches``) and those that do not
    (``free``: views, metadata, allocations), each a ``Counter`` of op names."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: dict[str, Counter] = {}
        self.free: dict[str, Counter] = {}
        self._label = ENGINE
        self._node_labels: dict[Any, str] = {}  # autograd node -> label of its forward
        self._keep: list[Any] = []  # keeps adopted autograd nodes alive (stable identity)

    @contextmanager
    def label(self, name: str) -> Iterator[None]:
        """Count the ops issued inside under ``name``."""
        old, self._label = self._label, name
        try:
            yield
        finally:
            self._label = old

    def adopt(self, outputs: Sequence[Any], name: str) -> None:
        """Count the backward of the autograd graph behind ``outputs`` under ``name`` (walked
        from their ``grad_fn`` back to the leaves or to nodes already adopted)."""
        stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in self._node_labels:
                continue
            if type(node).__name__ == "AccumulateGrad":
                continue
            self._node_labels[node] = name
            self._keep.append(node)
            stack.extend(fn for fn, _ in node.next_functions)

    def total(self, labels: Sequence[str] | None = None) -> int:
        """Launches under ``labels`` (all labels when None)."""
        keys = self.launches if labels is None else labels
        return sum(sum(self.launches.get(k, Counter()).values()) for k in keys)

    def _current(self) -> str:
        node = torch._C._current_autograd_node()
        if node is not None:
            return self._node_labels.get(node, f"{ENGINE} B")
        return self._label

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        bucket = self.launches if runs_kernel(func) else self.free
        bucket.setdefault(self._current(), Counter())[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def count_launches(fn: Any, *args: Any, **kwargs: Any) -> tuple[int, LaunchCounter]:
    """Run ``fn(*args, **kwargs)`` under a new counter; (its launches, the counter)."""
    with LaunchCounter() as counter:
        fn(*args, **kwargs)
    return counter.total(), counter


def histogram(counter: LaunchCounter, label: str, top: int = 12) -> str:
    """One line: ``label``'s launches, its most frequent ops, and its free ops' count."""
    ops = counter.launches.get(label, Counter())
    free = sum(counter.free.get(label, Counter()).values())
    common = ", ".join(f"{name} {n}" for name, n in ops.most_common(top))
    rest = sum(ops.values()) - sum(n for _, n in ops.most_common(top))
    more = f", ... {rest}" if rest else ""
    return f"{label:<22} {sum(ops.values()):4d} ({common}{more}); free {free}"


# --- one MoE layer of the reference GPT, forward + backward, three ways ---------------------

def demo_layer(**overrides: Any) -> Any:
    """The default demo's MoE layer (``megapipe pretrain``'s sizes: hidden 96, 4 heads, 4
    experts top-2 of width 96, sequence 64, both auxiliary losses), alone in a stage."""
    from megapipe.models.config import GPTConfig
    from megapipe.models.gpt import GPTStage

    sizes = dict(hidden_size=96, num_heads=4, ffn_hidden_size=192, seq_length=64,
                 num_experts=4, moe_top_k=2, moe_ffn_hidden_size=96, num_layers=1,
                 first_k_dense_layers=0, seed=1234)
    sizes.update(overrides)
    return GPTStage(GPTConfig(**sizes), [0], is_first=False, is_last=False)


def labelled_plans(counter: LaunchCounter, plans: Sequence[Any]) -> list[list[Any]]:
    """``plans`` whose nodes count their forward under ``<node> F`` and their backward under
    ``<node> B`` (the same node functions, wrapped)."""
    from dataclasses import replace

    from megapipe.overlap.plan import Fork

    def wrap(node: Any) -> Any:
        if isinstance(node, Fork):
            return Fork(tuple(tuple(wrap(n) for n in b) for b in node.branches), node.width)
        short = node.name.split(".")[-1]

        def fn(state: Any, inputs: Any) -> Any:
            with counter.label(f"{short} F"):
                outputs = node.fn(state, inputs)
            counter.adopt(outputs, f"{short} B")
            return outputs

        return replace(node, fn=fn)

    return [plan.wrapped(lambda nodes: [wrap(node) for node in nodes]) for plan in plans]


def _inputs(stage: Any, microbatch: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    c = stage.config
    g = torch.Generator().manual_seed(len(c.__repr__()))
    x = torch.randn(microbatch, c.seq_length, c.hidden_size, generator=g).requires_grad_()
    return x, torch.randn(microbatch, c.seq_length, c.hidden_size, generator=g)


def naive(counter: LaunchCounter, stage: Any) -> None:
    """The layer as ordinary module code: forward by ``run_nodes``, then ``autograd.backward``."""
    from megapipe.overlap.plan import run_nodes

    x, grad = _inputs(stage)
    with counter:
        values = (x,)
        for plan in labelled_plans(counter, stage.layer_plans()):
            values = run_nodes(plan, values)
        torch.autograd.backward(values[0], grad)


def plain(counter: LaunchCounter, stage: Any) -> None:
    """megapipe's plain path: the tape's forward, then its backward node by node."""
    from megapipe.overlap.sequential import record_forward, run_backward

    x, grad = _inputs(stage)
    with counter:
        outputs, tape = record_forward(labelled_plans(counter, stage.layer_plans()), (x,))
        run_backward(tape, [grad])


def combined(counter: LaunchCounter, stage: Any) -> None:
    """The combined step: the layer's forward of one microbatch beside its backward of another
    (recorded before, not counted), both streams on this thread (as a GPU host issues them)."""
    from megapipe.overlap.combined import combined_step
    from megapipe.overlap.sequential import record_forward
    from megapipe.overlap.streams import InlineStream, Streams

    y, grad = _inputs(stage)
    plans = labelled_plans(counter, stage.layer_plans())
    _, tape = record_forward(plans, (y,))
    x, _ = _inputs(stage)
    streams = Streams(InlineStream("compute"), InlineStream("comm"))
    with counter:
        combined_step(plans, (x,), tape, [grad], streams)


WAYS = {"naive": naive, "plain": plain, "combined": combined}


def moe_layer_launches(stage: Any | None = None) -> dict[str, LaunchCounter]:
    """Per way (naive, plain, combined), the counter of one MoE layer's forward + backward."""
    stage = demo_layer() if stage is None else stage
    torch.manual_seed(0)
    counters = {}
    for way, run in WAYS.items():
        counters[way] = LaunchCounter()
        run(counters[way], stage)
        stage.zero_grad(set_to_none=True)
    return counters


RANK_CAPACITY = 2.0  # the rank capacity factor of the count outside graphs (never overflows)


def launches_outside_graphs(stage: Any | None = None) -> tuple[int, tuple[str, ...]]:
    """Launches one MoE layer's combined step (F of one microbatch beside B of another) issues
    outside CUDA graphs with ``--moe-expert-rank-capacity-factor`` (the demo's layer, ep 1):
    every launch of a node that is not graphable today, plus one replay each way per graphable
    node (the static nodes ``graphs.nodes`` captures). Returns (the count, the graphable
    nodes' names)."""
    from megapipe.overlap.plan import layer_graph

    stage = demo_layer(moe_expert_rank_capacity_factor=RANK_CAPACITY) if stage is None else stage
    counter = moe_layer_launches(stage)["combined"]
    graphed = tuple(node.name.split(".")[-1] for plan in stage.layer_plans()
                    for node in layer_graph(plan).nodes if node.graphable is not None)
    eager = sum(sum(ops.values()) for label, ops in counter.launches.items()
                if label.split()[0] not in graphed)
    return eager + 2 * len(graphed), graphed


HOST_WAYS = ("naive", "interleaved", "plain", "combined")
HOST_ROUNDS, HOST_PROCESSES = 200, 5  # per process; processes per way


def host_time(way: str, rounds: int = HOST_ROUNDS) -> float:
    """The host's CPU time (this thread), in ms, of one MoE layer's forward + backward done
    ``way``, in this process: median of ``rounds`` after 20 warm-up rounds, each round as a
    training step runs it (the layer's auxiliary-loss log popped, gradients dropped). The ways
    are the count's three (both streams on this thread, as a GPU host issues them, without the
    counter) and ``interleaved``: the combined step's work (the forward of one microbatch, the
    backward of another recorded before it) by plain autograd, which has the combined step's
    working set of two microbatches without its engine."""
    import statistics
    import time

    from megapipe.overlap.combined import combined_step
    from megapipe.overlap.plan import run_nodes
    from megapipe.overlap.sequential import record_forward, run_backward
    from megapipe.overlap.streams import InlineStream, Streams

    if way not in HOST_WAYS:
        raise ValueError(f"way must be one of {', '.join(HOST_WAYS)}, got {way!r}")
    stage = demo_layer()
    plans = stage.layer_plans()
    streams = Streams(InlineStream("compute"), InlineStream("comm"))

    def forward(x: torch.Tensor) -> torch.Tensor:  # eager, node by node
        values = (x,)
        for plan in plans:
            values = run_nodes(plan, values)
        return values[0]

    def naive() -> float:
        x, grad = _inputs(stage)
        start = time.thread_time()
        torch.autograd.backward(forward(x), grad)
        return time.thread_time() - start

    def interleaved() -> float:
        y, grad = _inputs(stage)
        out = forward(y)
        x, _ = _inputs(stage)
        start = time.thread_time()
        forward(x)
        torch.autograd.backward(out, grad)
        return time.thread_time() - start

    def plain() -> float:
        x, grad = _inputs(stage)
        start = time.thread_time()
        _, tape = record_forward(plans, (x,))
        run_backward(tape, [grad])
        return time.thread_time() - start

    def combined() -> float:
        y, grad = _inputs(stage)
        _, tape = record_forward(plans, (y,))
        x, _ = _inputs(stage)
        start = time.thread_time()
        combined_step(plans, (x,), tape, [grad], streams)
        return time.thread_time() - start

    run = {"naive": naive, "interleaved": interleaved, "plain": plain,
           "combined": combined}[way]
    samples = []
    for r in range(rounds + 20):
        seconds = run()
        stage.zero_grad(set_to_none=True)
        for layer in stage.moe_layers():  # as a training step does (its log would grow)
            layer.aux_loss_log.pop_all()
        if r >= 20:
            samples.append(seconds)
    return statistics.median(samples) * 1e3


def host_times(rounds: int = HOST_ROUNDS, processes: int = HOST_PROCESSES
               ) -> dict[str, float]:
    """Per way (``HOST_WAYS``), ``host_time`` in a process of its own, as a training job runs
    one way over and over: the processes start one at a time, the ways in turn, ``processes``
    times over; the median of their medians, in ms. Ways timed side by side in one process
    disturb each other: each leaves the allocator and the caches to the next in its own state,
    which moved the combined step's time by up to 0.2x between runs of one script here."""
    import os
    import statistics
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1")
    samples: dict[str, list[float]] = {way: [] for way in HOST_WAYS}
    for _ in range(processes):
        for way in HOST_WAYS:
            done = subprocess.run(
                [sys.executable, __file__, "--host-time", way, "--rounds", str(rounds)],
                capture_output=True, text=True, env=env)
            if done.returncode != 0:
                raise RuntimeError(f"host_time({way!r}) failed: {done.stderr.strip()[-2000:]}")
            samples[way].append(float(done.stdout.split()[-1]))
    return {way: statistics.median(values) for way, values in samples.items()}


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="one way's host time (host_time), in ms")
    parser.add_argument("--host-time", choices=HOST_WAYS, required=True)
    parser.add_argument("--rounds", type=int, default=HOST_ROUNDS)
    a = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{host_time(a.host_time, a.rounds):.4f}")
