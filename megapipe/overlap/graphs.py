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
permutation into expert order); a dense layer's node holds ``attn`` and ``mlp``. Comm nodes and
nodes that read the host (``Node.reads_host``) are never captured.

**Capture and replay.** Per node and input signature (shapes, strides, dtypes, requires-grad,
``Graphable.key()``) an *instance* is captured on first use: static input buffers, one warm-up
run on a side stream, a forward graph, then a backward graph (``autograd.grad`` of the static
outputs, in the same private memory pool). An instance is busy from its forward replay until
the autograd record of that forward is released (its backward ran, or it was dropped), so a
pipeline's microbatches in flight each get their own instance, as Megatron's runners do. A
replay copies the inputs into the static buffers and launches the graph on the current stream
(whichever stream the combined step issues the node on); the backward copies the output
gradients in, replays, and returns the static input and parameter gradients, which autograd
accumulates as it would eager ones (``.grad``, or ``main_grad`` through its hook): same values,
same order, so bitwise the eager run under deterministic kernels.

**Layer state.** While captured, a node sees a recording ``LayerState``: what it writes (routing
indices, split sizes) is replayed onto the real state (tensors are the instance's static
buffers, valid while it is busy); a plain value it reads becomes a guard of the instance; a
tensor it reads from the state, or the deferred weight-gradient queue, is refused (a captured
node takes tensors through its inputs; deferred GEMMs stay outside graphs). Tensors it records
in ``Graphable.logs`` (the MoE auxiliary-loss log) are recorded again, copied, at each replay.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Hashable, Iterable, Sequence

import torch

from megapipe.overlap.graph_rules import selected, settings_problem
from megapipe.overlap.plan import (
    ChunkedPlan, Fork, LayerState, Node, NodeKind, Plan, run_nodes,
)

WARMUP_RUNS = 1  # eager forward + backward runs before a capture (lazy kernel initialisation)


@dataclass(frozen=True, eq=False)
class Graphable:
    """What a node declares so it can be captured: the Megatron ``modules`` it holds, the
    ``params`` it reads (their gradients come out of its backward graph), ``key()``: the
    hidden inputs its code reads besides its tensors and the layer state (an instance is
    captured per value: the MoE auxiliary-loss scale), ``logs``: objects it records tensors
    into (``record``, ``pop_all``, ``len``: the MoE ``AuxLossLog``)."""

    modules: tuple[str, ...]
    params: tuple[torch.Tensor, ...]
    key: Callable[[], Hashable] | None = None
    logs: tuple[Any, ...] = ()


