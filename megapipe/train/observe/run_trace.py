"""The profile trace of a real run: every traced rank and step as one Perfetto/Chrome trace.

Input: what each rank recorded in the traced iterations (``RankRecord``: its node, action and
pipeline-wait spans, ``pipeline.step_profile``) and the schedule that ran. Output: one JSON
document in the trace-event format (ui.perfetto.dev, chrome://tracing):

- one process per rank (pid = global rank, "rank r (pp p, dp d)") with three threads:
  ``compute`` (tid 0: each compute action, and nested in it its compute nodes and its waits for
  pipeline receives), ``comm`` (tid 1: the all-to-all nodes) and ``exposed all-to-all`` (tid 2:
  the parts of each all-to-all during which no compute node of the rank ran); with bucketed
  data parallelism (``optim.dp_sync``) two more: ``data parallel`` (tid 3: each bucket's
  reduction or parameter all-gather on its communication stream) and ``waits for data
  parallel`` (tid 4: the time the compute stream waited for them, the exposed part);
- node slices are named ``F3 s2 layer1.dispatch`` (direction, microbatch, stage, node) and carry
  step, microbatch, stage, layer, node and direction as args;
- one process per pipeline rank of the simulated schedule (pid = world size + rank, "simulated
  rank r"), simulated with the measured mean node times (``measured_costs``) and placed at the
  start of the first traced step;
- ``otherData.megapipe``: the layout, the traced steps, the measured node times, the cost model
  and the simulated step (``trace_summary`` reads it back).

Clocks: ranks on rank 0's host share its monotonic clock; a rank on another host is shifted by
the difference of the clocks read just after one barrier (good to the barrier's skew).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from megapipe.schedule.actions import parse_action
from megapipe.schedule.ir import Kind, Schedule
from megapipe.schedule.timing.intervals import subtract, union
from megapipe.sim.simulate import simulate
from megapipe.sim.trace import trace_events
from megapipe.train.observe.measured_costs import measured_costs, node_times

FORMAT = "megapipe-profile-trace"
COMPUTE_TID, COMM_TID, EXPOSED_TID, DP_TID, DP_WAIT_TID = 0, 1, 2, 3, 4
THREADS = {
    COMPUTE_TID: "compute",
    COMM_TID: "comm",
    EXPOSED_TID: "exposed all-to-all",
    DP_TID: "data parallel",
    DP_WAIT_TID: "waits for data parallel",
}
DP_KINDS = {"dp": DP_TID, "dp_wait": DP_WAIT_TID}  # optim.dp_sync's span kinds
US = 1e6


@dataclass(frozen=True)
class RankRecord:
    """What one rank sends to rank 0 once, after the last traced step."""

    rank: int
    pp_rank: int
    dp_rank: int
    host: str
    clock: float  # its clock just after a barrier every rank passed
    rows: list[tuple]  # (step, kind, stream, direction, microbatch, layer, node, start, end)


@dataclass(frozen=True)
class Span:
    """One recorded span of one rank and step, on rank 0's clock, with its stage when known."""

    rank: int
    step: int
    kind: str  # compute, comm, action or wait
    stream: str
    direction: str
    microbatch: int | None
    layer: int
    node: str
    start: float
    end: float
    stage: int | None = None
    has_nodes: bool = False  # an action: whether compute nodes ran inside it


def aligned_spans(records: Sequence[RankRecord]) -> list[Span]:
    """Every record's rows as spans on rank 0's clock (module docstring), stages attributed."""
    first = next(r for r in records if r.rank == 0)
    spans = []
    for record in records:
        shift = 0.0 if record.host == first.host else first.clock - record.clock
        for step, kind, stream, direction, mb, layer, node, start, end in record.rows:
            spans.append(
                Span(
                    record.rank,
                    step,
                    kind,
                    stream,
                    direction,
                    mb,
                    layer,
                    node,
                    start + shift,
                    end + shift,
                )
            )
    return _with_stages(spans)


def _with_stages(spans: list[Span]) -> list[Span]:
    """Give each node the stage of the action it ran in (F: the forward half's, B/W: the
    backward's), each wait its receive's stage, each action its own (an OVERLAP: None)."""
    actions: dict[tuple[int, int], list[Span]] = {}
    for span in sorted(spans, key=lambda s: s.start):
        if span.kind == "action":
            actions.setdefault((span.rank, span.step), []).append(span)
    starts = {key: [a.start for a in row] for key, row in actions.items()}
    inside: set[Span] = set()
    out = []
    for span in spans:
        if span.kind == "action" or span.kind in DP_KINDS:
            out.append(span)
            continue
        if span.kind == "wait":
            out.append(replace(span, stage=parse_action(span.node).stage))
            continue
        key = (span.rank, span.step)
        at = bisect.bisect_right(starts.get(key, []), span.start) - 1
        stage = None
        if at >= 0:
            holder = actions[key][at]
            if span.kind == "compute":
                inside.add(holder)
            action = parse_action(holder.node)
            if action.kind is Kind.OVERLAP:
                action = action.forward if span.direction == "F" else action.backward
            stage = action.stage
        out.append(replace(span, stage=stage))
    return [
        replace(s, stage=parse_action(s.node).stage, has_nodes=s in inside)
        if s.kind == "action"
        else s
        for s in out
    ]


