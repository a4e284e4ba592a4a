"""``megapipe trace summarize FILE``: the figures of a profile trace (``run_trace``), per rank.

Everything is computed from the trace's own events, so the summary says what the picture shows:

- step time: per traced step, from the first action's start on any rank to the last action's
  end on any rank; the mean over the steps, beside the simulated step (``otherData``) and their
  ratio;
- per rank: the all-to-all time and its exposed part (the ``exposed`` slices: comm time with no
  compute node of the rank beside it), per step and as a share;
- per rank, the largest bubbles: idle gaps on the compute stream inside the step. The stream is
  busy during its compute nodes, and during an action without nodes (a plain schedule, a W) less
  its pipeline waits. A gap is put down to the pipeline receive it waited on, else to the
  all-to-all running during it, else to the rank not having started (or having finished) its
  actions of the step, else to host work (scheduling between nodes);
- per rank, with bucketed data parallelism: the time of its collectives on the data-parallel
  stream and how long the compute stream waited for them (the exposed part).
"""

from __future__ import annotations

import bisect
import json
from collections import defaultdict
from dataclasses import dataclass, field
from statistics import mean

from megapipe.schedule.timing.intervals import covered_length, subtract, union
from megapipe.train.observe.run_trace import FORMAT

BUBBLES_SHOWN = 3


@dataclass(frozen=True)
class Bubble:
    step: int
    offset_ms: float  # from the start of the step
    length_ms: float
    cause: str


@dataclass
class RankFigures:
    rank: int
    pp_rank: int
    dp_rank: int
    comm_ms: float = 0.0  # per step
    exposed_ms: float = 0.0  # per step
    busy_ms: float = 0.0  # per step
    dp_ms: float = 0.0  # per step: data-parallel collectives on their stream
    dp_waited_ms: float = 0.0  # per step: the compute stream's waits for them
    bubbles: list[Bubble] = field(default_factory=list)

    @property
    def exposed_share(self) -> float:
        return self.exposed_ms / self.comm_ms if self.comm_ms > 0 else 0.0


@dataclass
class TraceSummary:
    meta: dict
    steps: list[int]
    step_ms: list[float]  # measured, per traced step
    ranks: list[RankFigures]

    @property
    def simulated_ms(self) -> float:
        return float(self.meta["simulated"]["makespan_ms"])


