"""Read a profiler (Chrome) trace: which GPU stream each node's kernels ran on, and when.

The streams section wraps every node the combined step issues in a profiler annotation named
``megapipe:<label>|<stream>|<kind>`` (``annotation_name``): ``AnnotatedTrace`` is megapipe's
``NodeTrace`` (which the combined step already calls around every node) opening that range too.
In the exported trace a kernel is tied to the host call that launched it by a correlation id;
the launch happened inside the
annotation of the node being issued (one host thread issues both streams on CUDA, and it waits
inside a backward node until the autograd engine has launched that node's kernels). So:
kernel -> launch -> innermost annotation around the launch's time -> node. A GPU stream's role
(compute or comm) is the megapipe stream most of its kernels were issued from.
"""

from __future__ import annotations

import bisect
import gzip
import json
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpu_sections.timeline import intersection_length, length
from megapipe.overlap.node_trace import NodeSpan, NodeTrace

PREFIX = "megapipe:"
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def annotation_name(label: str, stream: str, kind: str) -> str:
    return f"{PREFIX}{label}|{stream}|{kind}"


class AnnotatedTrace(NodeTrace):
    """A ``NodeTrace`` whose every span is also a profiler range named ``annotation_name``."""

    @contextmanager
    def span(self, microbatch: int | None, layer: int, node: str, direction: str, stream: Any,
             kind: str, slot: int = -1) -> Iterator[None]:
        name = stream if isinstance(stream, str) else stream.name
        label = NodeSpan(microbatch, layer, node, direction, name, kind, 0.0, 0.0).label()
        with torch.profiler.record_function(annotation_name(label, name, kind)), \
                super().span(microbatch, layer, node, direction, stream, kind, slot):
            yield


@dataclass(frozen=True)
class NodeAnnotation:
    start: float  # microseconds, the trace's clock
    end: float
    label: str
    stream: str  # the megapipe stream it was issued to: "compute" or "comm"
    kind: str


@dataclass(frozen=True)
class KernelRun:
    name: str
    gpu_stream: int
    start: float
    end: float
    node: NodeAnnotation | None  # None: launched outside any node (e.g. the loss)


def load_events(path: str | Path) -> list[dict[str, Any]]:
    """The events of a Chrome trace file (``.json`` or ``.json.gz``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def annotations(events: Sequence[dict[str, Any]]) -> list[NodeAnnotation]:
    """The node annotations, sorted by start."""
    found = []
    for e in events:
        name = e.get("name", "")
        if e.get("cat") == "user_annotation" and name.startswith(PREFIX) and "dur" in e:
            label, stream, kind = name[len(PREFIX):].rsplit("|", 2)
            found.append(NodeAnnotation(e["ts"], e["ts"] + e["dur"], label, stream, kind))
    return sorted(found, key=lambda a: a.start)


def innermost(
    spans: Sequence[NodeAnnotation], starts: Sequence[float], at: float
) -> NodeAnnotation | None:
    """The latest-starting annotation containing time ``at`` (annotations nest on one thread)."""
    index = bisect.bisect_right(starts, at) - 1
    while index >= 0:
        if spans[index].end >= at:
            return spans[index]
        index -= 1
    return None


def kernel_runs(events: Sequence[dict[str, Any]]) -> list[KernelRun]:
    """Every GPU activity with the node whose issue launched it."""
    nodes = annotations(events)
    starts = [a.start for a in nodes]
    launched_at = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
    }
    runs = []
    for e in events:
        if e.get("cat") not in GPU_CATEGORIES or "dur" not in e:
            continue
        args = e.get("args", {})
        launch = launched_at.get(args.get("correlation"))
        node = innermost(nodes, starts, launch) if launch is not None else None
        runs.append(KernelRun(e.get("name", ""), int(args.get("stream", -1)), e["ts"],
                              e["ts"] + e["dur"], node))
    return runs


def stream_roles(runs: Sequence[KernelRun]) -> dict[int, str]:
    """GPU stream id -> the megapipe stream most of its node kernels were issued from."""
    votes: dict[int, Counter] = defaultdict(Counter)
    for run in runs:
        if run.node is not None:
            votes[run.gpu_stream][run.node.stream] += 1
    return {stream: counts.most_common(1)[0][0] for stream, counts in votes.items()}


def node_streams(runs: Sequence[KernelRun], roles: dict[int, str]) -> list[list[object]]:
    """Rows ``[direction+node, issued to, ran on (roles), kernels, kernel ms]`` per node name
    (microbatches and layers merged), in order of first appearance."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for run in runs:
        if run.node is None:
            continue
        name = _node_name(run.node.label)
        row = rows.setdefault((name, run.node.stream), {"ran": Counter(), "count": 0, "us": 0.0})
        row["ran"][roles.get(run.gpu_stream, f"stream {run.gpu_stream}")] += 1
        row["count"] += 1
        row["us"] += run.end - run.start
    return [
        [name, issued, ", ".join(sorted(r["ran"])), r["count"], round(r["us"] / 1e3, 3)]
        for (name, issued), r in rows.items()
    ]


def _node_name(label: str) -> str:
    """``F3.1.layer1.experts`` -> ``F layer.experts`` (direction and node, no indices)."""
    direction, _, rest = label.partition(".")
    node = rest.split(".", 1)[1] if "." in rest else rest
    node = ".".join(part for part in node.split(".") if not part.startswith("layer")) or node
    return f"{direction[:1]} {node}"


def overlap_figures(runs: Sequence[KernelRun], roles: dict[int, str]) -> dict[str, float]:
    """Kernel milliseconds on the compute and comm streams, and while both ran at once."""
    by_role: dict[str, list[tuple[float, float]]] = {"compute": [], "comm": []}
    for run in runs:
        role = roles.get(run.gpu_stream)
        if role in by_role:
            by_role[role].append((run.start, run.end))
    return {
        "compute_kernels_ms": length(by_role["compute"]) / 1e3,
        "comm_kernels_ms": length(by_role["comm"]) / 1e3,
        "concurrent_ms": intersection_length(by_role["compute"], by_role["comm"]) / 1e3,
    }


def separate_streams(runs: Sequence[KernelRun]) -> tuple[bool, str]:
    """Whether the forward compute nodes and the forward comm nodes ran their kernels on
    disjoint GPU streams (the comm node's own work, e.g. a modelled link, on the comm stream)."""
    used: dict[str, set[int]] = {"compute": set(), "comm": set()}
    for run in runs:
        if run.node is not None and run.node.label.startswith("F"):
            used.setdefault(run.node.kind, set()).add(run.gpu_stream)
    shared = used["compute"] & used["comm"]
    detail = (f"forward compute nodes on streams {sorted(used['compute'])}, "
              f"forward comm nodes on {sorted(used['comm'])}")
    return bool(used["compute"]) and bool(used["comm"]) and not shared, detail
