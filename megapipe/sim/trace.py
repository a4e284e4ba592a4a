"""Chrome-trace JSON of a simulated run, for Perfetto (ui.perfetto.dev) or chrome://tracing.

One process per rank with two threads: ``compute`` holds one slice per action (an OVERLAP
holds its pieces nested inside it) and ``comm`` holds the all-to-all pieces. One cost unit is
shown as one millisecond.
"""

from __future__ import annotations

import json

from ..pairing.timing import COMM, COMPUTE
from .programs import Segment
from .simulate import SimResult

_US_PER_UNIT = 1000.0
_TID = {COMPUTE: 0, COMM: 1}


def _slice(name: str, pid: int, tid: int, start: float, end: float, args: dict) -> dict:
    return {
        "name": name,
        "cat": "compute" if tid == _TID[COMPUTE] else "comm",
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": start * _US_PER_UNIT,
        "dur": (end - start) * _US_PER_UNIT,
        "args": args,
    }


def _segment_args(seg: Segment) -> dict:
    args = {
        "action": str(seg.action),
        "stage": seg.action.stage,
        "microbatch": seg.action.microbatch,
    }
    if seg.layer is not None:
        args["layer"] = seg.layer
    return args


def trace_events(result: SimResult) -> list[dict]:
    """The trace events: process and thread names, then one complete ("X") event per slice."""
    events: list[dict] = []
    for rank in range(result.pp):
        events.append(
            {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}
        )
        events.append(
            {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}}
        )
        for stream, tid in _TID.items():
            events.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": rank,
                    "tid": tid,
                    "args": {"name": stream},
                }
            )
    for timed in result.timeline:
        nested = bool(timed.halves) or len(timed.segments) > 1
        events.append(
            _slice(
                str(timed.action),
                timed.rank,
                _TID[COMPUTE],
                timed.start,
                timed.end,
                {"kind": timed.action.kind.value},
            )
        )
        for seg in timed.segments:
            if seg.end <= seg.start:
                continue
            if seg.stream == COMPUTE and not nested:
                continue  # the action slice already shows it
            name = f"{seg.action} {seg.part}"
            events.append(
                _slice(name, timed.rank, _TID[seg.stream], seg.start, seg.end, _segment_args(seg))
            )
    return events


def write_trace(result: SimResult, path: str) -> None:
    """Write the Chrome-trace JSON of ``result`` to ``path``."""
    document = {
        "traceEvents": trace_events(result),
        "displayTimeUnit": "ms",
        "otherData": {
            "schedule": result.name,
            "costs": result.costs.describe(),
            "makespan": result.makespan,
            "bubble_fraction": result.bubble_fraction,
            "exposed_comm_fraction": result.exposed_comm_fraction,
        },
    }
    with open(path, "w") as f:
        json.dump(document, f)
