"""MoE transformer layers (attention + MoE, ep = 1) and the runs the overlap sections time.

``build_layers`` makes ``TransformerLayer``s of the reference model directly on the device (on a
GPU built on the meta device, then filled from a seeded device generator: drawing billions of
weights on the host would take minutes). ``PairBench`` runs the forward of microbatch 1 and the
backward of microbatch 0 over the same layers three ways:

- ``plain_ms``: forward then backward on the tape, on the current stream (no overlap; a comm
  node's modelled link then runs inline on that stream) -- the sequential time;
- ``traced(combined=False)``: the same nodes issued through the co-scheduler one side at a time
  (forward alone, then backward alone), traced node by node -- each node's own time;
- ``traced(combined=True)``: the combined step, traced node by node.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from megapipe.models.config import GPTConfig
from megapipe.models.gpt import TransformerLayer
from megapipe.overlap.coscheduler import CoScheduler, TapeBackward, combined_step
from megapipe.overlap.streams import Streams
from megapipe.overlap.tape import record_forward, run_backward

from gpu_sections.gpu_timing import EventTrace, Timed, TimedStreams, synchronize, time_ms
from gpu_sections.link_model import LinkModel, with_link
from gpu_sections.timeline import Span


@dataclass(frozen=True)
class Shape:
    """One MoE layer configuration; ``tokens`` per microbatch as ``batch`` x ``tokens/batch``."""

    hidden: int
    heads: int
    experts: int
    top_k: int
    ffn: int  # per expert
    tokens: int
    batch: int = 1

    @property
    def seq(self) -> int:
        return self.tokens // self.batch

    @property
    def rows(self) -> int:
        """Routed rows per microbatch (tokens x top-k), what one all-to-all moves."""
        return self.tokens * self.top_k

    def describe(self) -> str:
        return (f"hidden {self.hidden}, {self.experts} experts x {self.ffn} top-{self.top_k}, "
                f"{self.tokens} tokens")

    def short(self) -> str:
        return f"h{self.hidden} E{self.experts} k{self.top_k} t{self.tokens}"


def build_layers(shape: Shape, count: int, device: torch.device, dtype: torch.dtype,
                 seed: int = 0) -> list[TransformerLayer]:
    """``count`` attention + MoE layers with random N(0, 0.02) weights (norms 1) on ``device``."""
    config = GPTConfig(
        hidden_size=shape.hidden, num_heads=shape.heads, num_layers=count, seq_length=shape.seq,
        ffn_hidden_size=4 * shape.hidden, num_experts=shape.experts, moe_top_k=shape.top_k,
        moe_ffn_hidden_size=shape.ffn, first_k_dense_layers=0,
    )
    generator = torch.Generator(device=device).manual_seed(seed)
    # meta first: its one-time set-up (seconds) is worth it only for large layers on a GPU
    layers = []
    for index in range(count):
        layer = _empty_layer(config, index, device).to(dtype)
        with torch.no_grad():
            for name, param in layer.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, 0.02, generator=generator)
        layers.append(layer)
    return layers


def _empty_layer(config: GPTConfig, index: int, device: torch.device) -> TransformerLayer:
    """The layer with uninitialised weights on ``device`` (built on the meta device on a GPU,
    falling back to the host if this torch cannot build it there)."""
    if device.type == "cuda":
        try:
            with torch.device("meta"):
                return TransformerLayer(config, index).to_empty(device=device)
        except (RuntimeError, NotImplementedError, TypeError) as err:
            print(f"building on the meta device failed ({err}); building on the host", flush=True)
    return TransformerLayer(config, index).to(device)


@dataclass(frozen=True)
class Traced:
    """A traced run: device and host milliseconds, the host's issue time (until it waited for
    the streams at the end), and the nodes' device spans."""

    device_ms: float
    host_ms: float
    issue_ms: float
    spans: list[Span]

    def total(self, direction: str) -> float:
        """Summed node time of the forward ("F") or backward ("B" and "W") spans."""
        wanted = ("B", "W") if direction == "B" else (direction,)
        return sum(s.duration for s in self.spans if s.label[:1] in wanted)

    def node_ms(self, suffix: str, direction: str) -> list[float]:
        """Durations of the ``direction`` spans whose node name ends with ``suffix``."""
        return [s.duration for s in self.spans
                if s.label[:1] == direction and s.label.endswith(suffix)]


