"""streams: a profiler trace of one combined step -- which GPU stream each node's kernels ran
on, and the milliseconds during which compute and comm kernels ran at the same time.

Two attention + MoE layers, ep = 1, bf16; the all-to-all is modelled on the comm stream (a copy
kernel on a few SMs when Triton is there, else megapipe's ``EmulatedLink``, a timed wait) for as
long as the mean paired compute node, so the comm stream has kernels of its own. Every node is
annotated in the trace (``trace_analysis.AnnotatedTrace``, megapipe's ``NodeTrace`` plus a
profiler range per node) and each kernel is tied to its node through its launch
(``trace_analysis.py``). The trace is written to ``streams_trace.json.gz`` in the out folder
(open it in Perfetto or chrome://tracing). The concurrent time is also computed from the node
timeline (CUDA events around each node), as a cross-check.
"""

from __future__ import annotations

import gzip
import shutil

import torch

from gpu_sections import timeline, trace_analysis
from gpu_sections.gpu_timing import node_spans, synchronize
from gpu_sections.link_model import copy_unavailable, make_link
from gpu_sections.moe_bench import PairBench, Shape, build_layers
from megapipe.overlap.device_streams import make_streams

REAL = Shape(hidden=2048, heads=16, experts=8, top_k=2, ffn=1408, tokens=4096)
DRY = Shape(hidden=64, heads=4, experts=4, top_k=2, ffn=32, tokens=64, batch=2)
LAYERS = 2
TRACE_FILE = "streams_trace.json.gz"


def run(ctx, result) -> None:  # noqa: ANN001
    shape, dtype = (REAL if ctx.cuda else DRY), torch.bfloat16
    layers = build_layers(shape, LAYERS, ctx.device, dtype)
    with make_streams(ctx.device) as streams:
        bench = PairBench(layers, shape, streams, ctx.device, dtype)
        link = _link(ctx, result, bench)
        bench.set_link(link)
        result.figure("setup", f"{LAYERS} layers, {shape.describe()}, {str(dtype)[6:]}; "
                               f"{link.describe()}")
        bench.traced(combined=True)  # warm-up
        trace, events = _profile(ctx, bench)
    spans = node_spans(trace)
    _check_annotations(ctx, result, spans, trace_analysis.annotations(events))
    result.figure("event_concurrent_ms", timeline.concurrent_ms(spans), "ms",
                  "compute and comm nodes at once (node timeline)")
    if not ctx.gpu_or_skip(result, "kernels per stream, concurrent kernel time"):
        return
    runs = trace_analysis.kernel_runs(events)
    roles = trace_analysis.stream_roles(runs)
    result.figure("gpu_streams", len({r.gpu_stream for r in runs}), "", "GPU streams with kernels")
    result.figure("unattributed_kernels", sum(r.node is None for r in runs), "kernels",
                  "kernels launched outside any node")
    for key, value in trace_analysis.overlap_figures(runs, roles).items():
        result.figure(key, value, "ms", key.replace("_", " "), headline=key == "concurrent_ms")
    result.table("node kernels by stream (stream roles: the megapipe stream most of a GPU "
                 "stream's kernels were issued from)",
                 ["node", "issued to", "kernels ran on", "kernels", "kernel ms"],
                 trace_analysis.node_streams(runs, roles))
    ok, detail = trace_analysis.separate_streams(runs)
    result.check(
        "forward compute and comm nodes ran their kernels on different streams", ok, detail
    )


def _check_annotations(ctx, result, spans: list[timeline.Span], nodes) -> None:  # noqa: ANN001
    """Every node issued is in the trace: on CUDA all of them (one host thread issues both
    streams); on CPU those of the compute stream (the comm stream is a worker thread, which
    the profiler does not follow)."""
    streams = ("compute", "comm") if ctx.cuda else ("compute",)
    if not ctx.cuda:
        result.skip("comm-node annotations", "on CPU the comm stream is a worker thread, which "
                    "the profiler does not follow")
    for stream in streams:
        issued = sum(s.stream == stream for s in spans)
        found = sum(n.stream == stream for n in nodes)
        result.check(f"every node issued to the {stream} stream is annotated in the trace",
                     issued == found and issued > 0, f"{found} annotations, {issued} nodes")


def _link(ctx, result, bench: PairBench):  # noqa: ANN001, ANN202
    reason = copy_unavailable(ctx.device)
    kind = "copy" if reason is None else "sleep"
    if reason is not None:
        result.skip("copy link model", f"{reason}; a timed wait models the link instead")
    return make_link(kind, bench.paired_compute_ms(), ctx.device,
                     bench.shape.payload_bytes(bench.x_fwd.dtype))


def _profile(ctx, bench: PairBench):  # noqa: ANN001, ANN202
    """One combined step under the profiler; (its AnnotatedTrace, the trace's events)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if ctx.cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    plans, tape = bench.prepare()
    trace = trace_analysis.AnnotatedTrace()
    with torch.profiler.profile(activities=activities) as profiler:
        bench.issue(plans, tape, True, trace=trace)
        synchronize(ctx.device)
    raw = ctx.scratch / "streams_trace.json"
    profiler.export_chrome_trace(str(raw))
    with open(raw, "rb") as src, gzip.open(ctx.out / TRACE_FILE, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return trace, trace_analysis.load_events(raw)
