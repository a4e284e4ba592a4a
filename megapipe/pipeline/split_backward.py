"""Split one backward pass into an input-gradient part (I) and a deferred weight part (W).

Zero-bubble schedules run ``I`` (the gradient the previous stage waits for) early and ``W`` (the
parameter gradients nobody waits for) later, to fill bubbles. This works for any ``nn.Module``
and keeps no global state: everything W needs is returned by ``input_backward`` as a
``DeferredWeightGrad`` object that the caller stores with the microbatch.

How, without computing anything twice in the common case:

1. Walk the autograd graph from the stage outputs. The *input closure* is the set of graph nodes
   from which a stage input's gradient is reachable: I executes exactly these.
2. For each parameter, walk from its gradient accumulator towards the outputs, stopping at
   nodes of the input closure. Those nodes are the parameter's *anchors*: the last points where
   I computes a gradient that the parameter's own branch needs. Parameters sharing an anchor
   form one group. A parameter whose walk reaches an output without meeting the input closure
   (the whole first stage, whose token ids need no gradient) anchors at that output.
3. During I, a pre-hook on every anchor records the gradient flowing into it.
4. W calls ``autograd.grad`` once per group, from the anchors (with the recorded gradients) to
   the group's parameters: only the weight branches run. When a group has several anchors and
   one lies below another, the gradient that W would push from the upper anchor into the lower
   one is already part of the lower one's recorded total, so a pre-hook replaces the lower
   anchor's incoming gradient by its recorded value (no double counting).

The graph is kept alive between I and W by I's ``retain_graph=True`` and by the anchors, which
hold only the branches W needs once the caller drops the stage outputs. W's calls also retain
the graph (two groups' branches may meet at a node of the input closure); it is freed when the
``DeferredWeightGrad`` is dropped. One ``autograd.grad`` call per group costs a little fixed
overhead per parameter group; in exchange W never recomputes an input-gradient matmul.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from megapipe.precision.main_grad import accumulate_grad


def _node_of(tensor: torch.Tensor) -> Node | None:
    if not tensor.requires_grad:
        return None
    return get_gradient_edge(tensor).node


def _parents(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """Reverse edges of the graph below ``roots``: node -> the nodes that feed it a gradient."""
    parents: dict[Node, list[Node]] = defaultdict(list)
    seen = set(roots)
    queue = deque(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return parents


def _ancestors(starts: Sequence[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """``starts`` and every node above them (towards the outputs)."""
    found = set(starts)
    queue = deque(starts)
    while queue:
        for parent in parents.get(queue.popleft(), ()):
            if parent not in found:
                found.add(parent)
                queue.append(parent)
    return found


@dataclass(eq=False)
class _Group:
    params: list[torch.Tensor] = field(default_factory=list)
    anchors: set[Node] = field(default_factory=set)  # nodes of the input closure
    roots: set[int] = field(default_factory=set)  # indices of outputs anchored directly


@dataclass
class DeferredWeightGrad:
    """What W needs: parameter groups, their anchors' recorded gradients and the root grads."""

    groups: list[_Group]
    recorded: dict[Node, tuple[torch.Tensor | None, ...]]
    root_edges: list[GradientEdge]
    root_grads: list[torch.Tensor]

    def tensors(self) -> list[torch.Tensor]:
        """The gradients kept for ``run`` (the recorded ones and the roots')."""
        recorded = [g for grads in self.recorded.values() for g in grads if g is not None]
        return recorded + list(self.root_grads)

    def run(self) -> None:
        """Accumulate every parameter's gradient (into ``.grad`` or ``main_grad``); call once."""
        for group in self.groups:
            edges: list[GradientEdge] = []
            grads: list[torch.Tensor] = []
            for anchor in group.anchors:
                for index, grad in enumerate(self.recorded.get(anchor, ())):
                    if grad is not None:
                        edges.append(GradientEdge(anchor, index))
                        grads.append(grad)
            for index in sorted(group.roots):
                edges.append(self.root_edges[index])
                grads.append(self.root_grads[index])
            if not edges:
                continue  # no gradient reached this group (its branch was unused)
            handles = []
            if len(edges) > 1:
                for anchor in group.anchors:
                    saved = self.recorded.get(anchor)
                    if saved is not None:
                        handles.append(anchor.register_prehook(lambda _g, s=saved: s))
            try:
                param_edges = [get_gradient_edge(p) for p in group.params]
                dweights = torch.autograd.grad(
                    edges, param_edges, grads, retain_graph=True, allow_unused=True
                )
            finally:
                for handle in handles:
                    handle.remove()
            for param, grad in zip(group.params, dweights):
                if grad is not None:
                    accumulate_grad(param, grad)
        self.groups = []
        self.recorded = {}
        self.root_grads = []


