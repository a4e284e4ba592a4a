"""MoE transformer layers (attention + MoE, ep = 1) and the runs the overlap sections time.

``build_layers`` makes ``TransformerLayer``s of the reference model directly on the device (on a
GPU built on the meta device, then filled from a seeded device generator: drawing billions of
weights on the host would take minutes); in bf16 they get fp32 ``main_grad``s as in training
(``cast_to_bf16``). ``PairBench`` runs the forward of microbatch 1 and the backward of
microbatch 0 over the same layers three ways:

- ``plain_ms``: forward then backward on the tape, on the current stream (no overlap; a comm
  node's modelled link then runs inline on that stream) -- the sequential time;
- ``traced(combined=False)``: the same nodes issued through the combined step one side at a time
  (forward alone, then backward alone), traced node by node -- each node's own time;
- ``traced(combined=True)``: the combined step, traced node by node.

A ``Variant`` runs the co-scheduled ways with the all-to-alls in k waves (``moe_a2a_waves``:
the layers' plans in waves) and/or the expert weight gradients deferred
(``delay_wgrad_compute``). The node timeline is megapipe's own ``NodeTrace`` (CUDA events on
CUDA). Host time is the time until the step's call returned: ``finish`` is stream-ordered on
CUDA, so there it is the time the host spent issuing (including its wait in the one host read
of each dispatch); on CPU the compute stream is the host thread, so it includes the compute.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import torch

from gpu_sections.gpu_timing import Timed, node_spans, synchronize, time_ms
from gpu_sections.link_model import set_link
from gpu_sections.timeline import Span
from megapipe.models.config import GPTConfig
from megapipe.models.gpt import TransformerLayer
from megapipe.moe.link import EmulatedLink
from megapipe.overlap.combined import BackwardHalf, CombinedStep, combined_step
from megapipe.overlap.node_trace import NodeTrace
from megapipe.overlap.plan import WavePlan
from megapipe.overlap.sequential import record_forward, run_backward
from megapipe.overlap.streams import Streams
from megapipe.overlap.wgrad import WeightGradQueue
from megapipe.train.optim.mixed_precision import cast_to_bf16


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

    def payload_bytes(self, dtype: torch.dtype) -> int:
        """Bytes one token all-to-all of a microbatch moves."""
        return self.rows * self.hidden * torch.empty((), dtype=dtype).element_size()

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
    if dtype == torch.bfloat16:
        cast_to_bf16(layers, [p for layer in layers for p in layer.parameters()])
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
class Variant:
    """How the co-scheduled runs go: all-to-alls in ``waves`` expert groups, weight
    gradients deferred (``delay_wgrad``)."""

    waves: int = 1
    delay_wgrad: bool = False

    def describe(self) -> str:
        parts = ([f"{self.waves} a2a waves"] if self.waves > 1 else []) + (
            ["wgrad delayed"] if self.delay_wgrad else [])
        return ", ".join(parts) or "plain"


BASE = Variant()


@dataclass(frozen=True)
class Traced:
    """A traced run: device and host milliseconds, the nodes' device spans, the exposed share
    of the all-to-all time and the summed node milliseconds per kind (megapipe's NodeTrace)."""

    device_ms: float
    host_ms: float
    spans: list[Span]
    exposed: float
    compute_ms: float
    comm_ms: float

    @classmethod
    def of(cls, timed: Timed, trace: NodeTrace) -> Traced:
        return cls(timed.device_ms, timed.host_ms, node_spans(trace),
                   trace.exposed_comm_fraction(), trace.total("compute") * 1e3,
                   trace.total("comm") * 1e3)

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
        self.layers, self.shape, self.streams, self.device = layers, shape, streams, device
        generator = torch.Generator(device=device).manual_seed(1)

        def draw() -> torch.Tensor:
            return torch.randn(shape.batch, shape.seq, shape.hidden, device=device, dtype=dtype,
                               generator=generator)

        self.x_fwd, self.x_bwd, self.grad = draw().requires_grad_(), draw().requires_grad_(), draw()

    def set_link(self, link: EmulatedLink | None) -> None:
        """The modelled all-to-all of every MoE layer (``link_model``); None: none."""
        set_link([layer.moe for layer in self.layers if layer.is_moe], link)

    def plans(self, variant: Variant = BASE) -> list[list[Any]]:
        plans = [layer.node_plan() for layer in self.layers]
        if variant.waves > 1:
            return [p.in_waves(variant.waves) if isinstance(p, WavePlan) else p for p in plans]
        return plans

    def prepare(self, variant: Variant = BASE, on_streams: bool = True) -> tuple[list, Any]:
        """The plans and a fresh microbatch-0 tape (recorded, not timed).

        ``on_streams``: record it through the combined step, as the executor records every
        forward, so its comm nodes ran on the comm stream -- on CUDA autograd runs a backward op
        on the stream of its forward op, so only then does the backward's all-to-all run on
        the comm stream. Otherwise on the current stream (the sequential path)."""
        plans = self.plans(variant)
        if on_streams:
            _, tape, _ = combined_step(plans, (self.x_bwd,), None, None, self.streams)
        else:
            _, tape = record_forward(plans, (self.x_bwd,))
        synchronize(self.device)
        return plans, tape

    def issue(self, plans: list, tape: Any, combined: bool, variant: Variant = BASE,
              trace: NodeTrace | None = None) -> None:
        """One run through the combined step: combined, or one side at a time (forward alone,
        then backward alone). Returns once issued (CUDA) or done (CPU)."""
        if combined:
            combined_step(plans, (self.x_fwd,), tape, (self.grad,), self.streams,
                          delay_wgrad_compute=variant.delay_wgrad, trace=trace,
                          fwd_microbatch=1, bwd_microbatch=0)
            return
        combined_step(plans, (self.x_fwd,), None, None, self.streams, trace=trace,
                      fwd_microbatch=1)
        wgrad = WeightGradQueue() if variant.delay_wgrad else None
        CombinedStep(self.streams, BackwardHalf(tape, (self.grad,), 0, wgrad), trace=trace).finish()

    def traced(self, combined: bool, variant: Variant = BASE) -> Traced:
        """One traced run, alone (one side at a time) or combined."""
        plans, tape = self.prepare(variant)
        trace = NodeTrace()
        timed = time_ms(lambda: self.issue(plans, tape, combined, variant, trace), self.device)
        return Traced.of(timed, trace)

    def traced_median(self, combined: bool, reps: int, variant: Variant = BASE,
                      warmup: int = 1) -> Traced:
        """The run of median device time among ``reps`` traced runs (after ``warmup``)."""
        for _ in range(warmup):
            self.traced(combined, variant)
        runs = sorted((self.traced(combined, variant) for _ in range(reps)),
                      key=lambda r: r.device_ms)
        return runs[len(runs) // 2]

    def plain_ms(self, reps: int, warmup: int = 1) -> Timed:
        """Median milliseconds of the sequential path: tape forward, then tape backward, on the
        current stream (a fresh microbatch-0 tape per run, recorded outside the timing)."""
        runs = []
        for index in range(warmup + reps):
            plans, tape = self.prepare(on_streams=False)

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
        link of this time per all-to-all makes communication as long as that compute. Leaves
        the layers without a link."""
        self.set_link(None)
        alone = self.traced(combined=False)
        paired = [d for direction in "FB" for name in ("attention", "experts")
                  for d in alone.node_ms(name, direction)]
        return sum(paired) / len(paired)
