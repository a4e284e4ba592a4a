"""AdamW, the learning-rate schedule, and gradient clipping by the global norm over PP, EP and DP.

Global norm: every parameter of the model counts once. After the gradient all-reduce, dense
parameters are identical on the DP ranks of one pipeline stage, and expert parameters are
identical on the expert-DP ranks (they are sharded over EP). So each rank sums the squares of
its dense gradients and of its expert gradients; the expert sum is all-reduced over EP (the
shards), then the total over PP (the stages). Every rank ends with the same norm and clips the
same way, with no reduction over DP at all.

Gradients are read where they accumulate (``precision.main_grad``): the float32 ``main_grad`` of a
bf16 model, else ``.grad``. The sums run on the gradients' device, in float64, parameter after
parameter (no host sync per parameter); the one host read is the final norm, which the
clipping decision and the log need once per step, after the backward.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from megapipe.pipeline.grad_sync import is_expert_param
from megapipe.precision.main_grad import accumulated_grad
from megapipe.train.optim.mixed_precision import MixedPrecisionAdamW


class WithParamGroups(Protocol):
    """An optimizer whose learning rate ``LRSchedule.step`` sets: torch's, or one of megapipe's
    (``MixedPrecisionAdamW``, ``FlatAdamW``)."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...


class _WithState(Protocol):
    @property
    def state(self) -> Mapping[Any, Mapping[str, Any]]: ...


def optimizer_state_bytes(optimizer: object) -> int:
    """Bytes of optimizer state this rank holds: AdamW's moments and step counters, and fp32
    main weights where they are a copy (bf16); not the model's parameters. An optimizer that
    counts its own (``state_bytes()``, the distributed optimizer's shards) says so itself; a
    torch AdamW holds nothing before its first step."""
    own = getattr(optimizer, "state_bytes", None)
    if callable(own):
        return int(own())
    # one that does not count its own state holds it per parameter, as torch's optimizers do
    states = cast(_WithState, optimizer).state
    return sum(
        t.numel() * t.element_size()
        for state in states.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )


