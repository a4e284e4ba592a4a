"""Overlap that never loses: time plain and combined training steps on this run's own hardware,
keep the faster, check again now and then.

Plain and combined steps are bitwise equal in every schedule (the combined schedule is the plain
one with its actions paired, and a step starts and ends with nothing in flight), so a run may
switch between two executors, one per schedule, at any iteration boundary without changing its
numbers. ``OverlapAuto`` holds both and decides which runs the next training step:

- a trial runs ``TRIAL`` (3 plain steps, then 3 combined); the first step of each mode warms up
  (allocator, kernels, graph capture) and is not counted, a mode's time is the faster of its
  other two;
- after the trial's last step every rank all-reduces the two times (MAX over the group: the
  slowest rank sets the pace of a synchronous step) at the same point, outside any step, so all
  ranks keep the same mode; combined is kept only when strictly faster;
- a trial starts at the first training step and again every ``interval`` steps (0: never again).

``clock`` is injectable (tests script it); on CUDA a counted step is bracketed by device
synchronisations, so the times are the device's, not the host's issue times.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megapipe.pipeline.executor import PipelineExecutor

TRIAL = (False, False, False, True, True, True)
"""The modes of a trial's steps in order (True: combined); the first of each mode warms up."""
COUNTED = tuple(i for i in range(len(TRIAL)) if i not in (0, len(TRIAL) // 2))
"""The positions in a trial whose step times count (the others warm up)."""


@dataclass
class _Trial:
    """The times counted so far in the current trial (seconds per mode)."""

    first_step: int
    times: dict[bool, list[float]] = field(default_factory=lambda: {False: [], True: []})


class OverlapAuto:
    """Chooses between ``plain`` and ``combined`` executors by timing them (module docstring).

    ``interval``: training steps from one trial's start to the next (0: one trial only);
    ``groups``: process groups whose MAX, taken over each in turn, reaches every rank of the run
    (default: the world; e.g. pp then dp for a grid); ``device``: where the all-reduce's tensor
    lives and what is synchronised around a counted step.
    """

    def __init__(
        self,
        plain: PipelineExecutor,
        combined: PipelineExecutor,
        interval: int,
        clock: Callable[[], float] = time.perf_counter,
        groups: Sequence[dist.ProcessGroup | None] = (None,),
        device: torch.device | str = "cpu",
    ) -> None:
        if interval < 0 or 0 < interval < len(TRIAL):
            raise ValueError(
                f"interval={interval} must be 0 (one trial) or at least the trial's "
                f"{len(TRIAL)} steps"
            )
        self.executors = {False: plain, True: combined}
        self.interval = interval
        self.clock = clock
        self.groups = tuple(groups)
        self.device = torch.device(device)
        self.combined = False  # the mode kept between trials (before the first: plain)
        self.decisions: list[tuple[bool, float, float]] = []  # (on, plain s, combined s)
        self._steps = 0  # training steps finished
        self._trial: _Trial | None = None
        self._started: float | None = None

    @property
    def executor(self) -> PipelineExecutor:
        """The executor of the next training step."""
        return self.executors[self.mode]

    @property
    def mode(self) -> bool:
        """Whether the next training step runs combined."""
        position = self._trial_position()
        return TRIAL[position] if position is not None else self.combined

    def _trial_position(self) -> int | None:
        """Where the next step falls in a trial (None: outside any)."""
        since = self._steps % self.interval if self.interval else self._steps
        return since if since < len(TRIAL) else None

    def start(self) -> None:
        """Call right before a training step: a counted step starts its clock here."""
        position = self._trial_position()
        if position not in COUNTED:  # outside a trial, or a warm-up
            self._started = None
            return
        self._synchronize()
        self._started = self.clock()

    def finish(self) -> str | None:
        """Call right after the training step ``start`` began; at a trial's end the ranks agree
        on the mode (one all-reduce) and the decision's log line is returned."""
        position = self._trial_position()
        if position == 0:
            self._trial = _Trial(first_step=self._steps + 1)
        if self._started is not None:
            self._synchronize()
            assert self._trial is not None and position is not None
            self._trial.times[TRIAL[position]].append(self.clock() - self._started)
            self._started = None
        self._steps += 1
        if position != len(TRIAL) - 1:
            return None
        return self._decide()

    def _decide(self) -> str:
        trial = self._trial
        assert trial is not None
        local = torch.tensor(
            [min(trial.times[False]), min(trial.times[True])],
            dtype=torch.float64,
            device=self.device,
        )
        if dist.is_initialized():
            for group in self.groups:
                dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        plain, combined = (float(t) for t in local.tolist())
        self.combined = combined < plain
        self.decisions.append((self.combined, plain, combined))
        self._trial = None
        then = (
            f"next check at step {self._steps + self.interval - len(TRIAL) + 1}"
            if self.interval
            else "no further check"
        )
        return (
            f"overlap auto: {'on' if self.combined else 'off'} (combined {combined:.4g} s "
            f"vs plain {plain:.4g} s per step, slowest rank, steps {trial.first_step}-"
            f"{self._steps}; {then})"
        )

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Stop both executors' communication streams."""
        for executor in self.executors.values():
            executor.close()
