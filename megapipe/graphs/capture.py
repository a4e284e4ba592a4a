"""One static node's CUDA graphs: capture on first use, replay.

``CapturedNode`` is the function ``graphs.nodes.NodeGraphs`` puts in place of a captured
node's own: per input signature it keeps *instances* (``graphs.instance``: static buffers, a
forward and a backward graph in one private pool, the state the node writes, the guards on what
it reads), captures one when none fits, in three phases (static inputs and warm-up, the two
captures, the replay set-up), and replays it through ``graphs.replay.Replay``, an autograd
function whose backward replays the backward graph. The rules it follows are in
``graphs.nodes``'s docstring.

A parameter whose gradient eager code moves into its ``main_grad`` (a post-accumulate hook of
``precision.main_grad`` or the data-parallel buffers) has it added there *inside* the backward
graph, on the stream the backward replays on (the node's own, the one the data-parallel
reduction waits on): no accumulation, hook or copy outside the graph. What those hooks do
besides the move (the data-parallel bucket counts) runs after the replay (``after_backward``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megapipe.graphs.instance import Handed, Instance, Lease, Loans, static_bytes
from megapipe.graphs.recorder import StateRecorder, forget_writes, no_grad_read
from megapipe.graphs.replay import ParamCall, ParamsCall, Replay
from megapipe.overlap.plan import LayerState, Node
from megapipe.precision.main_grad import accumulate_grad, grad_buffer

WARMUP_RUNS = 1  # eager forward + backward runs before a capture (lazy kernel initialisation)


@dataclass
class GraphStats:
    """What the captures of one executor hold: the graph calls (``graphs.nodes.GraphApi`` or
    a stand-in), the instances captured and their bytes (private pools, static buffers), the
    static tensors they hand out (read in place by the nodes captured after them)."""

    api: Any
    captured: int = 0
    bytes: int = 0
    eager: dict[str, str] = field(default_factory=dict)  # node -> why it last ran eager
    handed: Handed = field(default_factory=Handed)


def _signature(inputs: Sequence[Any]) -> tuple:
    return tuple(
        (tuple(x.shape), x.stride(), x.dtype, x.requires_grad)
        if isinstance(x, torch.Tensor)
        else ("value", x)
        for x in inputs
    )


def _tensors(values: Any, what: str) -> tuple[torch.Tensor, ...]:
    values = tuple(values)
    for v in values:
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"a captured node's {what} must be tensors, got {type(v).__name__}")
    return values


def _moves_grad(param: torch.Tensor) -> bool:
    """Whether autograd's gradient of ``param`` goes straight into its ``main_grad`` (a
    post-accumulate hook of ``main_grad.attach_main_grads`` or the flat gradient buffers, which
    leave ``.grad`` None): then the backward graph adds it there itself."""
    return getattr(param, "main_grad", None) is not None and bool(
        getattr(param, "_post_accumulate_grad_hooks", None)
    )


def _accumulators(params: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    """The parameters' ``AccumulateGrad`` nodes, made now (on the current stream: the one the
    node is issued on, which the data-parallel reduction waits on) unless they live. Autograd
    accumulates a parameter (one without ``main_grad``, whose gradient autograd takes) on the
    stream current when its node was made; held here, the warm-up and captures on the graphs'
    side stream reuse them instead of making them there (pytorch/pytorch#137483)."""
    with torch.enable_grad():
        return tuple(_accumulator(p) for p in params if p.requires_grad)


def _accumulator(param: torch.Tensor) -> Any:
    grad_fn = param.view_as(param).grad_fn
    assert grad_fn is not None  # a view, made with grad on, of a tensor that requires grad
    return grad_fn.next_functions[0][0]


class _Regions:
    """What one capture records: the forward region (the node on the recording state, its
    logs read), the backward region (``autograd.grad`` of its outputs, the gradients handed
    over in the graph) and the warm-up that runs the node eagerly first."""

    def __init__(
        self,
        node: Node,
        spec: Any,
        instance: Instance,
        recorder: StateRecorder,
        wanted: list[torch.Tensor],
        handover: list[Any],
    ) -> None:
        """``wanted``: the inputs and parameters whose gradients the graph computes;
        ``handover``: per wanted tensor, where the graph puts its gradient (None: returned;
        a tensor: copied into this producer's gradient buffer; a parameter: added into its
        ``main_grad``, nothing returned)."""
        self.node, self.spec, self.instance, self.recorder = node, spec, instance, recorder
        self.wanted, self.handover = wanted, handover
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.logged: list[tuple[torch.Tensor, ...]] = []
        self.added: list[torch.Tensor] = []  # parameters whose main_grad the graph adds into

    def forward(self) -> tuple[torch.Tensor, ...]:
        # the node records into fresh logs, read here: the values it logs are computed
        # inside the graph; the logs' earlier entries are not touched
        spec = self.spec
        kept = [getattr(owner, name) for owner, name in spec.logs]
        fresh = [type(log)() for log in kept]
        for (owner, name), log in zip(spec.logs, fresh):
            setattr(owner, name, log)
        forget_writes(self.recorder)
        try:
            outputs = _tensors(self.node.fn(self.recorder, self.instance.inputs), "outputs")
        finally:
            for (owner, name), log in zip(spec.logs, kept):
                setattr(owner, name, log)
        self.outputs = outputs
        self.logged = [_tensors(log.pop_all(), "logged values") for log in fresh]
        written = tuple(v for v in self.recorder._writes.values() if isinstance(v, torch.Tensor))
        return outputs + written + tuple(v for values in self.logged for v in values)

    def backward(self) -> tuple[torch.Tensor | None, ...]:
        roots = [o for o in self.outputs if o.requires_grad]
        grads = [g for g in self.instance.grad_outputs if g is not None]
        if not roots or not self.wanted:
            return ()
        found = torch.autograd.grad(roots, self.wanted, grads, allow_unused=True)
        return tuple(
            self._hand_over(g, where, t) for g, where, t in zip(found, self.handover, self.wanted)
        )

    def _hand_over(
        self, grad: torch.Tensor | None, where: Any, wanted: torch.Tensor
    ) -> torch.Tensor | None:
        """Inside the backward graph: ``grad`` into the producer's gradient buffer ``where``
        (an input read in place) or added into ``wanted``'s ``main_grad`` (``where is
        wanted``), or returned."""
        if grad is None or where is None:
            return grad
        if where is wanted:
            accumulate_grad(wanted, grad)  # into main_grad, as the hook adds it
            self.added.append(wanted)
            return None
        return where.copy_(grad)

    def warm(self) -> None:
        self.forward()
        _check_leaves(self.node.name, self.outputs, self.wanted)  # refused before any capture
        roots = [o for o in self.outputs if o.requires_grad]
        if roots and self.wanted:
            torch.autograd.grad(
                roots, self.wanted, [torch.ones_like(o) for o in roots], allow_unused=True
            )
        self.outputs, self.logged = (), []


class CapturedNode:
    """A node's instances by input signature, capture on first use (module docstring)."""

    def __init__(
        self,
        node: Node,
        spec: Any,
        stats: GraphStats,
        before_replay: Sequence[ParamsCall] = (),
        after_backward: Sequence[ParamCall] = (),
        layer: int = 0,
    ) -> None:
        """``spec``: the node's ``graphs.nodes.Graphable``; ``stats``: where captures count;
        ``layer``: its layer plan's key (it reads in place only what that layer's nodes made);
        ``before_replay``: called with its parameters before each forward replay;
        ``after_backward``: with each parameter the backward graph added into ``main_grad``,
        after it."""
        self.node, self.spec, self.stats = node, spec, stats
        self.before_replay, self.after_backward = before_replay, after_backward
        self.layer = layer
        self.accumulators: tuple[Any, ...] | None = None  # see _accumulators
        self.instances: dict[tuple, list[Instance]] = {}
        self.pointers = tuple(p.data_ptr() for p in spec.params + spec.buffers)

    def __call__(self, state: LayerState, inputs: tuple) -> tuple[torch.Tensor, ...]:
        inputs = _tensors(inputs, "inputs")
        spec = self.spec
        reason = spec.eager() if spec.eager is not None else None
        if reason is not None:  # shapes not static now: eager, the reason kept for the log
            self.stats.eager[self.node.name.split(".")[-1]] = reason
            return tuple(self.node.fn(state, inputs))
        if not torch.is_grad_enabled() or not any(
            t.requires_grad for t in inputs + spec.params
        ):  # nothing to save: eager
            return tuple(self.node.fn(state, inputs))
        if tuple(p.data_ptr() for p in spec.params + spec.buffers) != self.pointers:
            raise RuntimeError(
                f"node {self.node.name!r}: a parameter's or buffer's storage "
                "moved since its graphs were captured (they would read the old "
                "memory)"
            )
        key = (_signature(inputs), spec.key() if spec.key is not None else None)
        found = self.instances.setdefault(key, [])
        instance = next((i for i in found if i.fits(state, inputs)), None)
        if instance is None:
            loans = Loans(self.stats.handed, self.layer)
            instance = self._capture(state, inputs, loans)
            found.append(instance)
            loans.settle()  # the capture's own references gone: what the instance keeps
        if any(
            grad_buffer(p).data_ptr() != g.data_ptr()
            for p, g in zip(instance.accumulated, instance.main_grads)
        ):
            raise RuntimeError(
                f"node {self.node.name!r}: a parameter's main_grad moved since "
                "its graphs were captured (they would add into the old memory)"
            )
        for name in instance.state_inputs:
            no_grad_read(self.node.name, name, getattr(state, name))
        for call in self.before_replay:
            call(spec.params)
        return Replay.apply(
            Lease(instance),
            state,
            spec.logs,
            len(inputs),
            self.after_backward,
            *inputs,
            *spec.params,
        )

    def _capture(
        self, state: LayerState, inputs: tuple[torch.Tensor, ...], loans: Loans
    ) -> Instance:
        """A new instance: static inputs and warm-up, the two captures, the replay set-up."""
        if self.accumulators is None:  # before the warm-up on the side stream makes them there
            self.accumulators = _accumulators(self.spec.params)
        instance = Instance(self.stats.api)
        regions = self._static_inputs(instance, state, inputs, loans)
        with torch.enable_grad():
            for _ in range(WARMUP_RUNS):
                self.stats.api.warm(regions.warm)
            found, pooled = self._record(instance, regions)
        self._set_up(instance, regions, found, pooled)
        return instance

    def _static_inputs(
        self, instance: Instance, state: LayerState, inputs: tuple[torch.Tensor, ...], loans: Loans
    ) -> _Regions:
        """The instance's static inputs (another instance's static output read in place, else
        a copy), the parameters whose gradient the graph adds into ``main_grad``, and the
        regions to capture."""
        statics, in_place, handover, seen = [], [], [], set()
        for x in inputs:
            found = loans.borrow(x)
            if found is not None and id(found) not in seen:
                seen.add(id(found))
                static = found.tensor.detach()  # the producer's memory, read in place
            else:
                found = None
                with torch.no_grad():
                    static = torch.empty_strided(
                        x.shape, x.stride(), dtype=x.dtype, device=x.device
                    ).copy_(x)
            statics.append(static.requires_grad_(x.requires_grad))
            in_place.append(found is not None)
            if x.requires_grad:
                handover.append(None if found is None else found.grad)
        instance.inputs, instance.in_place = tuple(statics), tuple(in_place)
        handover += [p if _moves_grad(p) else None for p in self.spec.params if p.requires_grad]
        wanted = [t for t in instance.inputs + self.spec.params if t.requires_grad]
        recorder = StateRecorder(state, self.node.name, loans)
        return _Regions(self.node, self.spec, instance, recorder, wanted, handover)

    def _record(self, instance: Instance, regions: _Regions) -> tuple[tuple, int]:
        """Capture the forward graph, then the backward graph in its pool; (what the backward
        region returned, the bytes the captures added to the pool)."""
        api, spec = self.stats.api, self.spec
        # what the graphs read in place besides their pool (state tensors: read by the warm-up)
        instance.state_inputs = dict(regions.recorder._state_inputs)
        static = (
            instance.inputs + spec.params + spec.buffers + tuple(instance.state_inputs.values())
        )
        # thread_local: other threads (NCCL's watchdog, autograd's device thread) may make
        # calls a global capture would forbid them; work they queue on the stream is captured
        before = api.reserved()
        instance.fwd, _ = api.capture(regions.forward, None, "thread_local", static)
        pooled = api.reserved() - before
        instance.outputs, instance.logged = regions.outputs, list(map(list, regions.logged))
        instance.grad_outputs = [
            torch.empty_like(o) if o.requires_grad else None for o in instance.outputs
        ]
        # written in place: producers' gradient buffers, main_grad (parameters in handover)
        written = tuple(getattr(t, "main_grad", t) for t in regions.handover if t is not None)
        grads = tuple(g for g in instance.grad_outputs if g is not None)
        before = api.reserved()
        instance.bwd, found = api.capture(
            regions.backward, api.pool(instance.fwd), "thread_local", static + grads + written
        )
        return found, pooled + api.reserved() - before

    def _set_up(self, instance: Instance, regions: _Regions, found: tuple, pooled: int) -> None:
        """What a replay applies (state writes, guards), hands out and returns; the bytes."""
        recorder, spec = regions.recorder, self.spec
        instance.writes = dict(recorder._writes)
        instance.guards = dict(recorder._reads)
        instance.accumulated = tuple(regions.added)
        instance.main_grads = tuple(grad_buffer(p) for p in regions.added)  # their main_grad
        instance.in_place_state = frozenset(
            name
            for name, t in instance.state_inputs.items()
            if self.stats.handed.find(t, self.layer) is not None
        )
        regions.outputs, regions.logged = (), []
        instance.hand_out()
        returned = iter(found)
        instance.grad_inputs = tuple(
            next(returned, None) if t.requires_grad else None for t in instance.inputs + spec.params
        )
        # the pool's segments (the reserved bytes its captures added) and the static buffers
        instance.bytes = (
            pooled
            + static_bytes(s for s, kept in zip(instance.inputs, instance.in_place) if not kept)
            + static_bytes(instance.grad_outputs)
            + static_bytes(
                t for n, t in instance.state_inputs.items() if n not in instance.in_place_state
            )
        )
        self.stats.captured += 1
        self.stats.bytes += instance.bytes
        self.stats.handed.add(instance, self.layer)


def _check_leaves(name: str, outputs: Iterable[torch.Tensor], wanted: list[torch.Tensor]) -> None:
    """Every tensor the captured outputs' gradients reach is an input or a declared parameter
    (else its gradient would be lost: refused)."""
    known = {id(t) for t in wanted}
    seen, todo = set(), [o.grad_fn for o in outputs if o.grad_fn is not None]
    while todo:
        fn = todo.pop()
        if fn in seen:
            continue
        seen.add(fn)
        leaf = getattr(fn, "variable", None)
        if leaf is not None and id(leaf) not in known:
            raise RuntimeError(
                f"node {name!r} cannot be captured: it uses a tensor of shape "
                f"{tuple(leaf.shape)} that needs a gradient but is neither its "
                "input nor in Graphable.params"
            )
        todo.extend(f for f, _ in fn.next_functions if f is not None)