def exposed_parts(spans: Sequence[Span]) -> list[tuple[Span, float, float]]:
    """Per comm span, the parts during which no compute node of its rank and step ran."""
    cover: dict[tuple[int, int], list] = {}
    for span in spans:
        if span.kind == "compute":
            cover.setdefault((span.rank, span.step), []).append((span.start, span.end))
    merged = {key: union(v) for key, v in cover.items()}
    parts = []
    for span in spans:
        if span.kind == "comm":
            for start, end in subtract(
                (span.start, span.end), merged.get((span.rank, span.step), [])
            ):
                parts.append((span, start, end))
    return parts


def _slice(
    name: str, cat: str, pid: int, tid: int, start: float, end: float, origin: float, args: dict
) -> dict:
    ts, stop = round((start - origin) * US, 3), round((end - origin) * US, 3)
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": ts,
        "dur": round(stop - ts, 3),
        "args": args,
    }


def _span_name(span: Span) -> str:
    if span.kind == "action" or span.kind in DP_KINDS:
        return span.node
    if span.kind == "wait":
        return f"wait {span.node}"
    mb = "" if span.microbatch is None else span.microbatch
    stage = "" if span.stage is None else f" s{span.stage}"
    return f"{span.direction}{mb}{stage} {span.node}"


def _span_args(span: Span) -> dict:
    args: dict[str, Any] = {"step": span.step, "direction": span.direction}
    if span.kind in ("compute", "comm"):
        args.update(microbatch=span.microbatch, stage=span.stage, layer=span.layer, node=span.node)
    return args


def _process(pid: int, name: str, sort: int, threads: dict[int, str]) -> list[dict]:
    events = [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}},
        {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": sort}},
    ]
    for tid, thread in threads.items():
        events.append(
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": thread}}
        )
    return events


def measured_events(
    records: Sequence[RankRecord], spans: Sequence[Span], origin: float
) -> list[dict]:
    """Process metadata and slices of every traced rank (module docstring)."""
    events = []
    for record in sorted(records, key=lambda r: r.rank):
        name = f"rank {record.rank} (pp {record.pp_rank}, dp {record.dp_rank})"
        events += _process(record.rank, name, record.rank, THREADS)
    for span in sorted(spans, key=lambda s: (s.rank, s.start, -s.end)):
        tid = COMM_TID if span.kind == "comm" else DP_KINDS.get(span.kind, COMPUTE_TID)
        events.append(
            _slice(
                _span_name(span),
                span.kind,
                span.rank,
                tid,
                span.start,
                span.end,
                origin,
                _span_args(span),
            )
        )
    for span, start, end in exposed_parts(spans):
        events.append(
            _slice(
                f"exposed {_span_name(span)}",
                "exposed",
                span.rank,
                EXPOSED_TID,
                start,
                end,
                origin,
                _span_args(span),
            )
        )
    return events


def simulated_events(result: Any, pid_base: int, shift_us: float) -> list[dict]:
    """The simulator's trace events moved to pids ``pid_base + rank`` and by ``shift_us``."""
    events = []
    for rank in range(result.pp):
        events += _process(
            pid_base + rank, f"simulated rank {rank}", pid_base + rank, {0: "compute", 1: "comm"}
        )
    for event in trace_events(result):
        if event["ph"] != "X":
            continue
        moved = dict(event, pid=pid_base + event["pid"], ts=round(event["ts"] + shift_us, 3))
        moved["cat"] = f"simulated {event['cat']}"
        events.append(moved)
    return events


def build_trace(records: Sequence[RankRecord], schedule: Schedule, layout: dict) -> dict:
    """The whole document (module docstring); ``layout``: pp, dp, world, steps, flags."""
    spans = aligned_spans(records)
    actions = [s for s in spans if s.kind == "action"]
    if not actions:
        raise RuntimeError("no action was recorded in the traced steps")
    origin = min(s.start for s in spans)
    first_step = min(s.step for s in actions)
    first_start = min(s.start for s in actions if s.step == first_step)
    costs = measured_costs(spans, schedule.num_stages)
    result = simulate(schedule, costs)
    world = max(r.rank for r in records) + 1
    events = measured_events(records, spans, origin)
    events += simulated_events(result, world, (first_start - origin) * US)
    meta = dict(
        layout,
        format=FORMAT,
        version=1,
        schedule=schedule.name,
        ranks=[
            {"rank": r.rank, "pp_rank": r.pp_rank, "dp_rank": r.dp_rank}
            for r in sorted(records, key=lambda r: r.rank)
        ],
        node_times=node_times(spans),
        simulated={
            "pid_base": world,
            "makespan_ms": result.makespan,
            "exposed_comm_fraction": result.exposed_comm_fraction,
            "bubble_fraction": result.bubble_fraction,
            "costs": costs.describe(),
        },
    )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"megapipe": meta}}
