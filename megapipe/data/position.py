"""What the two train-batch samplers (raw text, Megatron's indexed datasets) share: the shape of
an iteration on this data-parallel rank (global batch, microbatch, dp, this rank), and what they
save and resume: how many samples the run has consumed and the seed of its sampling permutation
(a checkpoint resumed with another seed is refused)."""

from __future__ import annotations

from megapipe.data.errors import DataError


class SamplingPosition:
    """Checks, ``num_microbatches`` and ``state_dict`` / ``load_state_dict`` of a sampler (a
    dataclass with these fields; it calls ``check_batch_shape`` from ``__post_init__``)."""

    global_batch_size: int
    micro_batch_size: int
    dp: int
    dp_rank: int
    seed: int
    consumed_samples: int

    def check_batch_shape(self) -> None:
        if self.global_batch_size % (self.micro_batch_size * self.dp) != 0:
            raise DataError(
                f"global_batch_size={self.global_batch_size} is not divisible by "
                f"micro_batch_size x dp = {self.micro_batch_size} x {self.dp}"
            )
        if not 0 <= self.dp_rank < self.dp:
            raise DataError(f"dp_rank={self.dp_rank} outside [0, dp={self.dp})")

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state["seed"]) != self.seed:
            raise DataError(
                f"the checkpoint's sampling was seeded with {int(state['seed'])}, this run "
                f"with --seed={self.seed}"
            )
        self.consumed_samples = int(state["consumed_samples"])