class GraphApi:
    """The ``torch.cuda`` calls of capture and replay, in one place: a stand-in that records
    and re-runs the captured functions runs the capture logic on CPU (tests)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._side: torch.cuda.Stream | None = None

    def _stream(self) -> "torch.cuda.Stream":
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

    def capture(self, fn: Callable[[], Any], pool: Any, mode: str) -> tuple[Any, Any]:
        """A graph of ``fn``'s kernels, captured on the side stream into ``pool`` (None: a new
        one), and what ``fn`` returned (tensors in the pool, written by each replay)."""
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)
        with torch.cuda.stream(self._stream()):
            graph.capture_begin(pool=pool, capture_error_mode=mode)
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


def _signature(inputs: Sequence[Any]) -> tuple:
    return tuple((tuple(x.shape), x.stride(), x.dtype, x.requires_grad)
                 if isinstance(x, torch.Tensor) else ("value", x) for x in inputs)


def _tensors(values: Any, what: str) -> tuple[torch.Tensor, ...]:
    values = tuple(values)
    for v in values:
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"a captured node's {what} must be tensors, got {type(v).__name__}")
    return values


def _bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class _Recorder(LayerState):
    """The layer state a node sees while it is captured: writes kept, reads recorded."""

    def __init__(self, base: LayerState) -> None:
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_writes", {})
        object.__setattr__(self, "_reads", {})

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("_"):
            return object.__getattribute__(self, name)
        writes = object.__getattribute__(self, "_writes")
        if name in writes:
            return writes[name]
        value = getattr(object.__getattribute__(self, "_base"), name)
        object.__getattribute__(self, "_reads")[name] = value
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        self._writes[name] = value


class _Instance:
    """One captured copy of a node: its graphs, static buffers, state writes and guards."""

    def __init__(self, api: Any) -> None:
        self.api = api
        self.lease: _Lease | None = None  # busy while a forward awaits its backward
        self.guards: dict[str, Any] = {}
        self.inputs: tuple[torch.Tensor, ...] = ()
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.writes: dict[str, Any] = {}
        self.logged: list[list[torch.Tensor]] = []
        self.grad_outputs: list[torch.Tensor | None] = []
        self.grad_inputs: tuple[torch.Tensor | None, ...] = ()
        self.fwd: Any = None
        self.bwd: Any = None
        self.bytes = 0
        self.handed: tuple[torch.Tensor, ...] = ()
        self.counts: tuple[int, ...] = ()
        self.moved: tuple[bool, ...] = ()  # per input: a parameter whose hook takes its .grad

    def fits(self, state: LayerState) -> bool:
        """Free (no forward whose autograd record lives, no tensor outside viewing what it
        handed out: a deferred weight gradient may keep an output) and its guards hold."""
        return self.lease is None and all(getattr(state, name, _MISSING) == value
                                     for name, value in self.guards.items()) and all(
            _views(t) <= count for t, count in zip(self.handed, self.counts))

    def returned(self) -> tuple[torch.Tensor | None, ...]:
        return tuple(g.detach() if g is not None and moved else g
                     for g, moved in zip(self.grad_inputs, self.moved))

    def hand_out(self) -> None:
        """Count the views of what replays hand out (outputs, state tensors) at rest."""
        seen: dict[int, torch.Tensor] = {}
        for t in self.outputs + tuple(v for v in self.writes.values()
                                      if isinstance(v, torch.Tensor)):
            seen.setdefault(t.untyped_storage().data_ptr(), t)
        self.handed = tuple(seen.values())
        self.counts = tuple(_views(t) for t in self.handed)


def _moves_grad(param: torch.Tensor) -> bool:
    """Whether autograd's gradient of ``param`` goes straight into its ``main_grad`` (a
    post-accumulate hook of ``main_grad.attach_main_grads`` or the flat gradient buffers, which
    leave ``.grad`` None), so a buffer handed to it is never kept."""
    return getattr(param, "main_grad", None) is not None and bool(
        getattr(param, "_post_accumulate_grad_hooks", None))


def _views(tensor: torch.Tensor) -> int:
    """How many tensors view ``tensor``'s storage (plus one: the storage object asked)."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


_MISSING = object()


class _Lease:
    """Holds an instance busy from one forward replay until its backward replayed (or the
    autograd record of that forward is dropped without one)."""

    __slots__ = ("instance", "backward_done")

    def __init__(self, instance: _Instance) -> None:
        instance.lease = self
        self.instance = instance
        self.backward_done = False

    def release(self) -> None:
        if self.instance.lease is self:
            self.instance.lease = None

    def __del__(self) -> None:
        self.release()


class _Replay(torch.autograd.Function):
    """Forward: copy the inputs in, replay, apply the state writes. Backward: copy the output
    gradients in, replay, hand out the static input and parameter gradients."""

    @staticmethod
    def forward(ctx, lease: _Lease, state: LayerState, logs: tuple,  # type: ignore[override]
                num_inputs: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        instance = lease.instance
        for static, x in zip(instance.inputs, tensors[:num_inputs]):
            static.copy_(x)
        instance.api.replay(instance.fwd)
        for name, value in instance.writes.items():
            setattr(state, name, value)
        for log, values in zip(logs, instance.logged):
            for value in values:
                log.record(value.clone())  # the buffer is written again by the next replay
        ctx.lease = lease
        ctx.set_materialize_grads(False)
        outputs = tuple(o.detach() for o in instance.outputs)
        ctx.mark_non_differentiable(*(o for o, s in zip(outputs, instance.outputs)
                                      if not s.requires_grad))
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: torch.Tensor | None):  # type: ignore[override]
        lease: _Lease = ctx.lease
        instance = lease.instance
        if lease.backward_done:
            raise RuntimeError("a captured node's backward ran twice on one forward (the "
                               "generic I/W split of a plain zero-bubble schedule); its graph "
                               "may have reused its saved activations: run such schedules with "
                               "the overlap, or without CUDA graphs")
        lease.backward_done = True
        for static, grad in zip(instance.grad_outputs, grads):
            if static is None:
                continue
            if grad is None:
                raise RuntimeError("a captured node's output got no gradient, but its graph was "
                                   "captured with one for every output that requires grad")
            static.copy_(grad)
        instance.api.replay(instance.bwd)
        lease.release()  # its saved activations are spent (a second backward is refused)
        # not detached, autograd copies them into .grad (or adds), never keeping the buffer;
        # detached, it hands the buffer itself to a parameter whose hook moves it into
        # main_grad at once (what eager does with its own tensor: no copy)
        return (None, None, None, None, *instance.returned())