class PairBench:
    """Forward of microbatch 1 beside the backward of microbatch 0, over ``layers``."""

    def __init__(self, layers: list[TransformerLayer], shape: Shape, streams: Streams,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.layers, self.shape, self.device = layers, shape, device
        self.streams = TimedStreams.of(streams)
        generator = torch.Generator(device=device).manual_seed(1)

        def draw() -> torch.Tensor:
            return torch.randn(shape.batch, shape.seq, shape.hidden, device=device, dtype=dtype,
                               generator=generator)

        self.x_fwd, self.x_bwd, self.grad = draw().requires_grad_(), draw().requires_grad_(), draw()

    def plans(self, link: LinkModel | None) -> list[list[Any]]:
        return [with_link(layer.node_plan(), link) for layer in self.layers]

    def prepare(self, link: LinkModel | None, on_streams: bool = True) -> tuple[list[list[Any]], Any]:
        """The plans (with the link) and a fresh microbatch-0 tape (recorded, not timed).

        ``on_streams``: record it through the co-scheduler, as the executor records every
        forward, so its comm nodes ran on the comm stream -- on CUDA autograd runs a backward op
        on the stream of its forward op, so only then does the backward's all-to-all run on
        the comm stream. Otherwise on the current stream (the sequential path)."""
        plans = self.plans(link)
        if on_streams:
            _, tape, _ = combined_step(plans, (self.x_bwd,), None, None, self.streams)
        else:
            _, tape = record_forward(plans, (self.x_bwd,))
        synchronize(self.device)
        return plans, tape

    def payload(self) -> torch.Tensor:
        """A tensor shaped like what one all-to-all moves (to calibrate a copy link on)."""
        return torch.empty(self.shape.rows, self.shape.hidden, device=self.device,
                           dtype=self.x_fwd.dtype)

    def issue(self, plans: list[list[Any]], tape: Any, combined: bool,
              trace: EventTrace | None = None) -> None:
        """One run through the co-scheduler: combined, or one side at a time (forward alone,
        then backward alone); returns when both streams are done."""
        if combined:
            combined_step(plans, (self.x_fwd,), tape, (self.grad,), self.streams,
                          trace=trace, fwd_microbatch=1, bwd_microbatch=0)
            return
        combined_step(plans, (self.x_fwd,), None, None, self.streams, trace=trace,
                      fwd_microbatch=1)
        CoScheduler(self.streams, TapeBackward(tape, (self.grad,), 0), trace=trace).finish()

    def traced(self, link: LinkModel | None, combined: bool, annotate: bool = False) -> Traced:
        """One traced run, alone (one side at a time) or combined."""
        plans, tape = self.prepare(link)
        self.streams.waits.clear()
        trace = EventTrace(self.device, annotate=annotate)  # its origin: the start of the run
        start = time.perf_counter()
        self.issue(plans, tape, combined, trace)
        host_ms = (time.perf_counter() - start) * 1e3
        # the host's issue ends where it waits for the streams; a finish that does not wait
        # (stream-ordered) returns when issuing is done
        issue_ms = (self.streams.waits[-1] - start) * 1e3 if self.streams.waits else host_ms
        end = trace.stamp()
        synchronize(self.device)
        return Traced(trace.elapsed_ms(end), host_ms, issue_ms, trace.gpu_spans())

    def traced_median(self, link: LinkModel | None, combined: bool, reps: int,
                      warmup: int = 1) -> Traced:
        """The run of median device time among ``reps`` traced runs (after ``warmup``)."""
        for _ in range(warmup):
            self.traced(link, combined)
        runs = sorted((self.traced(link, combined) for _ in range(reps)),
                      key=lambda r: r.device_ms)
        return runs[len(runs) // 2]

    def plain_ms(self, link: LinkModel | None, reps: int, warmup: int = 1) -> Timed:
        """Median milliseconds of the sequential path: tape forward, then tape backward, on the
        current stream (a fresh microbatch-0 tape per run, recorded outside the timing)."""
        runs = []
        for index in range(warmup + reps):
            plans, tape = self.prepare(link, on_streams=False)

            def run() -> None:
                record_forward(plans, (self.x_fwd,))
                run_backward(tape, (self.grad,))

            timed = time_ms(run, self.device)
            if index >= warmup:
                runs.append(timed)
        return Timed(statistics.median(r.device_ms for r in runs),
                     statistics.median(r.host_ms for r in runs))

    def paired_compute_ms(self) -> float:
        """Mean time of the compute nodes a combined step pairs with an all-to-all (forward and
        backward attention and experts), from one traced run of the nodes alone, no link: a
        link of this time per all-to-all makes communication as long as that compute."""
        alone = self.traced(None, combined=False)
        paired = [d for direction in "FB" for name in ("attention", "experts")
                  for d in alone.node_ms(name, direction)]
        return sum(paired) / len(paired)
