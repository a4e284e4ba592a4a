"""overlap: one process, ep = 1, realistic MoE layers: sequential vs combined, with the
all-to-all modelled on the communication stream.

Per configuration (attention + MoE layers in bf16 with fp32 main gradients; first the
hidden-4096 one the host target names) the all-to-all is modelled (``link_model.py``) as
megapipe's ``EmulatedLink`` (a timed wait, ``sleep``) at several link speeds, and as a copy
kernel on a few SMs (``copy``) at the balanced speed. The speed is given as a ratio: ratio 1
makes each all-to-all last the mean paired compute node (forward and backward attention and
experts, measured first without a link), so communication is as long as the compute it hides
behind ("comm ~ compute"). For each setting, on one MoE layer pair (the forward of microbatch 1
beside the backward of microbatch 0) and, at ratio 1, on a step of several layers:

- forward, backward and per-all-to-all milliseconds (the nodes run alone, CUDA events);
- sequential (tape forward then backward on one stream) vs combined milliseconds, speedup;
- ceiling = sequential / the busier stream (summed node times of the run alone);
- exposed all-to-all: comm node time with no compute node beside it (``NodeTrace``);
- host time (until the combined step returned: on CUDA its issue time, ``finish`` being
  stream-ordered) vs GPU time; GPU idle share (no node on either stream, first node to last).

On the first configuration, at the sleep link of ratio 1, the combined step also runs with the
expert weight gradients deferred (``delay_wgrad_compute``) and with the all-to-alls in 2
waves (``moe_a2a_waves``), against the same sequential time.

Targets (reported, never asserted): pair speedup >= 1.8 and exposed all-to-all <= 10%
at ratio 1; host issue time under half the GPU time at hidden 4096.
"""

from __future__ import annotations

import gc

import torch

from gpu_sections import timeline
from gpu_sections.gpu_timing import Timed
from gpu_sections.link_model import copy_unavailable, make_link
from gpu_sections.moe_bench import BASE, PairBench, Shape, Variant, build_layers
from megapipe.overlap.device_streams import make_streams

# the two most telling shapes (the first GPU run measured four more; they said the same)
REAL = (
    Shape(hidden=4096, heads=32, experts=8, top_k=2, ffn=14336, tokens=4096),  # Mixtral-like
    Shape(hidden=7168, heads=56, experts=32, top_k=8, ffn=2048, tokens=4096),  # DeepSeek-V3, EP 8
)
DRY = (Shape(hidden=64, heads=4, experts=4, top_k=2, ffn=32, tokens=64, batch=2),)
RATIOS = (1.0, 2.0)
VARIANTS = (Variant(delay_wgrad=True), Variant(waves=2))  # first configuration, sleep x1
COLUMNS = ["config", "link", "a2a ms", "a2a GB/s", "fwd ms", "bwd ms", "sequential ms",
           "combined ms", "speedup", "ceiling", "exposed a2a", "host / GPU", "GPU idle"]


def run(ctx, result) -> None:  # noqa: ANN001
    shapes, dtype = (REAL if ctx.cuda else DRY), torch.bfloat16
    reps, need_s = (5, 40.0) if ctx.cuda else (1, 3.0)
    copy_reason = copy_unavailable(ctx.device)
    if copy_reason:
        result.skip("copy link model (a copy kernel on a few SMs)", copy_reason)
    if not ctx.cuda:
        result.skip("targets (speedup >= 1.8, exposed <= 10%, host < half the GPU time)",
                    f"{ctx.no_gpu}: CPU figures are no measure of them")
    pairs, steps = [], []
    for index, shape in enumerate(shapes):
        if not ctx.enough_time(result, f"configuration {shape.describe()}", need_s):
            break
        try:
            _configuration(ctx, result, shape, dtype, reps, copy_reason is None, pairs, steps,
                           headline=index == 0)
        except torch.OutOfMemoryError as err:
            result.skip(f"configuration {shape.describe()}", f"out of memory: {str(err)[:200]}")
        finally:
            gc.collect()
            if ctx.cuda:
                torch.cuda.empty_cache()
        result.table("one MoE layer pair: forward of one microbatch beside the backward of another",
                     COLUMNS, pairs)
        result.table("one step of several layers (ratio 1)", COLUMNS, steps)
    result.note(f"dtype {str(dtype)[6:]}, ep = 1, {reps} timed runs per setting (median) after "
                "one warm-up; link ratio r: each all-to-all lasts r x the mean paired compute "
                "node; host / GPU: host ms until the combined step returned over its GPU ms "
                "(on CUDA the issue time, including the host's wait in each dispatch's one read)")


