"""The parallel grid's sizes, validated before any process group exists.

``ParallelConfig(pp, dp, ep, tp)`` describes a world of ``pp * dp * tp`` ranks. Expert
parallelism folds into the tensor- and data-parallel ranks as in Megatron (with expert tensor
parallelism 1): the ``tp * dp`` ranks of one pipeline position are cut into blocks of ``ep``
ranks that share their experts by all-to-all, so ``ep`` must divide ``tp * dp``. Every rule is
checked here, so a bad configuration fails with a message naming the value and the rule instead
of a hang inside ``dist.new_group``.
"""

from __future__ import annotations

from dataclasses import dataclass


def _check_size(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {name}={value}")


@dataclass(frozen=True)
class ParallelConfig:
    """Sizes of the pipeline (pp), data (dp), expert (ep, folded into tp x dp) and tensor (tp)
    dimensions."""

    pp: int = 1
    dp: int = 1
    ep: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "ep", "tp"):
            _check_size(name, getattr(self, name))
        if (self.tp * self.dp) % self.ep != 0:
            if self.tp == 1:
                raise ValueError(
                    f"ep={self.ep} must divide dp={self.dp}: expert parallelism folds into the "
                    f"data-parallel ranks (dp % ep = {self.dp % self.ep})"
                )
            raise ValueError(
                f"ep={self.ep} must divide tp x dp = {self.tp} x {self.dp}: expert parallelism "
                "folds into the tensor- and data-parallel ranks"
            )

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def expert_dp(self) -> int:
        """Size of an expert-data-parallel group: the replicas of one set of experts."""
        return self.tp * self.dp // self.ep

    @classmethod
    def from_world_size(
        cls, world_size: int, pp: int = 1, ep: int = 1, tp: int = 1
    ) -> ParallelConfig:
        """The config with ``dp = world_size // (pp * tp)``; rejects a world that pp x tp does
        not divide."""
        _check_size("world_size", world_size)
        _check_size("pp", pp)
        _check_size("tp", tp)
        if world_size % (pp * tp) != 0:
            if tp == 1:
                raise ValueError(
                    f"world_size={world_size} is not divisible by pp={pp} "
                    f"(world = pp x dp; world_size % pp = {world_size % pp})"
                )
            raise ValueError(
                f"world_size={world_size} is not divisible by pp x tp = {pp} x {tp} "
                f"(world = pp x dp x tp)"
            )
        return cls(pp=pp, dp=world_size // (pp * tp), ep=ep, tp=tp)

    def check_world_size(self, world_size: int) -> None:
        """Raise unless this grid covers exactly ``world_size`` ranks."""
        if world_size != self.world_size:
            grid = (
                f"pp x dp = {self.pp} x {self.dp}"
                if self.tp == 1
                else f"pp x dp x tp = {self.pp} x {self.dp} x {self.tp}"
            )
            raise ValueError(f"world_size={world_size} does not match {grid} = {self.world_size}")
