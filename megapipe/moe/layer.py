"""The MoE layer, written as a node plan so the overlap engine can interleave it.

``MoELayer.node_plan()`` returns five nodes: route, a ``Fork`` of one branch (dispatch,
experts, combine), finish. Each node fn takes ``(state, tensors)``; route and finish read only
their own *trailing* tensors, and any leading tensors (e.g. a residual a model layer prepends)
stay in front (``pass_leading``). What route leaves for finish goes around the branch (the
fork's ``around`` tensors), so no node carries a tensor it does not use. Own tensors:

| node     | kind    | reads                      | returns                 |
|----------|---------|----------------------------|-------------------------|
| route    | compute | (x,)                       | (*shared, probs, rows)  |
| dispatch | comm    | (rows,)                    | (expert_rows,)          |
| experts  | compute | (expert_rows,)             | (expert_out,)           |
| combine  | comm    | (expert_out,)              | (rows_out,)             |
| finish   | compute | route's (*shared, probs), combine's (rows_out,) | (y,)       |

``x`` is ``[b, s, h]`` or ``[t, h]``; ``y`` has the shape of ``x``. ``shared`` is ``(tokens,)``
(x flattened to [t, h], the shared expert's input, kept for finish) when the config has a shared
expert, else empty. ``probs [t, k]`` are the router's combine weights, ``rows [n, h]`` the tokens
permuted into expert order (local experts of EP rank 0 first). Routing indices and split sizes
are written into the layer's state (``MoEState``, its declared fields) by route and dispatch
and read by later nodes.

The auxiliary loss (``aux_loss_coeff * load_balancing + z_loss_coeff * z``) adds its gradient
(times ``aux_loss_scale``, read at forward time) in the router's own backward, which runs when
the gradients of ``probs`` and ``rows`` arrive (``Router.forward``); each forward records its value
in ``aux_loss_log`` (as statistics, summed when read)
(once: a route that runs again for full recompute, ``state.recomputing``, neither records nor
reads the scale again).
Losses and the capacity are computed over this rank's tokens of the microbatch (no collective).
With a capacity, every expert gets exactly ``capacity`` rows (padding after the kept tokens,
Megatron's ``--moe-pad-expert-input-to-capacity``), so every EP rank must have the same number
of tokens per microbatch; the all-to-all sizes are then static. No node reads anything back to
the host except dispatch, once, in the dropless case (``moe/dispatcher.py``, "the one host
read"). With a rank capacity (``MoEConfig.rank_capacity_factor``, ``moe.rank_capacity``) the
layer stays dropless and reads nothing either, in fixed-size lanes: route places the sends
(``rows`` become the lanes ``[ep * lane, h]``, their way back and the overflow, ORed into
``rank_overflow``, a device flag the step reads once: ``take_overflow``), dispatch and combine
hold only their all-to-alls, experts orders the received lanes by expert and back, finish takes
its rows back from the returned lanes. Every shape is then static and the state holds plain
values and device tensors only, so experts and finish declare Megatron's CUDA-graph module
``moe`` (``graphs.nodes``). ``sync_free=False`` runs the layer as the plain dropless one (the
step run again after an overflow, ``set_sync_free``); experts and finish then run eager.
Config and state: ``moe.config``, ``moe.state``.

``node_plan().in_waves(k)`` (``wave_plan(k)``) is the same layer with its all-to-alls in k
expert groups, a ``Fork`` of (dispatch, experts, combine) per group between route and finish,
so that waves of one microbatch overlap each other (``megapipe.moe.waves``); bitwise the same
results.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megapipe.graphs.nodes import Graphable
from megapipe.kernels import unpermute_tokens
from megapipe.moe.aux_loss import AuxLossLog
from megapipe.moe.config import MoEConfig
from megapipe.moe.dispatcher import TokenDispatcher
from megapipe.moe.experts import GroupedExperts, SwiGLUMLP
from megapipe.moe.rank_capacity import LaneExchanges, gather_rows, lane_rows
from megapipe.moe.router import Router
from megapipe.moe.state import MoEState, pass_leading
from megapipe.moe.waves import WaveDispatch, WaveNodes
from megapipe.overlap.plan import Fork, Node, NodeKind, WavePlan, run_nodes

__all__ = [
    "MoEConfig",
    "MoELayer",
    "MoEState",
    "pass_leading",
    "set_sync_free",
    "take_aux_loss_logs",
    "take_overflow",
]


def take_overflow(modules: Sequence[nn.Module]) -> torch.Tensor | None:
    """Whether any rank-capacity dispatch of the ``MoELayer``s inside ``modules`` overflowed
    since the last call (an int32 device scalar, nothing read; None: no such layer); the
    layers' flags are cleared."""
    flags = [
        layer.rank_overflow
        for module in modules
        for layer in module.modules()
        if isinstance(layer, MoELayer) and layer.config.rank_capacity_factor is not None
    ]
    if not flags:
        return None
    taken = torch.stack(flags).amax()
    for flag in flags:
        flag.zero_()
    return taken


