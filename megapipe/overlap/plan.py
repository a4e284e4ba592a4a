"""The node protocol: a layer described as a short sequence of compute and comm nodes.

A MoE layer is ``attention (+router) -> dispatch -> experts -> combine -> finish``; a dense layer
is one compute node. ``run_nodes`` runs a plan in order with plain autograd (the layer's own
``forward``); the combined step interleaves the nodes of two microbatches instead, so the forward
code of a layer is written once.

A node's function takes the layer's per-microbatch ``LayerState`` and a tuple of tensors, and
returns a tuple of tensors: the inputs of the next node. The state carries what one node leaves
for a later node of the same layer (non-differentiable metadata such as routing indices and
split sizes) and the fields the engine owns, ``wgrad_queue`` and ``recomputing``. Each layer
kind declares its state: a dataclass subclass of ``LayerState`` beside the layer (``MoEState``
in ``moe/layer.py``), named by its plan (``Plan(items, state_type)``); the engine makes one per
layer and microbatch (``plan.state_type()``). A write of an undeclared name raises
``AttributeError``. A plan that declares no state (a plain list of nodes, ``Plan(items)``: a
model written before states were declared) gets an ``UndeclaredState``, which takes any name.

A plan may also hold a ``Fork``: parallel chains between two nodes (a layer split into waves,
``WavePlan``); ``layer_graph`` turns any plan into nodes and the places their inputs come from.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol, runtime_checkable

import torch

from megapipe.overlap.wgrad import Track, WeightGradQueue  # noqa: F401  # Track: re-exported
from megapipe.pairing.slots import COMM_READS_HOST
from megapipe.pairing.timing import NodeTimes


class NodeKind(str, Enum):
    COMPUTE = "compute"
    COMM = "comm"


@dataclass(eq=False, slots=True)
class LayerState:
    """Scratch space of one layer for one microbatch (slotted: a layer kind that leaves
    metadata for a later node declares it as a field of its own subclass, also slotted).

    ``wgrad_queue`` is set by the engine for the duration of the layer's backward: deferrable
    ops (``overlap.wgrad.grouped_matmul``, given this state at forward time) put their weight
    gradient into it instead of computing it at once; None computes it at once. ``recomputing``
    is True while a recomputed node runs its forward again inside its backward
    (``recompute.full``): a node then skips what must happen once per forward (logging).
    A subclass's fields are the layer's own metadata, written by one node and read by a later
    one; a layer that leaves none uses ``LayerState`` itself.
    """

    wgrad_queue: WeightGradQueue | None = None
    recomputing: bool = False

    def crossing(self, reader: NodeKind) -> tuple[torch.Tensor, ...]:
        """The device tensors of this state, made so far, that nodes of kind ``reader`` read
        although a node of the other kind made them (the node tuples' tensors cross through
        the tape; these go around it) and that may outlive the maker's stream's next wait for
        the reader's: the combined step keeps them for the reader's stream (CUDA
        ``record_stream``) so that the allocator reuses none while a reader may still run.
        None here; a layer kind with such metadata names it."""
        return ()


@dataclass(eq=False)
class UndeclaredState(LayerState):
    """The state of a plan that declares none (a plain list of nodes, ``Plan(items)``): not
    slotted, it takes any attribute, as every layer state did before layer kinds declared
    theirs, so a model whose nodes write their own names (``state.shape = ...``) runs unchanged
    with the same numbers. A declared state type is still the way to have typos refused."""


# the state is the plan's own LayerState subclass (a node function names that type): Any
NodeFn = Callable[[Any, tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class Node:
    """One node of a layer. ``group``: the process group a comm node drives (optional); the
    combined step checks that each group is driven from one stream only. ``times``: the node's
    expected times (optional; when every node of a combined step has them, the combined step
    places deferred weight gradients by time: ``megapipe.pairing.timing``). ``reads_host``: a
    comm node that reads values back to the host (a dropless dispatch's split sizes); a host
    that only queues work issues it after the compute beside it (``pairing.order``), and it is
    never captured. ``graphable``: what a static compute node holds, so that it may be captured
    into a CUDA graph (``graphs.nodes.Graphable``; None: never captured)."""

    name: str
    kind: NodeKind
    fn: NodeFn
    group: Any = None
    times: NodeTimes | None = None
    reads_host: bool = False
    graphable: Any = None


@dataclass(frozen=True)
class Fork:
    """Parallel chains inside a layer plan, e.g. a layer's expert groups in separate waves.

    The node before the fork returns ``(*around, *slots)`` with ``len(branches) * width`` slots:
    branch c reads ``slots[c * width:(c + 1) * width]`` and runs its nodes as a chain. The node
    after the fork reads ``(*around, *outputs of branch 0, ..., *outputs of branch k-1)``: the
    ``around`` tensors go past the branches. Every branch has the same node kinds, position by
    position, so the engine can issue the branches' nodes side by side or grouped.
    """

    branches: tuple[tuple[Node, ...], ...]
    width: int = 1

    def __post_init__(self) -> None:
        branches = tuple(tuple(branch) for branch in self.branches)
        object.__setattr__(self, "branches", branches)
        if not branches or not all(branches):
            raise ValueError("a Fork needs at least one branch, each with at least one node")
        kinds = {tuple(node.kind for node in branch) for branch in branches}
        if len(kinds) != 1:
            raise ValueError(f"the branches of a Fork must have the same node kinds, got {kinds}")
        if self.width < 1:
            raise ValueError(f"Fork width={self.width} must be >= 1")


Source = tuple[int, slice]  # (node index, or -1 for the layer's input; which of its outputs)


@dataclass(frozen=True)
class LayerGraph:
    """A layer plan as a graph: its nodes in a forward order (every node after the nodes it
    reads), where each node's inputs come from, how many nodes read each node's outputs, and
    the plan's node kinds for the pair order (``megapipe.pairing.order``: per item a
    node's kind, or per fork the kinds of each branch)."""

    nodes: tuple[Node, ...]
    sources: tuple[tuple[Source, ...], ...]
    readers: tuple[int, ...]
    kinds: tuple[Any, ...]


_KIND = {"compute": "compute", "comm": "comm"}  # a NodeKind (a str) or its value -> the value
_WHOLE = slice(None)


def _kind(node: Node) -> str:
    kind = _KIND.get(node.kind)
    if kind is None:
        kind = NodeKind(node.kind).value  # NodeKind names the error
    return COMM_READS_HOST if node.reads_host and kind == "comm" else kind


def layer_graph(plan: Sequence[Any]) -> LayerGraph:
    """The graph of a plan of ``Node`` and ``Fork`` items (a fork sits between two nodes)."""
    if all(type(item) is Node for item in plan):  # a chain: each node reads the one before
        if not plan:
            raise TypeError("a layer plan must be a non-empty list of Node (and Fork) items")
        count = len(plan)
        return LayerGraph(
            tuple(plan),
            tuple(((n - 1, _WHOLE),) for n in range(count)),
            (1,) * (count - 1) + (0,),
            tuple(_kind(node) for node in plan),
        )
    nodes: list[Node] = []
    sources: list[tuple[Source, ...]] = []
    kinds: list[Any] = []
    last = -1  # the node whose outputs the next item reads (-1: the layer's input)
    for position, item in enumerate(plan):
        if isinstance(item, Node):
            if position and isinstance(plan[position - 1], Fork):
                continue  # the node after a fork: added with the fork
            sources.append(((last, _WHOLE),))
            nodes.append(item)
            kinds.append(_kind(item))
            last = len(nodes) - 1
            continue
        if not isinstance(item, Fork):
            raise TypeError(f"a layer plan holds Node and Fork items, got {type(item).__name__}")
        after = plan[position + 1] if position + 1 < len(plan) else None
        if last < 0 or not isinstance(after, Node):
            raise ValueError("a Fork must sit between two nodes of its layer plan")
        k, width = len(item.branches), item.width
        ends = []
        for c, branch in enumerate(item.branches):
            stop = -(k - c - 1) * width or None
            previous: Source = (last, slice(-(k - c) * width, stop))
            for node in branch:
                sources.append((previous,))
                nodes.append(node)
                previous = (len(nodes) - 1, _WHOLE)
            ends.append(previous)
        sources.append(((last, slice(None, -k * width)),) + tuple(ends))
        nodes.append(after)
        kinds.append(tuple(tuple(_kind(n) for n in b) for b in item.branches))
        kinds.append(_kind(after))
        last = len(nodes) - 1
    if not nodes:
        raise TypeError("a layer plan must be a non-empty list of Node (and Fork) items")
    readers = [0] * len(nodes)
    for node_sources in sources:
        for index, _ in node_sources:
            if index >= 0:
                readers[index] += 1
    return LayerGraph(tuple(nodes), tuple(sources), tuple(readers), tuple(kinds))


def run_nodes(
    nodes: Sequence[Any], inputs: tuple[torch.Tensor, ...], state: LayerState | None = None
) -> tuple[torch.Tensor, ...]:
    """Run a node plan (``Node`` and ``Fork`` items) in order with ordinary autograd, on
    ``state`` (None: a fresh one of the plan's state type, ``state_type_of``)."""
    if state is None:
        state = state_type_of(nodes)()
    if all(isinstance(node, Node) for node in nodes):  # a chain: each node reads the last
        chained: tuple[torch.Tensor, ...] = inputs
        for node in nodes:
            chained = node.fn(state, chained)
        return chained
    graph = layer_graph(nodes)
    outputs: list[tuple[torch.Tensor, ...]] = []
    for node, sources in zip(graph.nodes, graph.sources):
        values: tuple[Any, ...] = ()
        for index, part in sources:
            values += tuple(inputs if index < 0 else outputs[index])[part]
        outputs.append(tuple(node.fn(state, values)))
    return outputs[-1]


class Plan(list):
    """A node plan (a list of ``Node`` and ``Fork``) with its graph and its state type:
    ``graph`` is its ``layer_graph``, made here so the engine does not make it again every time
    it records the layer; ``state_type`` is the ``LayerState`` class its nodes share (the layer
    kind's declaration; none given: ``UndeclaredState``). A model that builds its plans once
    (``GPTStage.layer_plans``) gives them so; a layer kind with its own state gives its plans
    as ``Plan`` always."""

    def __init__(
        self, items: Sequence[Any], state_type: type[LayerState] = UndeclaredState
    ) -> None:
        super().__init__(items)
        self.graph = layer_graph(self)
        self.state_type = state_type

    def wrapped(self, wrap: Callable[[list[Any]], list[Any]]) -> Plan:
        """This plan with its items replaced by ``wrap(items)``, its state type kept."""
        return Plan(wrap(list(self)), self.state_type)


class WavePlan(Plan):
    """A ``Plan`` that can also split itself into ``k`` waves: ``in_waves(k)`` returns the same
    layer as a plan with a ``Fork`` of k branches whose results equal this plan's (made once per
    k); the combined step uses it when asked for all-to-alls in waves (``a2a_waves``)."""

    def __init__(
        self,
        nodes: Sequence[Any],
        in_waves: Callable[[int], list[Any]],
        state_type: type[LayerState] = UndeclaredState,
    ) -> None:
        super().__init__(nodes, state_type)
        self._in_waves = in_waves
        self._forms: dict[int, WavePlan] = {}

    def in_waves(self, waves: int) -> WavePlan:
        """The layer in ``waves`` expert groups."""
        form = self._forms.get(waves)
        if form is None:
            form = self._forms[waves] = WavePlan(
                self._in_waves(waves), self._in_waves, self.state_type
            )
        return form

    def wrapped(self, wrap: Callable[[list[Any]], list[Any]]) -> WavePlan:
        """This plan and its wave forms with their items replaced by ``wrap(items)``."""
        in_waves = self.in_waves
        return WavePlan(
            wrap(list(self)), lambda waves: wrap(list(in_waves(waves))), self.state_type
        )


def state_type_of(plan: Sequence[Any]) -> type[LayerState]:
    """The state type the engine makes for one run of ``plan``: a ``Plan``'s own, else (a plain
    list of nodes) ``UndeclaredState``."""
    return plan.state_type if isinstance(plan, Plan) else UndeclaredState


@runtime_checkable
class NodeRunner(Protocol):
    """Runs one layer plan for a model's forward (a ``StageModule``'s ``node_runner``):
    recorded on a tape (``TapeRunner``) or co-scheduled with another microbatch's backward
    (``CombinedStep``)."""

    def run_layer(
        self, nodes: Sequence[Node], inputs: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...]: ...


class WarnOnce:
    """Warns once per type: the record of which types were warned about lives in this object."""

    def __init__(self) -> None:
        self.types: set[type] = set()

    def __call__(self, kind: type, message: str, stacklevel: int = 3) -> None:
        if kind not in self.types:
            self.types.add(kind)
            warnings.warn(message, stacklevel=stacklevel + 1)


def is_plan(value: Any) -> bool:
    """Whether ``value`` is a node plan: a non-empty list of ``Node`` and ``Fork``."""
    return (
        isinstance(value, (list, tuple))
        and bool(value)
        and all(isinstance(item, (Node, Fork)) for item in value)
    )


def node_plan_of(layer: Any, warn_once: WarnOnce, a2a_waves: int = 1) -> list[Any]:
    """The node plan of ``layer``: a plan as is, ``layer.node_plan()``, or, for a callable layer
    that does not follow the node protocol, the whole layer as one compute node (its forward and
    backward then run one after the other; warned once per layer type). With ``a2a_waves`` > 1
    a ``WavePlan`` gives its wave form."""
    plan = layer
    if type(plan) is not list and not is_plan(plan):
        node_plan = getattr(layer, "node_plan", None)
        if callable(node_plan):
            plan = node_plan()
    if type(plan) is list or is_plan(plan):  # a plan (the tape checks its items)
        if a2a_waves > 1 and isinstance(plan, WavePlan):
            return plan.in_waves(a2a_waves)
        return plan
    if not callable(layer):
        raise TypeError(
            f"run_layer needs a list of Node, a layer with node_plan(), or a callable layer; "
            f"got {type(layer).__name__}"
        )
    kind = type(layer)
    warn_once(
        kind,
        f"{kind.__name__} does not follow the node protocol (no node_plan() returning a "
        "list of Node); its forward and backward run one after the other, without overlap",
    )

    def whole_layer(state: LayerState, tensors: tuple) -> tuple:
        out = layer(*tensors)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    return [Node(kind.__name__, NodeKind.COMPUTE, whole_layer)]