def _configuration(ctx, result, shape: Shape, dtype, reps: int, with_copy: bool,  # noqa: ANN001
                   pairs: list, steps: list, headline: bool) -> None:
    layers_in_step = 4 if shape.hidden <= 4096 else 2
    layers = build_layers(shape, layers_in_step, ctx.device, dtype)
    payload = shape.payload_bytes(dtype)
    with make_streams(ctx.device) as streams:
        pair = PairBench(layers[:1], shape, streams, ctx.device, dtype)
        pair.traced(combined=True)  # warm-up: compiles kernels, fills the allocator
        compute_ms = pair.paired_compute_ms()
        settings = [("sleep", r) for r in RATIOS] + ([("copy", 1.0)] if with_copy else [])
        for kind, ratio in settings:
            link = make_link(kind, ratio * compute_ms, ctx.device, payload)
            pair.set_link(link)
            label = _link_label(kind, link, ratio)
            row = _measure(pair, reps)
            pairs.append(_row(shape, label, row))
            if headline and kind == "sleep" and ratio == 1.0:
                _node_timeline(result, shape, label, row["combined_spans"])
            if ratio == 1.0:
                _targets(ctx, result, shape, f"{kind} link", row, headline and kind == "sleep")
            if headline and kind == "sleep" and ratio == 1.0:
                _variants(ctx, result, pair, shape, label, row["plain"], reps, pairs)
        step = PairBench(layers, shape, streams, ctx.device, dtype)
        for kind in ("sleep", "copy") if with_copy else ("sleep",):
            if not ctx.enough_time(result, f"step of {shape.describe()}, {kind} link", 10.0):
                break
            link = make_link(kind, compute_ms, ctx.device, payload)
            step.set_link(link)
            label = f"{_link_label(kind, link, 1.0)}, {layers_in_step} layers"
            steps.append(_row(shape, label, _measure(step, reps)))


def _variants(ctx, result, pair: PairBench, shape: Shape, label: str, plain: Timed,  # noqa: ANN001
              reps: int, pairs: list) -> None:
    """The combined step with deferred weight gradients and with all-to-alls in waves."""
    for variant in VARIANTS:
        name = f"{label}, {variant.describe()}"
        if not ctx.enough_time(result, f"{shape.short()} {name}", 10.0 if ctx.cuda else 1.0):
            return
        pairs.append(_row(shape, name, _measure(pair, reps, variant, plain)))


def _link_label(kind: str, link, ratio: float) -> str:  # noqa: ANN001
    return f"{kind} x{ratio:g}" + (f" ({link.sms} SMs)" if kind == "copy" else "")


def _measure(bench: PairBench, reps: int, variant: Variant = BASE,
             plain: Timed | None = None) -> dict:
    """Every figure of one setting (module docstring); ``plain``: the sequential time, when
    already measured for this link."""
    bench.traced(False, variant)  # warm-up of the nodes alone
    alone = bench.traced(False, variant)
    plain = plain or bench.plain_ms(reps)
    combined = bench.traced_median(True, reps, variant)
    a2a_ms = alone.comm_ms / (4 * len(bench.layers))  # dispatch and combine, F and B
    payload = bench.shape.payload_bytes(bench.x_fwd.dtype)
    return {
        "plain": plain, "a2a_ms": a2a_ms, "combined_spans": combined.spans,
        "a2a_gbs": payload / (a2a_ms * 1e6) if a2a_ms else None,
        "fwd_ms": alone.total("F"), "bwd_ms": alone.total("B"),
        "sequential_ms": plain.device_ms, "combined_ms": combined.device_ms,
        "speedup": plain.device_ms / combined.device_ms,
        "ceiling": timeline.ceiling(plain.device_ms, alone.compute_ms, alone.comm_ms),
        "exposed": combined.exposed, "exposed_ms": combined.exposed * combined.comm_ms,
        "host_share": combined.host_ms / combined.device_ms,
        "idle": timeline.idle_share(combined.spans),
    }


def _node_timeline(result, shape: Shape, link: str, spans: list) -> None:  # noqa: ANN001
    """Every node of the headline combined pair on its stream, in GPU milliseconds: where the
    all-to-all stays exposed, and what the compute stream waited for."""
    rows = [[s.label, s.stream, s.kind, s.start, s.end, s.duration]
            for s in sorted(spans, key=lambda s: (s.start, s.end))]
    result.table(f"node timeline of the combined pair, {shape.short()}, {link}",
                 ["node", "stream", "kind", "start ms", "end ms", "ms"], rows)


def _row(shape: Shape, link: str, m: dict) -> list:
    return [shape.short(), link, m["a2a_ms"], m["a2a_gbs"], m["fwd_ms"], m["bwd_ms"],
            m["sequential_ms"], m["combined_ms"], m["speedup"], m["ceiling"],
            f"{m['exposed']:.0%} ({m['exposed_ms']:.3g} ms)", m["host_share"], f"{m['idle']:.0%}"]


def _targets(ctx, result, shape: Shape, link: str, m: dict, headline: bool) -> None:  # noqa: ANN001
    name = f"{shape.short()}, {link}, comm ~ compute"
    if headline:
        result.figure("headline_setting", name, "", "headline figures for")
        result.figure("pair_speedup", m["speedup"], "x", "pair speedup", headline=True)
        result.figure("pair_ceiling", m["ceiling"], "x", "pair ceiling", headline=True)
        result.figure("pair_exposed", m["exposed"] * 100, "%", "exposed a2a", headline=True)
        result.figure("host_share", m["host_share"], "", "host / GPU", headline=True)
    if not ctx.cuda:
        return
    result.target(f"layer pair speedup, {name}", m["speedup"], ">= 1.8", m["speedup"] >= 1.8)
    result.target(
        f"exposed all-to-all, {name}", m["exposed"] * 100, "<= 10 %", m["exposed"] <= 0.10
    )
    if shape.hidden == 4096:
        result.target(f"host issue / GPU time, {name}", m["host_share"], "< 0.5",
                      m["host_share"] < 0.5)
