"""``--profile-trace``: trace iterations N..M of every rank and write them as one trace.

``RunProfiler`` is the training loop's side of it. Outside N..M it does nothing (the executor
records no action or wait span). In N..M each step runs profiled (``ProfileOptions``); after it
the rank keeps its spans as plain tuples. After step M every rank passes one barrier, reads its
clock and sends its spans to rank 0 in one ``gather_object`` (outside the step); rank 0 builds the
document (``run_trace.build_trace``) and writes it. ``--use-pytorch-profiler`` also runs
``torch.profiler`` over the same steps, with every node span opened as a ``record_function``
range, and writes one PyTorch trace per rank next to ours (``torch_trace_path``).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megapipe.overlap.node_trace import NodeTrace
from megapipe.parallel.groups import RankCoordinates
from megapipe.pipeline.executor import StepResult
from megapipe.pipeline.step_profile import ProfileOptions
from megapipe.schedule import Schedule
from megapipe.train.config.job_config import JobConfig
from megapipe.train.observe.run_trace import RankRecord, build_trace


def torch_trace_path(path: str, rank: int) -> str:
    """Rank ``rank``'s PyTorch profiler trace: ``out.json`` -> ``out.torch-rank3.json``."""
    stem, ext = os.path.splitext(path)
    return f"{stem}.torch-rank{rank}{ext or '.json'}"


class RunProfiler:
    """Traces the iterations ``--profile-step-start``..``--profile-step-end`` of one rank
    (at ``coordinates`` in the grid, running ``schedule`` on ``device``)."""

    def __init__(
        self,
        config: JobConfig,
        schedule: Schedule,
        device: torch.device,
        coordinates: RankCoordinates,
        say: Callable[[str], None],
    ) -> None:
        log = config.logging
        self.config, self.schedule, self.device = config, schedule, device
        self.coordinates, self.say = coordinates, say
        self.path = log.profile_trace
        self.first, self.last = log.profile_first, log.profile_last
        self.use_torch = log.pytorch_profiler
        self.rows: list[tuple] = []
        self._torch: Any = None

    def traces(self, iteration: int) -> bool:
        return self.path is not None and self.first <= iteration <= self.last

    def options(self, iteration: int) -> ProfileOptions | None:
        """How to run iteration ``iteration`` (1-based): profiled inside N..M, else None."""
        if not self.traces(iteration):
            return None
        if self.use_torch and self._torch is None:
            self._torch = _start_torch_profiler(self.device)
        return ProfileOptions(annotate=self.use_torch)

    def record(self, iteration: int, step: StepResult, sync: Any = None) -> None:
        """Keep what the profiled step recorded (resolving device spans, after the step), and
        the data-parallel collectives ``sync`` (``DataParallelSync``) recorded since
        ``open_dp_trace``."""
        if not self.traces(iteration):
            return
        spans = list(step.trace.spans) if step.trace is not None else []
        if sync is not None and sync.trace is not None:
            spans += sync.trace.spans
            sync.trace = None
        for s in spans:
            self.rows.append(
                (
                    iteration,
                    s.kind,
                    s.stream,
                    s.direction,
                    s.microbatch,
                    s.layer,
                    s.node,
                    s.start,
                    s.end,
                )
            )

    def open_dp_trace(self, iteration: int, sync: Any) -> None:
        """From now on record ``sync``'s collectives for iteration ``iteration`` when it is
        traced: called before the previous step's parameter gathers start (they serve this
        iteration's forwards) and again at the iteration's start."""
        if sync is not None and self.traces(iteration) and sync.trace is None:
            sync.trace = NodeTrace()

    def after(self, iteration: int) -> None:
        """After iteration ``iteration``: at M, stop the PyTorch profiler, gather, write."""
        if self.path is None or iteration != self.last:
            return
        rank = dist.get_rank()
        if self._torch is not None:
            self._torch.stop()
            self._torch.export_chrome_trace(torch_trace_path(self.path, rank))
            self._torch = None
        dist.barrier()
        mine = RankRecord(
            rank,
            self.coordinates.pp_rank,
            self.coordinates.dp_rank,
            socket.gethostname(),
            time.perf_counter(),
            self.rows,
        )
        everyone: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(mine, everyone, dst=0)
        self.rows = []
        if rank == 0:
            assert everyone is not None
            self._write(everyone)

    def _write(self, records: list[RankRecord]) -> None:
        parallel, schedule = self.config.parallel, self.config.schedule
        layout = {
            "pp": parallel.pp,
            "dp": parallel.dp,
            "ep": parallel.ep,
            "vpp": schedule.vpp,
            "world": parallel.world_size,
            "steps": [self.first, self.last],
            "num_microbatches": schedule.num_microbatches,
            "overlap": self.config.overlap.enabled,
            "device": self.device.type,
        }
        document = build_trace(records, self.schedule, layout)
        assert self.path is not None  # written by ``after`` on a traced run only
        with open(self.path, "w") as f:
            json.dump(document, f)
        extra = " and PyTorch profiler traces beside it" if self.use_torch else ""
        self.say(
            f"wrote profile trace {self.path} (iterations {self.first}-{self.last}, "
            f"{len(records)} ranks){extra}; read it with `megapipe trace summarize "
            f"{self.path}` or in ui.perfetto.dev"
        )

    def close(self) -> None:
        """Stop a PyTorch profiler left running (the run ended before M)."""
        if self._torch is not None:
            self._torch.stop()
            self._torch = None


def _start_torch_profiler(device: torch.device) -> Any:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    profiler = profile(activities=activities)
    profiler.start()
    return profiler
