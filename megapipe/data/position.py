"""What a train-batch sampler saves and resumes: how many samples the run has consumed, and the
seed of its sampling permutation (a checkpoint resumed with another seed is refused)."""

from __future__ import annotations

from megapipe.data.errors import DataError


class SamplingPosition:
    """``state_dict`` / ``load_state_dict`` of a sampler (a dataclass with these two fields)."""

    seed: int
    consumed_samples: int

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state["seed"]) != self.seed:
            raise DataError(
                f"the checkpoint's sampling was seeded with {int(state['seed'])}, this run "
                f"with --seed={self.seed}"
            )
        self.consumed_samples = int(state["consumed_samples"])