def set_sync_free(modules: Sequence[nn.Module], on: bool) -> None:
    """Turn the rank capacity of the ``MoELayer``s inside ``modules`` on, or off for a step run
    again dropless after an overflow."""
    for module in modules:
        for layer in module.modules():
            if isinstance(layer, MoELayer) and layer.config.rank_capacity_factor is not None:
                layer.sync_free = on


def take_aux_loss_logs(modules: Sequence[nn.Module]) -> list[AuxLossLog]:
    """What each ``MoELayer`` inside ``modules`` logged since its log was last popped or taken
    (``AuxLossLog.take``: nothing summed), in module order, layers that logged nothing left
    out; the layers' logs are emptied, so they do not grow."""
    return [
        layer.aux_loss_log.take()
        for module in modules
        for layer in module.modules()
        if isinstance(layer, MoELayer) and len(layer.aux_loss_log)
    ]


class MoELayer(nn.Module):
    """Router, token dispatcher, grouped SwiGLU experts and optional shared expert."""

    rank_overflow: torch.Tensor  # a buffer (``__init__``)

    def __init__(
        self,
        config: MoEConfig,
        ep_group: dist.ProcessGroup | None = None,
        layer_index: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_index = layer_index
        self.dispatcher = TokenDispatcher(config.num_experts, ep_group, config.link)
        self.router = Router(
            config.hidden_size,
            config.num_experts,
            config.top_k,
            config.score_function,
            seed=seed,
            layer_index=layer_index,
            init_std=config.init_std,
            router_dtype=config.router_dtype,
            pre_softmax=config.pre_softmax,
        )
        local = self.dispatcher.num_local_experts
        self.experts = GroupedExperts(
            config.hidden_size,
            config.ffn_hidden_size,
            num_local_experts=local,
            first_expert=self.dispatcher.ep_rank * local,
            seed=seed,
            layer_index=layer_index,
            init_std=config.init_std,
            recompute_activation=config.recompute_activation,
        )
        self.shared_expert: SwiGLUMLP | None = None
        if config.shared_expert_intermediate_size is not None:
            self.shared_expert = SwiGLUMLP(
                config.hidden_size,
                config.shared_expert_intermediate_size,
                seed,
                "shared_expert",
                layer_index,
                init_std=config.init_std,
            )
        self.aux_loss_scale = 1.0
        self.aux_loss_log = AuxLossLog()
        # a rank capacity (moe.rank_capacity): on unless a step runs again without it; its
        # dispatches' overflow, kept on the device until the step's one check (take_overflow)
        self.sync_free = config.rank_capacity_factor is not None
        self.register_buffer("rank_overflow", torch.zeros((), dtype=torch.int32), persistent=False)
        self._lanes = LaneExchanges(self.dispatcher)  # per lane size

    def describe(self) -> str:
        """One line for logs and outputs: experts, EP size, and whether the emulated link is on."""
        c = self.config
        return (
            f"MoE layer {self.layer_index}: {c.num_experts} experts, top-{c.top_k} "
            f"{c.score_function}{'' if c.pre_softmax else ' renormalised'}, "
            f"{self.dispatcher.describe()}"
        )

    @property
    def num_shared(self) -> int:
        return 0 if self.shared_expert is None else 1

    def node_plan(self) -> WavePlan:
        """The five nodes (module docstring): route, a ``Fork`` of one branch (dispatch,
        experts, combine), finish, so that what route leaves for finish (the shared expert's
        input, the combine weights, and any leading tensor such as a residual) goes around the
        all-to-all nodes instead of through them; ``.in_waves(k)`` gives ``wave_plan(k)``.
        Experts and finish declare Megatron's CUDA-graph module ``moe`` (``graph_eager``)."""
        # dispatch reads its split sizes: dropless, unless a rank capacity keeps them on device
        dropless = self.config.capacity_factor is None and not self.sync_free
        experts = Graphable(("moe",), tuple(self.experts.parameters()), eager=self.graph_eager)
        shared = () if self.shared_expert is None else tuple(self.shared_expert.parameters())
        finish = Graphable(("moe",), shared, eager=self.graph_eager)
        branch = (
            Node("dispatch", NodeKind.COMM, self._dispatch, reads_host=dropless),
            Node("experts", NodeKind.COMPUTE, self._experts, graphable=experts),
            Node("combine", NodeKind.COMM, self._combine),
        )
        return WavePlan(
            [
                Node("route", NodeKind.COMPUTE, pass_leading(self._route, 1)),
                Fork((branch,)),
                Node(
                    "finish",
                    NodeKind.COMPUTE,
                    pass_leading(self._finish, self.num_shared + 2),
                    graphable=finish,
                ),
            ],
            self.wave_plan,
            MoEState,
        )

    def graph_eager(self) -> str | None:
        """Why the experts and finish nodes run eager under ``--cuda-graph-modules moe`` now
        (None: they are captured): their shapes are static only with a rank capacity (a step
        run again without it after an overflow runs them eager)."""
        if self.sync_free:
            return None
        if self.config.rank_capacity_factor is not None:
            return "a step run again dropless after an overflow: shapes follow the routing"
        return (
            "dropless without --moe-expert-rank-capacity-factor: the experts' shapes "
            "follow the routing"
        )

    def wave_plan(self, waves: int) -> list[Node | Fork]:
        """The layer with its all-to-alls in ``waves`` expert groups (``megapipe.moe.waves``):
        route, a ``Fork`` of (dispatch g, experts g, combine g) per group, finish. Its results
        are bitwise those of ``node_plan``."""
        if waves == 1:
            return list(self.node_plan())
        if self.config.rank_capacity_factor is not None:
            raise NotImplementedError(
                "a MoE layer with a rank capacity (sync-free dispatch) "
                "does not run in waves: its all-to-alls are not split"
            )
        nodes = WaveNodes(WaveDispatch(self.dispatcher, waves), self.experts)
        branches = tuple(
            (
                Node(
                    f"dispatch{g}",
                    NodeKind.COMM,
                    nodes.dispatch(g),
                    reads_host=g == 0 and self.config.capacity_factor is None,
                ),
                Node(f"experts{g}", NodeKind.COMPUTE, nodes.experts(g)),
                Node(f"combine{g}", NodeKind.COMM, nodes.combine(g)),
            )
            for g in range(nodes.count)
        )
        finish = pass_leading(self._finish, self.num_shared + 1 + nodes.count)
        return [
            Node("route", NodeKind.COMPUTE, pass_leading(nodes.route(self._route), 1)),
            Fork(branches),
            Node("finish", NodeKind.COMPUTE, finish),
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_nodes(self.node_plan(), (x,))[0]

    def _route(
        self,
        state: MoEState,
        tensors: tuple[torch.Tensor, ...],
        relabel: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, ...]:
        (x,) = tensors
        hidden = self.config.hidden_size
        if x.dim() not in (2, 3) or x.shape[-1] != hidden:
            raise ValueError(
                f"MoE layer input has shape {tuple(x.shape)}; "
                f"expected [b, s, {hidden}] or [t, {hidden}]"
            )
        tokens = x.reshape(-1, hidden)
        if tokens.shape[0] == 0:
            raise ValueError(
                f"MoE layer {self.layer_index} got an empty microbatch "
                f"(input shape {tuple(x.shape)})"
            )
        c = self.config
        if not state.recomputing:  # once per forward: a recompute (recompute.full) re-runs this
            state.aux_loss_scale = self.aux_loss_scale
        labels = None
        if relabel is not None:  # the label of each expert, for an expert-group order
            labels = relabel(torch.arange(c.num_experts, device=tokens.device))
        capacity = c.capacity(tokens.shape[0])
        routed = self.router(
            tokens, capacity, labels, (c.aux_loss_coeff, c.z_loss_coeff), state.aux_loss_scale
        )
        if not state.recomputing:
            self.aux_loss_log.record(routed.aux)
        state.input_shape = x.shape
        state.row_choice = routed.row_choice
        state.choice_rows = routed.choice_rows
        state.rows_per_expert = routed.counts  # per expert label; with a capacity, all of it
        if capacity is not None:
            state.rows_per_expert = torch.full_like(routed.counts, capacity)
        state.capacity = capacity
        rows = self._place_sends(state, routed.rows)
        shared = (tokens,) if self.shared_expert is not None else ()
        return shared + (routed.probs, rows)

    def _place_sends(self, state: MoEState, rows: torch.Tensor) -> torch.Tensor:
        """With a rank capacity: the sending side of the dispatch, in route (device work on
        the compute stream, so the dispatch node holds only its all-to-alls): the rows in their
        lanes, their way back and the overflow, ORed into ``rank_overflow``. Else ``rows``."""
        if not self.sync_free:
            state.lane = None
            return rows
        factor = self.config.rank_capacity_factor
        assert factor is not None and state.rows_per_expert is not None  # sync_free; route
        n = rows.shape[0]
        exchange = self._lanes(lane_rows(n, factor, self.dispatcher.ep_size))
        sends = exchange.place_sends(state.rows_per_expert, n)
        self.rank_overflow.bitwise_or_(sends.overflow.to(torch.int32))
        state.lane, state.send_counts, state.return_index = (
            exchange.lane,
            sends.counts,
            sends.return_index,
        )
        return gather_rows(rows, sends.send_index)

    def _dispatch(
        self, state: MoEState, tensors: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...]:
        (rows,) = tensors
        if state.lane is not None:  # fixed-size lanes, counts on the device (moe.rank_capacity)
            assert state.send_counts is not None  # route wrote it with the lane
            received, state.received_counts = self._lanes(state.lane).exchange(
                rows, state.send_counts
            )
            return (received,)
        state.received_counts = None
        assert state.rows_per_expert is not None  # route wrote it
        expert_rows, state.dispatch_splits = self.dispatcher.dispatch(
            rows, state.rows_per_expert, state.capacity
        )
        return (expert_rows,)

    def _experts(
        self, state: MoEState, tensors: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...]:
        (expert_rows,) = tensors
        if state.lane is not None:  # the received lanes into expert order and back
            assert state.received_counts is not None  # dispatch wrote it with the lane
            expert_index, received_index, offsets = self._lanes(state.lane).expert_order(
                state.received_counts
            )
            out = self.experts(
                gather_rows(expert_rows, expert_index), None, state=state, offsets=offsets
            )
            return (gather_rows(out, received_index),)
        splits = state.dispatch_splits
        assert splits is not None  # dispatch wrote it
        return (
            self.experts(
                expert_rows,
                splits.tokens_per_local_expert,
                state=state,
                offsets=splits.local_offsets,
            ),
        )

    def _combine(
        self, state: MoEState, tensors: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...]:
        (expert_out,) = tensors
        if state.lane is not None:
            return (self._lanes(state.lane).return_exchange(expert_out),)
        assert state.dispatch_splits is not None  # dispatch wrote it
        return (self.dispatcher.combine(expert_out, state.dispatch_splits),)

    def _finish(
        self, state: MoEState, tensors: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...]:
        shared, probs = tensors[: self.num_shared], tensors[self.num_shared]
        parts = tensors[self.num_shared + 1 :]  # one per wave of a plan in waves
        rows = parts[0] if len(parts) == 1 else torch.cat(parts)
        if state.lane is not None:  # the returned lanes back into this rank's row order
            assert state.return_index is not None  # route wrote it with the lane
            rows = gather_rows(rows, state.return_index)
        # route wrote them
        assert state.row_choice is not None and state.choice_rows is not None
        assert state.input_shape is not None
        out = unpermute_tokens(rows, probs, state.row_choice, state.choice_rows)
        if self.shared_expert is not None:
            out = out + self.shared_expert(shared[0])
        return (out.reshape(state.input_shape),)
