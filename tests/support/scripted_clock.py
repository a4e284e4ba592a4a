"""A clock the test controls, for the overlap's auto mode (``pipeline.overlap_auto``)."""

from megapipe.pipeline.overlap_auto import COUNTED, TRIAL


class ScriptedClock:
    """Moves by ``seconds[combined]`` over each counted step of the trials, in their order
    (the auto mode reads the clock at the start and the end of each counted step)."""

    def __init__(self, seconds: dict[bool, float]) -> None:
        self.seconds, self.now, self.calls = seconds, 0.0, 0

    def __call__(self) -> float:
        if self.calls % 2 == 1:  # the end of a counted step
            self.now += self.seconds[TRIAL[COUNTED[self.calls // 2 % len(COUNTED)]]]
        self.calls += 1
        return self.now