class _CapturedNode:
    """A node's instances by input signature, capture on first use (module docstring)."""

    def __init__(self, node: Node, spec: Graphable, graphs: "NodeGraphs") -> None:
        self.node, self.spec, self.graphs = node, spec, graphs
        self.instances: dict[tuple, list[_Instance]] = {}
        self.pointers = tuple(p.data_ptr() for p in spec.params)

    def __call__(self, state: LayerState, inputs: tuple) -> tuple[torch.Tensor, ...]:
        inputs = _tensors(inputs, "inputs")
        spec = self.spec
        if not torch.is_grad_enabled() or not any(
                t.requires_grad for t in inputs + spec.params):  # nothing to save: eager
            return tuple(self.node.fn(state, inputs))
        if tuple(p.data_ptr() for p in spec.params) != self.pointers:
            raise RuntimeError(f"node {self.node.name!r}: a parameter's storage moved since its "
                               "graphs were captured (they would read the old memory)")
        key = (_signature(inputs), spec.key() if spec.key is not None else None)
        found = self.instances.setdefault(key, [])
        instance = next((i for i in found if i.fits(state)), None)
        if instance is None:
            instance = self._capture(state, inputs)
            found.append(instance)
        return _Replay.apply(_Lease(instance), state, spec.logs, len(inputs), *inputs,
                             *spec.params)

    def _capture(self, state: LayerState, inputs: tuple[torch.Tensor, ...]) -> _Instance:
        api, node, spec = self.graphs.api, self.node, self.spec
        instance = _Instance(api)
        with torch.no_grad():
            instance.inputs = tuple(torch.empty_strided(x.shape, x.stride(), dtype=x.dtype,
                                                        device=x.device).copy_(x)
                                    for x in inputs)
        for static, x in zip(instance.inputs, inputs):
            static.requires_grad_(x.requires_grad)
        wanted = [t for t in instance.inputs + spec.params if t.requires_grad]
        live: dict[str, Any] = {}
        recorder = _Recorder(state)

        def forward_region() -> tuple[torch.Tensor, ...]:
            counts = [len(log) for log in spec.logs]
            object.__setattr__(recorder, "_writes", {})
            outputs = _tensors(node.fn(recorder, instance.inputs), "outputs")
            live["outputs"] = outputs
            logged = []
            for log, count in zip(spec.logs, counts):
                values = log.pop_all()
                for value in values[:count]:
                    log.record(value)
                logged.append(values[count:])
            live["logged"] = logged
            written = tuple(v for v in recorder._writes.values() if isinstance(v, torch.Tensor))
            return outputs + written + tuple(v for values in logged for v in values)

        def backward_region() -> tuple[torch.Tensor | None, ...]:
            roots = [o for o in live["outputs"] if o.requires_grad]
            grads = [g for g in instance.grad_outputs if g is not None]
            if not roots or not wanted:
                return ()
            return torch.autograd.grad(roots, wanted, grads, allow_unused=True)

        def warm() -> None:
            forward_region()
            roots = [o for o in live["outputs"] if o.requires_grad]
            if roots and wanted:
                torch.autograd.grad(roots, wanted, [torch.ones_like(o) for o in roots],
                                    allow_unused=True)
            live.clear()

        with torch.enable_grad():
            for _ in range(WARMUP_RUNS):
                api.warm(warm)
            before = api.reserved()
            instance.fwd, _ = api.capture(forward_region, None, "thread_local")
            instance.outputs = live["outputs"]
            self._check_leaves(instance.outputs, wanted)
            instance.logged = live["logged"]
            instance.grad_outputs = [torch.empty_like(o) if o.requires_grad else None
                                     for o in instance.outputs]
            instance.bwd, found = api.capture(backward_region, api.pool(instance.fwd), "global")
        self._check_state(recorder)
        instance.writes = dict(recorder._writes)
        instance.guards = dict(recorder._reads)
        live.clear()
        instance.hand_out()
        found = iter(found)
        instance.grad_inputs = tuple(next(found) if t.requires_grad else None
                                     for t in instance.inputs + spec.params)
        instance.moved = (False,) * len(inputs) + tuple(_moves_grad(p) for p in spec.params)
        instance.bytes = (api.reserved() - before + _bytes(instance.inputs)
                          + _bytes(instance.grad_outputs))
        self.graphs.captured += 1
        self.graphs.bytes += instance.bytes
        return instance

    def _check_leaves(self, outputs: Sequence[torch.Tensor], wanted: list[torch.Tensor]) -> None:
        """Every tensor the captured outputs' gradients reach is an input or a declared
        parameter (else its gradient would be lost: refused)."""
        known = {id(t) for t in wanted}
        seen, todo = set(), [o.grad_fn for o in outputs if o.grad_fn is not None]
        while todo:
            fn = todo.pop()
            if fn in seen:
                continue
            seen.add(fn)
            leaf = getattr(fn, "variable", None)
            if leaf is not None and id(leaf) not in known:
                raise RuntimeError(f"node {self.node.name!r} cannot be captured: it uses a "
                                   f"tensor of shape {tuple(leaf.shape)} that needs a gradient "
                                   "but is neither its input nor in Graphable.params")
            todo.extend(f for f, _ in fn.next_functions if f is not None)

    def _check_state(self, recorder: _Recorder) -> None:
        for name, value in recorder._reads.items():
            if name == "wgrad_queue" or isinstance(value, torch.Tensor):
                what = ("defers weight gradients (reads state.wgrad_queue); deferred GEMMs run "
                        "outside graphs" if name == "wgrad_queue" else
                        f"reads state.{name}, a tensor made outside it; a captured node takes "
                        "its tensors through its inputs")
                raise RuntimeError(f"node {self.node.name!r} cannot be captured: it {what}")