def read_trace(path: str) -> dict:
    """The trace document at ``path``; one-line ValueError if it is not a megapipe trace."""
    try:
        with open(path) as f:
            document = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not JSON ({err.msg} at line {err.lineno})") from None
    meta = document.get("otherData", {}).get("megapipe") if isinstance(document, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(
            f"{path} is not a megapipe profile trace (made by `megapipe pretrain --profile-trace`)"
        )
    return document


def _end(event: dict) -> float:
    return event["ts"] + event["dur"]


def _by(events: list[dict], cat: str) -> dict[tuple[int, int], list[dict]]:
    """The slices of one category per (pid, step), sorted by start."""
    out: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for event in events:
        if event.get("ph") == "X" and event.get("cat") == cat:
            out[(event["pid"], event["args"]["step"])].append(event)
    for row in out.values():
        row.sort(key=lambda e: e["ts"])
    return out


def _busy(actions: list[dict], compute: list[dict], waits: list[dict]) -> list[tuple]:
    """When the compute stream worked: its nodes, and its actions without nodes less waits."""
    busy = [(e["ts"], _end(e)) for e in compute]
    starts = [e["ts"] for e in compute]
    wait_cover = union((e["ts"], _end(e)) for e in waits)
    for action in actions:
        first = bisect.bisect_left(starts, action["ts"])
        if first < len(starts) and starts[first] <= _end(action):
            continue  # the nodes inside say when it worked
        busy += subtract((action["ts"], _end(action)), wait_cover)
    return union(busy)


def _cause(
    gap: tuple, actions: list[dict], waits: list[dict], comm: list[dict], dp_waits: list[dict]
) -> str:
    for slices, text in (
        (waits, "waits for {}"),
        (comm, "waits for all-to-all {}"),
        (dp_waits, "{}"),
    ):
        overlap = [(covered_length(gap, [(e["ts"], _end(e))]), e["name"]) for e in slices]
        best = max(overlap, default=(0.0, ""))
        if best[0] > 0:
            return text.format(best[1].removeprefix("wait "))
    half = (gap[1] - gap[0]) / 2
    if not actions or covered_length(gap, [(gap[0], actions[0]["ts"])]) > half:
        return "before its first action of the step (pipeline fill)"
    if covered_length(gap, [(max(_end(a) for a in actions), gap[1])]) > half:
        return "after its last action of the step (pipeline drain)"
    return "host work (scheduling, p2p posting)"


def summarize(document: dict) -> TraceSummary:
    """The figures of the module docstring, from the trace's events."""
    meta = document["otherData"]["megapipe"]
    events = document["traceEvents"]
    cats = {
        c: _by(events, c) for c in ("action", "compute", "comm", "wait", "exposed", "dp", "dp_wait")
    }
    steps = sorted({step for _, step in cats["action"]})
    windows = {}
    for step in steps:
        rows = [row for (pid, s), row in cats["action"].items() if s == step]
        windows[step] = (
            min(e["ts"] for r in rows for e in r),
            max(_end(e) for r in rows for e in r),
        )
    ranks = []
    for info in meta["ranks"]:
        figures = RankFigures(info["rank"], info["pp_rank"], info["dp_rank"])
        bubbles = []
        for step in steps:
            key = (info["rank"], step)
            got = {c: cats[c].get(key, []) for c in cats}
            figures.comm_ms += sum(e["dur"] for e in got["comm"]) / 1e3
            figures.exposed_ms += sum(e["dur"] for e in got["exposed"]) / 1e3
            figures.dp_ms += sum(e["dur"] for e in got["dp"]) / 1e3
            figures.dp_waited_ms += sum(e["dur"] for e in got["dp_wait"]) / 1e3
            busy = _busy(got["action"], got["compute"], got["wait"])
            figures.busy_ms += sum(b - a for a, b in busy) / 1e3
            for gap in subtract(windows[step], busy):
                bubbles.append(
                    Bubble(
                        step,
                        (gap[0] - windows[step][0]) / 1e3,
                        (gap[1] - gap[0]) / 1e3,
                        _cause(gap, got["action"], got["wait"], got["comm"], got["dp_wait"]),
                    )
                )
        count = max(len(steps), 1)
        figures.comm_ms /= count
        figures.exposed_ms /= count
        figures.busy_ms /= count
        figures.dp_ms /= count
        figures.dp_waited_ms /= count
        figures.bubbles = sorted(bubbles, key=lambda b: -b.length_ms)
        ranks.append(figures)
    step_ms = [(windows[s][1] - windows[s][0]) / 1e3 for s in steps]
    return TraceSummary(meta, steps, step_ms, ranks)


def format_summary(summary: TraceSummary, path: str) -> str:
    """The summary as the lines ``megapipe trace summarize`` prints."""
    meta = summary.meta
    measured = mean(summary.step_ms) if summary.step_ms else 0.0
    simulated = summary.simulated_ms
    lines = [
        f"{path}: schedule {meta['schedule']}, pp {meta['pp']} x dp {meta['dp']} (ep "
        f"{meta['ep']}), vpp {meta['vpp']}, {meta['num_microbatches']} microbatches, "
        f"iterations {meta['steps'][0]}-{meta['steps'][1]} on {meta['device']}",
        f"step time: measured {measured:.2f} ms (mean of {len(summary.step_ms)}), simulated "
        f"{simulated:.2f} ms, measured/simulated {measured / simulated if simulated else 0:.2f}",
    ]
    for r in summary.ranks:
        a2a = (
            f"exposed all-to-all {r.exposed_ms:.2f} ms of {r.comm_ms:.2f} ms per step "
            f"({r.exposed_share:.1%})"
            if meta["node_times"]
            else "all-to-all not traced (a plain schedule runs it inside its actions)"
        )
        lines.append(
            f"rank {r.rank} (pp {r.pp_rank}, dp {r.dp_rank}): {a2a}; compute busy "
            f"{r.busy_ms:.2f} ms per step"
        )
        if r.dp_ms > 0:
            share = r.dp_waited_ms / r.dp_ms
            lines.append(
                f"  data parallel: collectives {r.dp_ms:.2f} ms per step, the compute "
                f"stream waited {r.dp_waited_ms:.2f} ms for them ({share:.1%} exposed)"
            )
        for b in r.bubbles[:BUBBLES_SHOWN]:
            lines.append(
                f"  bubble {b.length_ms:.2f} ms (iteration {b.step}, at "
                f"+{b.offset_ms:.2f} ms): {b.cause}"
            )
    times = (
        ", ".join(f"{t['direction']} {t['node']} {t['mean_ms']:.3f}" for t in meta["node_times"])
        or "none (no node ran on the streams)"
    )
    lines.append(f"measured node times (mean ms): {times}")
    lines.append(f"simulated with: {meta['simulated']['costs']}")
    return "\n".join(lines)


def summarize_file(path: str) -> str:
    return format_summary(summarize(read_trace(path)), path)
