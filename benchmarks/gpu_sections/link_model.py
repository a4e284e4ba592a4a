"""A modelled all-to-all on the communication stream, for one-GPU (ep = 1) overlap studies.

With ep = 1 the dispatch and combine nodes move nothing. To study the overlap on one GPU their
all-to-all is modelled on the stream the node runs on (the comm stream under the co-scheduler),
in the forward and again in the backward (the reverse exchange), in one of two ways:

- ``sleep``: a timed wait for the link, ``torch.cuda._sleep`` (a one-thread spin kernel), so the
  stream is busy for the link time but the SMs and memory stay free for the experts;
- ``copy``: a copy of the all-to-all payload by a Triton kernel on a few SMs (as NCCL's
  channels do), repeated to last about the link time, so it competes with the experts for SMs
  and memory bandwidth as a real all-to-all does.

On CPU (dry run) ``sleep`` sleeps on the thread running the node (the comm stream's worker);
``copy`` needs CUDA and Triton. The modelled link is an identity: the bits do not change.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import time
from dataclasses import dataclass

import torch

from megapipe.overlap.plan import Node, NodeKind

from gpu_sections.gpu_timing import median_ms, sleep_cycles_per_ms

LINK_KINDS = ("sleep", "copy")


@dataclass(frozen=True)
class LinkModel:
    """``kind`` "sleep" or "copy"; ``ms`` the modelled time of one all-to-all.

    sleep: ``cycles_per_ms`` from ``gpu_timing.sleep_cycles_per_ms`` (CUDA only).
    copy: ``sms`` programs copy the payload ``repeats`` times (``calibrate_copy``)."""

    kind: str
    ms: float
    cycles_per_ms: float = 0.0
    sms: int = 16
    repeats: int = 1

    def __post_init__(self) -> None:
        if self.kind not in LINK_KINDS:
            raise ValueError(f"link kind {self.kind!r} is not one of {LINK_KINDS}")
        if not self.ms >= 0:
            raise ValueError(f"link time {self.ms} ms must be >= 0")

    def spend(self, payload: torch.Tensor) -> None:
        """Occupy the current stream for the link time (``payload``: what the exchange moves)."""
        if self.kind == "copy":
            link_copy(payload, self.sms, self.repeats)
        elif payload.is_cuda:
            torch.cuda._sleep(max(1, int(self.ms * self.cycles_per_ms)))
        else:
            time.sleep(self.ms / 1e3)


class _Linked(torch.autograd.Function):
    """Identity that spends the link time in forward (the exchange) and backward (its reverse)."""

    @staticmethod
    def forward(ctx, x, link):  # type: ignore[override]
        ctx.link = link
        link.spend(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.link.spend(grad)
        return grad, None


def with_link(plan: list[Node], link: LinkModel | None) -> list[Node]:
    """``plan`` with the link modelled after every comm node (on that node's own output)."""
    if link is None:
        return list(plan)
    return [Node(n.name, n.kind, _after(n.fn, link), n.group) if n.kind == NodeKind.COMM else n
            for n in plan]


def _after(fn, link: LinkModel):  # noqa: ANN001, ANN202
    def run(state, tensors):  # noqa: ANN001, ANN202
        out = tuple(fn(state, tensors))
        return out[:-1] + (_Linked.apply(out[-1], link),)

    return run


def payload_bytes(rows: int, hidden: int, dtype: torch.dtype) -> int:
    """Bytes one token all-to-all moves for ``rows`` routed rows of ``hidden`` values."""
    return rows * hidden * torch.empty((), dtype=dtype).element_size()


# ---- the copy kernel (CUDA + Triton) -------------------------------------------------------

@functools.cache
def _copy_kernel():  # noqa: ANN202
    """The Triton kernel, defined on first use (Triton is imported only here)."""
    import triton
    import triton.language as tl

    @triton.jit
    def link_copy_kernel(src, dst, n, repeats, BLOCK: tl.constexpr):
        step = tl.num_programs(0) * BLOCK
        for _repeat in range(repeats):
            for start in range(tl.program_id(0) * BLOCK, n, step):
                offsets = start + tl.arange(0, BLOCK)
                mask = offsets < n
                tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)

    return link_copy_kernel


def link_copy(payload: torch.Tensor, sms: int, repeats: int) -> torch.Tensor:
    """Copy ``payload`` ``repeats`` times with ``sms`` programs (one per SM) into a scratch
    buffer on the current stream; returns the buffer."""
    if not payload.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the copy link model needs a CUDA tensor (a Triton kernel on a few SMs)")
    src = payload.contiguous().view(-1)
    dst = torch.empty_like(src)
    _copy_kernel()[(sms,)](src, dst, src.numel(), repeats, BLOCK=1024)
    return dst


def copy_unavailable(device: torch.device) -> str | None:
    """Why the copy link model cannot run here (None: it can)."""
    if device.type != "cuda":
        return "needs CUDA (a Triton copy kernel on a few SMs)"
    if importlib.util.find_spec("triton") is None:
        return "needs Triton, which is not installed"
    return None


def make_link(kind: str, ms: float, device: torch.device, payload: torch.Tensor | None = None,
              sms: int = 16) -> LinkModel:
    """A link of ``kind`` lasting about ``ms`` per all-to-all, calibrated on this device
    (``payload``: a tensor shaped like one all-to-all's rows, for the copy model)."""
    if kind == "sleep":
        cycles = sleep_cycles_per_ms(device) if device.type == "cuda" else 0.0
        return LinkModel("sleep", ms, cycles_per_ms=cycles)
    if payload is None:
        raise ValueError("the copy link model needs a payload tensor to calibrate on")
    repeats, _ = calibrate_copy(payload, sms, ms)
    return LinkModel("copy", ms, sms=sms, repeats=repeats)


def calibrate_copy(payload: torch.Tensor, sms: int, target_ms: float) -> tuple[int, float]:
    """Repeats of the payload copy on ``sms`` SMs that last about ``target_ms``, and the
    measured milliseconds of one copy."""
    one = median_ms(lambda: link_copy(payload, sms, 1), payload.device, reps=3).device_ms
    return max(1, round(target_ms / one)), one
