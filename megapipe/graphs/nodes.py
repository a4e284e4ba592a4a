"""CUDA graphs for static nodes (Megatron's ``--cuda-graph-impl local``), in megapipe's node split.

On one GPU the host, not the GPU, sets the pace of a small MoE layer: each compute node issues
dozens of kernels. A *static* compute node (same shapes every microbatch, no host read) can
instead be captured once into a CUDA graph and replayed with one launch. ``NodeGraphs.plan(plan)``
wraps such nodes of a layer plan the way ``full_recompute.recompute_plan`` wraps compute nodes;
the engine runs the wrapped plan unchanged (plain autograd, the tape, the combined step).

**What is captured.** A node declares what it holds with ``Node.graphable`` (``Graphable``:
Megatron's module names, its parameters, the hidden inputs its code reads, the logs it writes);
a node is captured when every module it holds is in ``--cuda-graph-modules``. The reference
GPT's MoE attention node holds ``attn``, ``moe_router`` and ``moe_preprocess`` (the
permutation into expert order); a dense layer's node holds ``attn`` and ``mlp``; a MoE layer's
experts and finish nodes ``moe`` (``Graphable.eager()`` keeps them eager, naming why, unless a
rank capacity makes their shapes static). Comm nodes and nodes that read the host
(``Node.reads_host``) are never captured.

**Capture and replay.** Per node and input signature (shapes, strides, dtypes, requires-grad,
``Graphable.key()``) an *instance* is captured on first use: static input buffers, one warm-up
run on a side stream, a forward graph, then a backward graph (``autograd.grad`` of the static
outputs, in the same private memory pool). An instance is busy from its forward replay until
its backward replayed (or the forward's autograd record is dropped without one), and while a
tensor outside it still views an output or state tensor it handed out, so a pipeline's
microbatches in flight each get their own instance, as Megatron's runners do. A
replay copies the inputs into the static buffers and launches the graph on the current stream
(whichever stream the combined step issues the node on); the backward copies the output
gradients in, replays, and returns the static input gradients. A parameter's gradient is added
into its ``main_grad`` inside the backward graph when eager code moves it there (a bf16 run's
fp32 main gradients, the data-parallel buffers), else returned for autograd to accumulate into
``.grad``: same values, same order, so bitwise the eager run under deterministic kernels. An
input that is another instance's static output (the rows, probabilities and routing indices a
MoE layer's attention node hands to its experts and finish nodes) is read in place, and its
gradient written into that instance's static gradient buffer inside the backward graph
(``graphs.instance``): between two captured nodes nothing is copied outside the graphs.

**Layer state.** While captured, a node sees a recording ``LayerState``: what it writes (routing
indices, split sizes) is replayed onto the real state (tensors are the instance's static
buffers, valid while it is busy); a plain value it reads becomes a guard of the instance; a
tensor it reads becomes a static buffer, filled from the state before each replay (one that
needs a gradient is refused: those come through the inputs). Its weight-gradient queue reads
None: a captured node computes its weight gradients inside its backward graph. Tensors it records
in ``Graphable.logs`` (the MoE auxiliary-loss log) are recorded again, copied, at each replay.
A replay runs no Python of the node (no module hook): what must happen per replay runs in the
wrapper, outside the graph (``NodeGraphs.before_replay``: the parameter all-gather waits;
``NodeGraphs.after_backward``: the data-parallel bucket counts).
The mechanics of one node's instances: ``graphs.capture``; the flags' rules:
``graphs.rules``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from megapipe.graphs.capture import CapturedNode, GraphStats
from megapipe.graphs.rules import selected, settings_problem
from megapipe.overlap.plan import Fork, Node, NodeKind, Plan, run_nodes


@dataclass(frozen=True, eq=False)
class Graphable:
    """What a node declares so it can be captured: the Megatron ``modules`` it holds, the
    ``params`` it reads (their gradients come out of its backward graph), ``key()``: the
    hidden inputs its code reads besides its tensors and the layer state (an instance is
    captured per value: the MoE auxiliary-loss scale), ``logs``: ``(owner, attribute)`` of
    each log it records into (``owner.attribute.record(value)``; the MoE layer's
    ``aux_loss_log``): while it is captured it records into a fresh log of the same type, whose
    ``pop_all()`` gives the tensors each replay records again, copied; ``buffers``: the other
    tensors it reads in place (rotary tables), which must stay where they are; ``eager()``: why
    the node must run eager now (its shapes are not static: a dropless MoE layer's experts),
    None when it may be captured."""

    modules: tuple[str, ...]
    params: tuple[torch.Tensor, ...]
    key: Callable[[], Hashable] | None = None
    logs: tuple[tuple[Any, str], ...] = ()
    buffers: tuple[torch.Tensor, ...] = ()
    eager: Callable[[], str | None] | None = None


class GraphApi:
    """The ``torch.cuda`` calls of capture and replay, in one place: a stand-in that records
    the captured operations and replays only them runs the capture logic on CPU (tests)."""

    def __init__(self, device: torch.device, check_input_liveness: bool = False) -> None:
        """``check_input_liveness``: torch's capture check (torch 2.13's ``capture_begin``
        option) that every tensor a graph reads from outside its pool still lives at each
        replay (a debugging aid, on in the GPU tests; it tracks each capture's inputs)."""
        self.device = device
        self.check_input_liveness = check_input_liveness
        self._side: torch.cuda.Stream | None = None

    def _stream(self) -> torch.cuda.Stream:
        if self._side is None:
            self._side = torch.cuda.Stream(device=self.device)
        return self._side

    def warm(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` eagerly on a side stream, after the current stream's work."""
        side, current = self._stream(), torch.cuda.current_stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            fn()
        current.wait_stream(side)

    def capture(
        self, fn: Callable[[], Any], pool: Any, mode: str, static: Sequence[torch.Tensor] = ()
    ) -> tuple[Any, Any]:
        """A graph of ``fn``'s kernels, captured on the side stream into ``pool`` (None: a new
        one), and what ``fn`` returned (tensors in the pool, written by each replay).
        ``static``: the tensors outside the pool the graph reads in place (static inputs,
        parameters); CUDA needs no list (a replay reads their addresses), the CPU stand-in
        refuses any other memory."""
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)
        with torch.cuda.stream(self._stream()):
            checked = {"check_input_liveness": True} if self.check_input_liveness else {}
            graph.capture_begin(pool=pool, capture_error_mode=mode, **checked)
            try:
                result = fn()
            finally:
                graph.capture_end()
        return graph, result

    def pool(self, graph: Any) -> Any:
        return graph.pool()

    def replay(self, graph: Any) -> None:
        """Launch ``graph`` on the current stream."""
        graph.replay()

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)


class NodeGraphs:
    """One executor's CUDA graphs: the modules captured, the graph calls (``GraphApi``, or a
    stand-in), every captured node's instances; ``captured`` and ``bytes`` (private pools and
    static buffers) count them; ``before_replay``: what runs before each forward replay."""

    def __init__(self, modules: Iterable[str], api: Any) -> None:
        self.modules = selected(modules)
        self.api = api
        self.stats = GraphStats(api)
        # called with a captured node's parameters before each forward replay, outside its
        # graph: what module hooks do in eager (the parameter all-gather waits), which a
        # replay runs no Python for
        self.before_replay: list[Callable[[tuple[torch.Tensor, ...]], None]] = []
        # called after each backward replay with each parameter its graph added into its
        # main_grad: what its post-accumulate hooks do in eager besides that (the
        # data-parallel bucket counts), which a replay runs no Python for
        self.after_backward: list[Callable[[torch.Tensor], None]] = []
        self._nodes: dict[int, tuple[Node, CapturedNode]] = {}
        self._plans: dict[int, tuple[Any, Any]] = {}

    def covers(self, node: Node) -> bool:
        """Whether ``node`` is captured: it declares what it holds and all of it is selected."""
        spec = node.graphable
        return spec is not None and set(spec.modules) <= self.modules

    def node(self, node: Node, layer: int = 0) -> Node:
        """``node``, captured when ``covers`` says so (comm and host-reading nodes: refused);
        ``layer``: its plan's key (a node reads in place what its layer's nodes made)."""
        if not self.covers(node):
            return node
        if node.kind != NodeKind.COMPUTE or node.reads_host:
            raise ValueError(
                f"node {node.name!r} declares CUDA-graph modules but is a comm node "
                "or reads the host: it can never be captured"
            )
        held = self._nodes.get(id(node))
        if held is None:  # one set of instances per node of a plan made once
            held = self._nodes[id(node)] = (
                node,
                CapturedNode(
                    node, node.graphable, self.stats, self.before_replay, self.after_backward, layer
                ),
            )
        return replace(node, fn=held[1])

    def plan(self, plan: Sequence[Any]) -> Any:
        """``plan`` with its captured nodes wrapped, once (a ``WavePlan`` stays one, its
        wave forms wrapped too). Only a ``Plan`` (made once, as ``GPTStage`` makes them)
        is captured: a list made anew per call runs eager (its nodes would be captured anew)."""
        if not isinstance(plan, Plan):
            return plan
        kept = self._plans.get(id(plan))
        if kept is not None:
            return kept[1]
        if not any(self.covers(node) for node in plan.graph.nodes):
            return plan  # nothing to capture (not kept: a plan made per call stays uncounted)

        def wrap(items: Sequence[Any]) -> list[Any]:
            return [
                Fork(
                    tuple(tuple(self.node(n, id(plan)) for n in b) for b in item.branches),
                    item.width,
                )
                if isinstance(item, Fork)
                else self.node(item, id(plan))
                for item in items
            ]

        wrapped = plan.wrapped(wrap)
        self._plans[id(plan)] = (plan, wrapped)  # the plan kept: its id stays its own
        return wrapped

    def runner(self, inner: Any = None) -> GraphRunner:
        """A node runner that runs each plan's captured form through ``inner`` (None: plain
        autograd, ``run_nodes``)."""
        return GraphRunner(self, inner)

    @property
    def captured(self) -> int:
        """Instances captured so far."""
        return self.stats.captured

    @property
    def bytes(self) -> int:
        """Their private pools' reserved bytes and static buffers."""
        return self.stats.bytes

    def describe(self) -> str:
        eager = "".join(f"; {node} eager: {why}" for node, why in sorted(self.stats.eager.items()))
        return (
            f"{self.captured} graph instances captured, {self.bytes / 2**20:.1f} MiB in "
            f"their pools and static buffers{eager}"
        )


class GraphRunner:
    """A ``NodeRunner`` running the captured form of each plan (``NodeGraphs.plan``) through
    another runner (the tape, a combined step) or with plain autograd; ``tape``: the inner's."""

    def __init__(self, graphs: NodeGraphs, inner: Any = None) -> None:
        self.graphs, self.inner = graphs, inner

    @property
    def tape(self) -> Any:
        return getattr(self.inner, "tape", None)

    def run_layer(self, plan: Sequence[Any], inputs: tuple) -> tuple:
        plan = self.graphs.plan(plan)
        return run_nodes(plan, inputs) if self.inner is None else self.inner.run_layer(plan, inputs)


def node_graphs(
    impl: str, modules: Sequence[str], device: torch.device | None, api: Any = None
) -> tuple[NodeGraphs | None, str | None]:
    """The executor's graphs for ``--cuda-graph-impl`` / ``--cuda-graph-modules`` (ValueError
    for bad settings) and a line to log: off without CUDA (graphs need CUDA; the nodes run
    eager), unless a stand-in ``api`` is given."""
    problem = settings_problem(impl, tuple(modules))
    if problem is not None:
        raise ValueError(problem)
    if impl == "none":
        return None, None
    names = " ".join(modules)
    if api is None and (device is None or device.type != "cuda"):
        where = "cpu" if device is None else device.type
        return None, (
            f"--cuda-graph-impl local ({names}): CUDA graphs need CUDA; this run is "
            f"on {where}, so every node runs eager"
        )
    if api is None:
        assert device is not None  # a CUDA device (without one, returned above)
        api = GraphApi(device)
    graphs = NodeGraphs(modules, api)
    return graphs, f"CUDA graphs: local, modules {' '.join(sorted(graphs.modules))}"