def unique_params(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    """Parameters of ``modules`` in order, each once (a shared tensor is not counted twice)."""
    seen: set[int] = set()
    out = []
    for module in modules:
        for param in module.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                out.append(param)
    return out


def build_optimizer(
    modules: Sequence[nn.Module],
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    mixed_precision: bool = False,
) -> torch.optim.AdamW | MixedPrecisionAdamW:
    """AdamW over ``modules``; no weight decay on biases and norm weights (1-D tensors).

    Fused on CUDA; the multi-tensor (foreach) path on CPU. ``mixed_precision``: the modules are
    bf16 with float32 ``main_grad`` (``cast_to_bf16``), and AdamW runs on float32 main weights
    (``MixedPrecisionAdamW``).
    """
    params = [p for p in unique_params(modules) if p.requires_grad]
    return adamw(
        params,
        [p.ndim for p in params],
        lr,
        weight_decay,
        betas,
        eps,
        MixedPrecisionAdamW if mixed_precision else torch.optim.AdamW,
    )


def adamw(
    tensors: Sequence[torch.Tensor],
    ndims: Sequence[int],
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    cls: type = torch.optim.AdamW,
) -> torch.optim.AdamW:
    """``cls`` (AdamW or a subclass) over ``tensors``: weight decay only on those whose
    parameter has 2 or more dimensions (``ndims``: a tensor may be a 1-D view of one); fused on
    CUDA, the multi-tensor (foreach) path on CPU."""
    decay = [t for t, ndim in zip(tensors, ndims) if ndim >= 2]
    no_decay = [t for t, ndim in zip(tensors, ndims) if ndim < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    on_cuda = bool(tensors) and all(t.is_cuda for t in tensors)
    kwargs = {"fused": True} if on_cuda else {"foreach": True}
    return cls(groups, lr=lr, betas=betas, eps=eps, **kwargs)


@dataclass
class LRSchedule:
    """Linear warmup from 0 to ``lr`` over ``warmup_iters``, then decay to ``min_lr``.

    ``lr_at(it)`` for iteration ``it`` (0-based, the step being taken): during warmup
    ``lr * (it + 1) / warmup_iters``; then, with progress ``p`` = (it - warmup) / decay_iters
    clamped to [0, 1], cosine ``min + (lr - min) * (1 + cos(pi p)) / 2``, linear
    ``lr - (lr - min) * p``, or constant ``lr``.
    """

    lr: float
    min_lr: float
    warmup_iters: int
    decay_iters: int
    style: str = "cosine"
    iteration: int = 0

    def __post_init__(self) -> None:
        if self.style not in ("cosine", "linear", "constant"):
            raise ValueError(f"lr decay style {self.style!r} must be cosine, linear or constant")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need 0 <= min_lr={self.min_lr} <= lr={self.lr}")
        if self.warmup_iters < 0 or self.decay_iters < 1:
            raise ValueError(
                f"warmup_iters={self.warmup_iters} must be >= 0 and decay_iters="
                f"{self.decay_iters} >= 1"
            )

    def lr_at(self, iteration: int) -> float:
        if iteration < self.warmup_iters:
            return self.lr * (iteration + 1) / self.warmup_iters
        if self.style == "constant":
            return self.lr
        progress = min(1.0, (iteration - self.warmup_iters) / self.decay_iters)
        if self.style == "linear":
            return self.lr - (self.lr - self.min_lr) * progress
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def step(self, optimizer: WithParamGroups) -> float:
        """Set the learning rate of iteration ``self.iteration`` on ``optimizer``; advance."""
        lr = self.lr_at(self.iteration)
        for group in optimizer.param_groups:
            group["lr"] = lr
        self.iteration += 1
        return lr

    def state_dict(self) -> dict[str, Any]:
        return {
            "iteration": self.iteration,
            "lr": self.lr,
            "min_lr": self.min_lr,
            "warmup_iters": self.warmup_iters,
            "decay_iters": self.decay_iters,
            "style": self.style,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])


def sum_of_squares(grads: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of ``grads`` in float64 on ``device``, added one tensor after another."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for grad in grads:
        total = total + grad.detach().double().pow(2).sum().to(device)
    return total


def global_grad_norm(
    params: Sequence[torch.Tensor],
    pp_group: dist.ProcessGroup | None = None,
    ep_group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> float:
    """The L2 norm of all gradients of the model, each parameter counted once (module docstring).

    ``params`` are the parameters this rank counts: its stages' parameters, each once (for
    DualPipe's mirrored stages, pass only one copy of each model part per pipeline).
    ``device``: where the sums and their all-reduces run (default: the gradients' device).
    """
    dense_grads, expert_grads = _grads(params, expert=False), _grads(params, expert=True)
    if device is None:
        device = next((g.device for g in dense_grads + expert_grads), torch.device("cpu"))
    return norm_of_sums(
        sum_of_squares(dense_grads, device),
        sum_of_squares(expert_grads, device),
        pp_group,
        ep_group,
    )


def norm_of_sums(
    dense: torch.Tensor,
    expert: torch.Tensor,
    pp_group: dist.ProcessGroup | None,
    ep_group: dist.ProcessGroup | None,
) -> float:
    """The global norm from this rank's sums of squares (module docstring): the expert sum
    all-reduced over EP, the total over PP; one host read."""
    if ep_group is not None and dist.get_world_size(ep_group) > 1:
        dist.all_reduce(expert, group=ep_group)
    total = dense + expert
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, group=pp_group)
    return float(total.sqrt())


def _grads(params: Iterable[torch.Tensor], expert: bool) -> list[torch.Tensor]:
    """The accumulated gradients of the expert (or dense) parameters among ``params``."""
    grads = [accumulated_grad(p) for p in params if is_expert_param(p) == expert]
    return [g for g in grads if g is not None]


def clip_grads(params: Sequence[torch.Tensor], max_norm: float, total_norm: float) -> float:
    """Scale the gradients of ``params`` so the global norm is at most ``max_norm``.

    Returns the scale applied (1.0 when no clipping was needed or ``max_norm`` is 0).
    """
    return scale_grads(
        [g for g in (accumulated_grad(p) for p in params) if g is not None], max_norm, total_norm
    )


def scale_grads(grads: Sequence[torch.Tensor], max_norm: float, total_norm: float) -> float:
    """Scale ``grads`` in place so the global norm ``total_norm`` becomes at most ``max_norm``;
    the scale applied (1.0 when no clipping was needed or ``max_norm`` is 0)."""
    if max_norm <= 0 or not math.isfinite(total_norm) or total_norm <= max_norm:
        return 1.0
    scale = max_norm / (total_norm + 1e-6)
    if grads:
        torch._foreach_mul_(list(grads), scale)
    return scale
