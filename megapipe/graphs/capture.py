"""One static node's CUDA graphs: capture on first use, replay, the recording layer state.

``CapturedNode`` is the function ``graphs.nodes.NodeGraphs`` puts in place of a captured
node's own: per input signature it keeps *instances* (static buffers, a forward and a backward
graph in one private pool, the state the node writes, the guards on what it reads), captures one
when none is free, and replays it through ``_Replay``, an autograd function whose backward
replays the backward graph. The rules it follows are in ``graphs.nodes``'s docstring.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from megapipe.overlap.plan import LayerState, Node

WARMUP_RUNS = 1  # eager forward + backward runs before a capture (lazy kernel initialisation)


@dataclass
class GraphStats:
    """What the captures of one executor hold: the graph calls (``graphs.nodes.GraphApi`` or
    a stand-in), the instances captured and their bytes (private pools, static buffers)."""

    api: Any
    captured: int = 0
    bytes: int = 0
    eager: dict[str, str] = field(default_factory=dict)  # node -> why it last ran eager


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
    """The layer state a node sees while it is captured: writes kept, reads recorded (a plain
    value: a guard of the instance; a tensor: a static buffer refilled before each replay). A
    write of a name the real state's type does not declare raises, as it would on that state
    (an ``UndeclaredState`` takes any name). Its deferred weight-gradient queue is None: a
    captured node computes its weight gradients inside its backward graph."""

    __slots__ = ("_base", "_writes", "_reads", "_fields", "_node", "_state_inputs")

    def __init__(self, base: LayerState, node: str) -> None:
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_writes", {})
        object.__setattr__(self, "_reads", {})
        declared = (None if hasattr(base, "__dict__")
                    else frozenset(f.name for f in fields(type(base))))
        object.__setattr__(self, "_fields", declared)
        object.__setattr__(self, "_node", node)
        object.__setattr__(self, "_state_inputs", {})

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("_"):
            return object.__getattribute__(self, name)
        writes = object.__getattribute__(self, "_writes")
        if name in writes:
            return writes[name]
        value = getattr(object.__getattribute__(self, "_base"), name)
        if name == "wgrad_queue":  # the node's weight gradients run inside its backward graph
            return None
        if isinstance(value, torch.Tensor):
            return object.__getattribute__(self, "_tensor")(name, value)
        object.__getattribute__(self, "_reads")[name] = value
        return value

    def _tensor(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """A state tensor the node reads: a static buffer of its instance, filled from the
        state before each replay (as a node input is); one needing a gradient is refused."""
        _no_grad_read(self._node, name, value)
        static = self._state_inputs.get(name)
        if static is None:
            with torch.no_grad():
                static = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                             device=value.device).copy_(value)
            self._state_inputs[name] = static
        return static

    def __setattr__(self, name: str, value: Any) -> None:
        if self._fields is not None and name not in self._fields:
            raise AttributeError(f"{type(self._base).__name__} declares no field {name!r}")
        self._writes[name] = value


class _Instance:
    """One captured copy of a node: its graphs, static buffers, state writes and guards."""

    def __init__(self, api: Any) -> None:
        self.api = api
        # busy while a forward awaits its backward: a weak reference, so that the lease dies
        # (and frees the instance) with the forward's autograd record when no backward comes
        self.lease: weakref.ref[_Lease] | None = None
        self.guards: dict[str, Any] = {}
        self.state_inputs: dict[str, torch.Tensor] = {}  # state tensors read: static buffers
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
        return (self.lease is None or self.lease() is None) and all(getattr(state, name) == value
                                     for name, value in self.guards.items()) and all(
            _views(t) <= count for t, count in zip(self.handed, self.counts)) and all(
            _same_layout(getattr(state, name), static)
            for name, static in self.state_inputs.items())

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


def _no_grad_read(node: str, name: str, value: torch.Tensor) -> None:
    if value.requires_grad:
        raise RuntimeError(f"node {node!r} cannot be captured: it reads state.{name}, a tensor "
                           "that needs a gradient; a captured node takes those through its "
                           "inputs")


def _same_layout(value: Any, static: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == static.shape and \
        value.stride() == static.stride() and value.dtype == static.dtype


def _moves_grad(param: torch.Tensor) -> bool:
    """Whether autograd's gradient of ``param`` goes straight into its ``main_grad`` (a
    post-accumulate hook of ``main_grad.attach_main_grads`` or the flat gradient buffers, which
    leave ``.grad`` None), so a buffer handed to it is never kept."""
    return getattr(param, "main_grad", None) is not None and bool(
        getattr(param, "_post_accumulate_grad_hooks", None))


def _accumulators(params: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    """The parameters' ``AccumulateGrad`` nodes, made now (on the current stream: the one the
    node is issued on, which the data-parallel reduction waits on) unless they live. Autograd
    accumulates a parameter, and runs its ``main_grad`` hook, on the stream current when its
    node was made; held here, the warm-up and captures on the graphs' side stream reuse them
    instead of making them there (pytorch/pytorch#137483)."""
    with torch.enable_grad():
        return tuple(_accumulator(p) for p in params if p.requires_grad)


def _accumulator(param: torch.Tensor) -> Any:
    grad_fn = param.view_as(param).grad_fn
    assert grad_fn is not None  # a view, made with grad on, of a tensor that requires grad
    return grad_fn.next_functions[0][0]


def _views(tensor: torch.Tensor) -> int:
    """How many tensors view ``tensor``'s storage (plus one: the storage object asked)."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


class _Lease:
    """Holds an instance busy from one forward replay until its backward replayed (or the
    autograd record of that forward is dropped without one)."""

    __slots__ = ("instance", "backward_done", "__weakref__")

    def __init__(self, instance: _Instance) -> None:
        instance.lease = weakref.ref(self)
        self.instance = instance
        self.backward_done = False

    def release(self) -> None:
        if self.instance.lease is not None and self.instance.lease() is self:
            self.instance.lease = None

    def __del__(self) -> None:
        self.release()


class _Replay(torch.autograd.Function):
    """Forward: copy the inputs in, replay, apply the state writes. Backward: copy the output
    gradients in, replay, hand out the static input and parameter gradients."""

    @staticmethod
    def forward(ctx, lease: _Lease, state: LayerState, logs: tuple,
                num_inputs: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        instance = lease.instance
        for static, x in zip(instance.inputs, tensors[:num_inputs]):
            static.copy_(x)
        for name, static in instance.state_inputs.items():
            static.copy_(getattr(state, name))
        instance.api.replay(instance.fwd)
        for name, value in instance.writes.items():
            setattr(state, name, value)
        for (owner, name), values in zip(logs, instance.logged):
            log = getattr(owner, name)
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
    def backward(ctx, *grads: torch.Tensor | None):
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


class CapturedNode:
    """A node's instances by input signature, capture on first use (module docstring)."""

    def __init__(self, node: Node, spec: Any, stats: GraphStats,
                 before_replay: Sequence[Callable[[tuple[torch.Tensor, ...]], None]] = ()) -> None:
        """``spec``: the node's ``graphs.nodes.Graphable``; ``stats``: where captures count;
        ``before_replay``: called with its parameters before each forward replay."""
        self.node, self.spec, self.stats = node, spec, stats
        self.before_replay = before_replay
        self.accumulators: tuple[Any, ...] | None = None  # see _accumulators
        self.instances: dict[tuple, list[_Instance]] = {}
        self.pointers = tuple(p.data_ptr() for p in spec.params + spec.buffers)

    def __call__(self, state: LayerState, inputs: tuple) -> tuple[torch.Tensor, ...]:
        inputs = _tensors(inputs, "inputs")
        spec = self.spec
        reason = spec.eager() if spec.eager is not None else None
        if reason is not None:  # shapes not static now: eager, the reason kept for the log
            self.stats.eager[self.node.name.split(".")[-1]] = reason
            return tuple(self.node.fn(state, inputs))
        if not torch.is_grad_enabled() or not any(
                t.requires_grad for t in inputs + spec.params):  # nothing to save: eager
            return tuple(self.node.fn(state, inputs))
        if tuple(p.data_ptr() for p in spec.params + spec.buffers) != self.pointers:
            raise RuntimeError(f"node {self.node.name!r}: a parameter's or buffer's storage "
                               "moved since its graphs were captured (they would read the old "
                               "memory)")
        key = (_signature(inputs), spec.key() if spec.key is not None else None)
        found = self.instances.setdefault(key, [])
        instance = next((i for i in found if i.fits(state)), None)
        if instance is None:
            instance = self._capture(state, inputs)
            found.append(instance)
        for name in instance.state_inputs:
            _no_grad_read(self.node.name, name, getattr(state, name))
        for call in self.before_replay:
            call(spec.params)
        return _Replay.apply(_Lease(instance), state, spec.logs, len(inputs), *inputs,
                             *spec.params)

    def _capture(self, state: LayerState, inputs: tuple[torch.Tensor, ...]) -> _Instance:
        api, node, spec = self.stats.api, self.node, self.spec
        if self.accumulators is None:  # before the warm-up on the side stream makes them there
            self.accumulators = _accumulators(spec.params)
        instance = _Instance(api)
        with torch.no_grad():
            instance.inputs = tuple(torch.empty_strided(x.shape, x.stride(), dtype=x.dtype,
                                                        device=x.device).copy_(x)
                                    for x in inputs)
        for static, x in zip(instance.inputs, inputs):
            static.requires_grad_(x.requires_grad)
        wanted = [t for t in instance.inputs + spec.params if t.requires_grad]
        live: dict[str, Any] = {}
        recorder = _Recorder(state, node.name)

        def forward_region() -> tuple[torch.Tensor, ...]:
            # the node records into fresh logs, read here: the values it logs are computed
            # inside the graph; the logs' earlier entries are not touched
            kept = [getattr(owner, name) for owner, name in spec.logs]
            fresh = [type(log)() for log in kept]
            for (owner, name), log in zip(spec.logs, fresh):
                setattr(owner, name, log)
            object.__setattr__(recorder, "_writes", {})
            try:
                outputs = _tensors(node.fn(recorder, instance.inputs), "outputs")
            finally:
                for (owner, name), log in zip(spec.logs, kept):
                    setattr(owner, name, log)
            live["outputs"] = outputs
            logged = [_tensors(log.pop_all(), "logged values") for log in fresh]
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
            self._check_leaves(live["outputs"], wanted)  # refused before any capture
            roots = [o for o in live["outputs"] if o.requires_grad]
            if roots and wanted:
                torch.autograd.grad(roots, wanted, [torch.ones_like(o) for o in roots],
                                    allow_unused=True)
            live.clear()

        with torch.enable_grad():
            for _ in range(WARMUP_RUNS):
                api.warm(warm)
            # thread_local: other threads (NCCL's watchdog, autograd's device thread) may make
            # calls a global capture would forbid them; work they queue on the stream is captured
            # what the graphs read in place besides their pool (their static inputs)
            instance.state_inputs = dict(recorder._state_inputs)  # read by the warm-up
            static = instance.inputs + spec.params + spec.buffers + tuple(
                instance.state_inputs.values())
            before = api.reserved()
            instance.fwd, _ = api.capture(forward_region, None, "thread_local", static)
            pooled = api.reserved() - before
            instance.outputs = live["outputs"]
            instance.logged = live["logged"]
            instance.grad_outputs = [torch.empty_like(o) if o.requires_grad else None
                                     for o in instance.outputs]
            before = api.reserved()
            instance.bwd, found = api.capture(
                backward_region, api.pool(instance.fwd), "thread_local",
                static + tuple(g for g in instance.grad_outputs if g is not None))
            pooled += api.reserved() - before
        instance.writes = dict(recorder._writes)
        instance.guards = dict(recorder._reads)
        live.clear()
        instance.hand_out()
        found = iter(found)
        instance.grad_inputs = tuple(next(found, None) if t.requires_grad else None
                                     for t in instance.inputs + spec.params)
        instance.moved = (False,) * len(inputs) + tuple(_moves_grad(p) for p in spec.params)
        # the pool's segments (the reserved bytes its captures added) and the static buffers
        instance.bytes = pooled + _bytes(instance.inputs) + _bytes(instance.grad_outputs) + \
            _bytes(instance.state_inputs.values())
        self.stats.captured += 1
        self.stats.bytes += instance.bytes
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