def _group_parameters(
    params: Sequence[torch.Tensor],
    parents: dict[Node, list[Node]],
    closure: set[Node],
    root_index: dict[Node | None, int],
) -> list[_Group]:
    """Each parameter's anchors (step 2 of the module docstring), grouped by shared anchors."""
    found: list[tuple[torch.Tensor, set[Node], set[int]]] = []
    for param in params:
        node = _node_of(param)
        if node is None or (node not in parents and node not in root_index):
            continue  # the parameter took no part in this microbatch
        anchors: set[Node] = set()
        roots: set[int] = set()
        seen = {node}
        queue = deque([node])
        while queue:
            current = queue.popleft()
            if current in root_index and current not in closure:
                roots.add(root_index[current])
            for parent in parents.get(current, ()):
                if parent in closure:
                    anchors.add(parent)
                elif parent not in seen:
                    seen.add(parent)
                    queue.append(parent)
        found.append((param, anchors, roots))
    # union-find over parameters that share an anchor or a root
    leader = list(range(len(found)))

    def find(i: int) -> int:
        while leader[i] != i:
            leader[i] = leader[leader[i]]
            i = leader[i]
        return i

    owner: dict[object, int] = {}
    for i, (_, anchors, roots) in enumerate(found):
        for key in [("a", a) for a in anchors] + [("r", r) for r in roots]:
            if key in owner:
                leader[find(i)] = find(owner[key])
            else:
                owner[key] = i
    by_leader: dict[int, _Group] = {}
    groups: list[_Group] = []
    for i, (param, anchors, roots) in enumerate(found):
        root = find(i)
        if root not in by_leader:
            by_leader[root] = _Group()
            groups.append(by_leader[root])
        group = by_leader[root]
        group.params.append(param)
        group.anchors |= anchors
        group.roots |= roots
    return groups


def input_backward(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], DeferredWeightGrad]:
    """Gradients of ``inputs`` now (I); the parameters' gradients deferred to the returned W."""
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
    outputs = [o for o, _ in pairs]
    grad_outputs = [g for _, g in pairs]
    root_nodes = [_node_of(o) for o in outputs]
    parents = _parents([n for n in root_nodes if n is not None])
    input_nodes = [n for n in (_node_of(t) for t in inputs) if n is not None and n in parents]
    closure = _ancestors(input_nodes, parents)
    root_index = {node: i for i, node in enumerate(root_nodes)}

    groups = _group_parameters(params, parents, closure, root_index)
    recorded: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    handles = []

    def recorder(anchor: Node):
        def hook(grads: tuple[torch.Tensor | None, ...]) -> None:
            recorded[anchor] = grads

        return hook

    for anchor in {a for g in groups for a in g.anchors}:
        handles.append(anchor.register_prehook(recorder(anchor)))
    wanted = [t for t in inputs if _node_of(t) in closure]
    try:
        grads = (
            torch.autograd.grad(outputs, wanted, grad_outputs, retain_graph=True) if wanted else ()
        )
    finally:
        for handle in handles:
            handle.remove()
    by_input = {id(t): g for t, g in zip(wanted, grads)}
    grad_inputs = [by_input.get(id(t)) for t in inputs]
    root_edges = [get_gradient_edge(o) for o in outputs]
    return grad_inputs, DeferredWeightGrad(groups, recorded, root_edges, list(grad_outputs))
