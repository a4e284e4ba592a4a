"""When a run stops early and cleanly: Megatron's ``--exit-signal-handler``, ``--exit-interval``
and ``--exit-duration-in-mins``.

A scheduler that preempts a job sends SIGTERM first (Slurm's ``--signal``). With
``--exit-signal-handler`` the handler only records the signal; the loop asks ``ExitPolicy.reason``
after every step, the step in flight finishes, the run saves and exits 0. Signals reach ranks at
slightly different times, and the duration is measured by each rank's own clock, so those two
flags are agreed on with one tiny all-reduce (max) per step: every rank stops after the same
iteration. Without either flag no collective is added. ``--exit-interval`` needs none: every
rank counts the same iterations.
"""

from __future__ import annotations

import signal
import time
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from megapipe.train.config.job_config import FailureConfig


class ExitPolicy:
    """Decides, after each iteration, whether to save and stop (``reason``); a context manager
    that installs the SIGTERM handler and restores the previous one."""

    def __init__(self, config: FailureConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.started = time.monotonic()
        self.signalled: str | None = None
        self._previous: Any = None

    def __enter__(self) -> ExitPolicy:
        if self.config.exit_signal_handler:
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.config.exit_signal_handler:
            signal.signal(signal.SIGTERM, self._previous)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signalled = signal.Signals(signum).name

    def reason(self, iteration: int) -> str | None:
        """Why to stop after ``iteration`` (None: go on); the same answer on every rank."""
        config, duration = self.config, self.config.exit_duration_in_mins
        if config.exit_signal_handler or duration is not None:
            minutes = (time.monotonic() - self.started) / 60
            late = duration is not None and minutes >= duration
            flags = torch.tensor(
                [float(self.signalled is not None), float(late)], device=self.device
            )
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            if flags[0] > 0:
                return f"{self.signalled or 'SIGTERM'} received"
            if flags[1] > 0:
                return f"--exit-duration-in-mins={duration:g} reached"
        if config.exit_interval and iteration % config.exit_interval == 0:
            return f"--exit-interval={config.exit_interval} reached"
        return None
