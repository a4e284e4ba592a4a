"""AdamW over the flat gradient buffers: each rank's shard (the distributed optimizer) or all.

``FlatAdamW`` steps the ``Piece`` s of this rank (``grad_buffers``): with
``--use-distributed-optimizer`` the parts of the parameters inside its shards of the buckets,
so the fp32 main weights and the Adam moments exist once per data-parallel group (experts once
per expert-DP group) instead of once per rank; without it, every whole parameter (what
``--overlap-grad-reduce`` alone needs). The step is torch's AdamW (fused on CUDA, foreach on
CPU) on 1-D views, with each piece's gradient a view of the reduced gradient buffer: AdamW is
element-wise, so the numbers are those of AdamW on whole parameters.

- fp32: a piece's main weight is the parameter's own memory (a view of the parameter buffer),
  updated in place;
- bf16 (``mixed_precision``): a float32 copy per piece, rounded into the parameter buffer after
  each step (Megatron's fp32 main weights).

Sharded, the other ranks' parts of the parameters arrive by the all-gather that
``DataParallelSync.start_param_gather`` issues after the step. The global gradient norm of a
sharded optimizer sums each rank's shards and adds them over the DP (expert-DP) group, then over
EP and PP as ``optim.global_grad_norm`` does; clipping scales the shards.

The state per piece (``state_pieces``): ``step``, ``exp_avg``, ``exp_avg_sq`` and, with bf16,
``main_param``, all made at construction (zeros, step 0: what AdamW creates at its first step),
so a checkpoint loads into a fresh optimizer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megapipe.pipeline.grad_sync import is_expert_param
from megapipe.train.optim.adamw import adamw, norm_of_sums, scale_grads, sum_of_squares
from megapipe.train.optim.dp_sync import DataParallelSync
from megapipe.train.optim.grad_buffers import FlatBuffer, Piece

STATE_FIELDS = ("step", "exp_avg", "exp_avg_sq", "main_param")


@dataclass(frozen=True)
class _Slot:
    """One piece in the optimizer: its main weight, gradient and model view."""

    piece: Piece
    buffer: FlatBuffer
    main: torch.Tensor
    grad: torch.Tensor
    model: torch.Tensor  # where the parameter's bits live (the main itself in fp32)
    counts_in_norm: bool


class FlatAdamW:
    """AdamW on ``buffers`` ({stage: flat buffers}; module docstring). ``norm_stages``: the
    stages whose gradients count in the norm (one copy of each DualPipe model part); the last
    stage's copy of a tied embedding (Megatron's ``shared`` mark) never counts."""

    def __init__(
        self,
        buffers: dict[int, list[FlatBuffer]],
        sync: DataParallelSync,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        mixed_precision: bool = False,
        norm_stages: Sequence[int] | None = None,
    ) -> None:
        self.sync = sync
        self.mixed_precision = mixed_precision
        self.sharded = sync.sharded
        counted = set(buffers if norm_stages is None else norm_stages)
        self.buffers = [b for stage in sorted(buffers) for b in buffers[stage]]
        self.slots: list[_Slot] = []
        for stage in sorted(buffers):
            for buffer in buffers[stage]:
                for piece in buffer.pieces():
                    model = self._model_view(buffer, piece)
                    main = model.detach().float() if mixed_precision else model
                    counts = stage in counted and not getattr(piece.param, "shared", False)
                    self.slots.append(
                        _Slot(
                            piece, buffer, main, buffer.grad[piece.start : piece.end], model, counts
                        )
                    )
        self.optimizer = adamw(
            [s.main for s in self.slots],
            [s.piece.param.ndim for s in self.slots],
            lr,
            weight_decay,
            betas,
            eps,
        )
        fused = any(group.get("fused") for group in self.optimizer.param_groups)
        for slot in self.slots:
            self.optimizer.state[slot.main] = self._fresh_state(slot.main, fused)

    def _model_view(self, buffer: FlatBuffer, piece: Piece) -> torch.Tensor:
        if buffer.data is not None:
            return buffer.data[piece.start : piece.end]
        return piece.param.detach().view(-1)[piece.lo : piece.hi]

    def _fresh_state(self, main: torch.Tensor, fused: bool) -> dict[str, torch.Tensor]:
        state = {
            "step": torch.zeros((), dtype=torch.float32, device=main.device if fused else "cpu"),
            "exp_avg": torch.zeros_like(main),
            "exp_avg_sq": torch.zeros_like(main),
        }
        if self.mixed_precision:
            state["main_param"] = main
        return state

    # ------------------------------------------------------------- the optimizer's surface
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffers (kept allocated: the parameters' ``main_grad`` views)."""
        for buffer in self.buffers:
            buffer.zero_grad()
        for slot in self.slots:
            slot.piece.param.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on this rank's pieces with their reduced (and clipped) gradients; with bf16,
        the parameters become the new main weights rounded to bf16."""
        for slot in self.slots:
            slot.main.grad = slot.grad
        self.optimizer.step()
        for slot in self.slots:
            slot.main.grad = None
        if self.mixed_precision:
            self.copy_main_to_model()

    @torch.no_grad()
    def copy_main_to_model(self) -> None:
        if self.mixed_precision and self.slots:
            torch._foreach_copy_([s.model for s in self.slots], [s.main for s in self.slots])

    def state_pieces(self) -> Iterator[tuple[Piece, dict[str, torch.Tensor]]]:
        """Every piece with its optimizer state (1-D tensors over its elements; ``step`` 0-d)."""
        for slot in self.slots:
            yield slot.piece, self.optimizer.state[slot.main]

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (moments, step counters, main weights)."""
        return sum(
            t.numel() * t.element_size() for _, state in self.state_pieces() for t in state.values()
        )

    # ------------------------------------------------------------- norm and clipping
    def grad_norm(
        self,
        pp_group: dist.ProcessGroup | None,
        ep_group: dist.ProcessGroup | None,
        device: torch.device,
    ) -> float:
        """The global L2 norm of the gradients, each parameter counted once (module docstring);
        one host read."""
        sums = []
        for expert in (False, True):
            total = sum_of_squares(
                (
                    s.grad
                    for s in self.slots
                    if s.counts_in_norm and is_expert_param(s.piece.param) == expert
                ),
                device,
            )
            if self.sharded:
                total = self.sync.run_collective(_sum_over, total, self._group(expert))
            sums.append(total)
        return norm_of_sums(sums[0], sums[1], pp_group, ep_group)

    def _group(self, expert: bool) -> dist.ProcessGroup | None:
        """The group the shards of one kind are spread over (every rank of it joins the sum,
        also one whose shards hold none of it); None: this rank has no such buffer."""
        kind = "expert" if expert else "dense"
        return next((b.group for b in self.buffers if b.kind == kind), None)

    def clip(self, max_norm: float, total_norm: float) -> float:
        """Scale every piece's gradient so the global norm is at most ``max_norm``; the
        scale applied (1.0 when no clipping was needed or ``max_norm`` is 0)."""
        return scale_grads([s.grad for s in self.slots], max_norm, total_norm)


def _sum_over(total: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total