class NodeGraphs:
    """One executor's CUDA graphs: the modules captured, the graph calls (``GraphApi``, or a
    stand-in), every captured node's instances; ``captured`` and ``bytes`` (private pools and
    static buffers) count them."""

    def __init__(self, modules: Iterable[str], api: Any) -> None:
        self.modules = selected(modules)
        self.api = api
        self.captured = 0
        self.bytes = 0
        self._nodes: dict[int, tuple[Node, _CapturedNode]] = {}
        self._plans: dict[int, tuple[Any, Any]] = {}

    def covers(self, node: Node) -> bool:
        """Whether ``node`` is captured: it declares what it holds and all of it is selected."""
        spec = node.graphable
        return spec is not None and set(spec.modules) <= self.modules

    def node(self, node: Node) -> Node:
        """``node``, captured when ``covers`` says so (comm and host-reading nodes: refused)."""
        if not self.covers(node):
            return node
        if node.kind != NodeKind.COMPUTE or node.reads_host:
            raise ValueError(f"node {node.name!r} declares CUDA-graph modules but is a comm node "
                             "or reads the host: it can never be captured")
        held = self._nodes.get(id(node))
        if held is None:  # one set of instances per node of a plan made once
            held = self._nodes[id(node)] = (node, _CapturedNode(node, node.graphable, self))
        return replace(node, fn=held[1])

    def plan(self, plan: Sequence[Any]) -> Any:
        """``plan`` with its captured nodes wrapped, once (a ``ChunkedPlan`` stays one, its
        chunked forms wrapped too). Only a ``Plan`` (made once, as ``GPTStage`` makes them)
        is captured: a list made anew per call runs eager (its nodes would be captured anew)."""
        if not isinstance(plan, Plan):
            return plan
        kept = self._plans.get(id(plan))
        if kept is not None:
            return kept[1]

        def wrap(items: Sequence[Any]) -> list[Any]:
            return [Fork(tuple(tuple(self.node(n) for n in b) for b in item.branches),
                         item.width) if isinstance(item, Fork) else self.node(item)
                    for item in items]

        if isinstance(plan, ChunkedPlan):
            chunked = plan.chunked
            wrapped: Any = ChunkedPlan(wrap(plan), lambda k: wrap(chunked(k)))
        else:
            wrapped = Plan(wrap(plan))
        self._plans[id(plan)] = (plan, wrapped)  # the plan kept: its id stays its own
        return wrapped

    def runner(self, inner: Any = None) -> "GraphRunner":
        """A node runner that runs each plan's captured form through ``inner`` (None: plain
        autograd, ``run_nodes``)."""
        return GraphRunner(self, inner)

    def describe(self) -> str:
        return (f"{self.captured} graph instances captured, {self.bytes / 2**20:.1f} MiB in "
                "their pools and static buffers")


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
        return run_nodes(plan, inputs) if self.inner is None else \
            self.inner.run_layer(plan, inputs)


def node_graphs(impl: str, modules: Sequence[str], device: torch.device | None,
                api: Any = None) -> tuple[NodeGraphs | None, str | None]:
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
        return None, (f"--cuda-graph-impl local ({names}): CUDA graphs need CUDA; this run is "
                      f"on {where}, so every node runs eager")
    graphs = NodeGraphs(modules, api if api is not None else GraphApi(device))  # type: ignore
    return graphs, f"CUDA graphs: local, modules {' '.join(sorted(graphs.modules))}"
