"""A modelled all-to-all on the communication stream, for one-GPU (ep = 1) overlap studies.

With ep = 1 the dispatch and combine nodes move nothing, but megapipe's dispatcher stretches
every token all-to-all to a link's modelled time when it has one (``moe.link.EmulatedLink``:
``delay`` in the forward and in the backward, on the stream the node runs on). The GPU check
gives the MoE layers one of two links (``set_link``), both sized to last about ``ms`` per
all-to-all:

- ``sleep``: megapipe's own ``EmulatedLink``; on CUDA it queues a calibrated
  ``torch.cuda._sleep`` (a one-thread spin kernel), so the stream is busy for the link time but
  the SMs and memory stay free for the experts; on CPU the comm thread sleeps;
- ``copy``: ``CopyLink``, an ``EmulatedLink`` whose wait is a copy of the all-to-all's bytes by
  a Triton kernel on a few SMs (as NCCL's channels do), repeated to last about the link time,
  so it competes with the experts for SMs and memory bandwidth as a real all-to-all does.
  Needs CUDA and Triton (``copy_unavailable`` says why not).

A link never changes a bit: the rows pass through unchanged.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from gpu_sections.gpu_timing import median_ms
from megapipe.moe.layer import MoELayer
from megapipe.moe.link import EmulatedLink

LINK_KINDS = ("sleep", "copy")


def set_link(moe_layers: Iterable[MoELayer], link: EmulatedLink | None) -> None:
    """Give every MoE layer's dispatcher ``link`` (None: no link); plans in waves read it too."""
    for layer in moe_layers:
        layer.dispatcher.link = link


@dataclass(frozen=True)
class CopyLink(EmulatedLink):
    """An ``EmulatedLink`` that spends its time copying: each exchange of ``num_bytes`` is a
    copy of that many bytes, ``repeats`` times, by ``sms`` programs (one per SM) on the current
    stream. Its bandwidth is the measured one (``make_link`` calibrates ``repeats``)."""

    sms: int = 16
    repeats: int = 1

    def wait_rest(self, num_bytes: int, started: float,
                  device: torch.device | str | None = None) -> float:
        link_copy(num_bytes, self.sms, self.repeats, torch.device(device or "cpu"))
        return self.transfer_time(num_bytes)

    def describe(self) -> str:
        return (f"copy link: {self.repeats} copies of each exchange on {self.sms} SMs "
                f"({self.bandwidth_bytes_per_s / 1e9:.3g} GB/s)")


def make_link(kind: str, ms: float, device: torch.device, payload_bytes: int,
              sms: int = 16) -> EmulatedLink:
    """A link of ``kind`` on which one all-to-all of ``payload_bytes`` lasts about ``ms``,
    calibrated on ``device`` now (so no calibration runs inside a timed step)."""
    if kind not in LINK_KINDS:
        raise ValueError(f"link kind {kind!r} is not one of {LINK_KINDS}")
    if not ms > 0 or not payload_bytes > 0:
        raise ValueError(f"a link needs ms > 0 and payload_bytes > 0, got {ms}, {payload_bytes}")
    if kind == "sleep":
        link = EmulatedLink(bandwidth_bytes_per_s=payload_bytes / (ms / 1e3))
        if device.type == "cuda":
            link.gpu_cycles_per_second(device)
        return link
    one = median_ms(lambda: link_copy(payload_bytes, sms, 1, device), device, reps=3).device_ms
    repeats = max(1, round(ms / one))
    return CopyLink(bandwidth_bytes_per_s=payload_bytes / (repeats * one / 1e3), sms=sms,
                    repeats=repeats)


def copy_unavailable(device: torch.device) -> str | None:
    """Why the copy link cannot run here (None: it can)."""
    if device.type != "cuda":
        return "needs CUDA (a Triton copy kernel on a few SMs)"
    if importlib.util.find_spec("triton") is None:
        return "needs Triton, which is not installed"
    return None


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


def copy_words(src: torch.Tensor, sms: int, repeats: int) -> torch.Tensor:
    """Copy the 32-bit words of ``src`` ``repeats`` times with ``sms`` programs into a new
    buffer on the current stream; returns the buffer."""
    if not src.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the copy link needs a CUDA tensor (a Triton kernel on a few SMs)")
    flat = src.contiguous().view(-1)
    dst = torch.empty_like(flat)
    _copy_kernel()[(sms,)](flat, dst, flat.numel(), repeats, BLOCK=1024)
    return dst


def link_copy(num_bytes: int, sms: int, repeats: int, device: torch.device) -> torch.Tensor:
    """The copy link's work for one exchange of ``num_bytes``: a scratch buffer of that size
    (its contents do not matter, only the traffic) copied by ``copy_words``."""
    src = torch.empty(max(1, num_bytes // 4), dtype=torch.float32, device=device)
    return copy_words(src, sms, repeats)
