"""An emulated interconnect, for measuring communication/computation overlap without a real one.

gloo on one machine moves tokens almost for free, and a single GPU has no peer at all, so overlap
would have nothing to hide. With an ``EmulatedLink`` every token all-to-all (forward and backward)
takes at least its modelled time ``latency + bytes / bandwidth``:

- on CPU the thread that ran the exchange (the communication stream's worker thread under the
  overlap engine) sleeps for the rest of the modelled time after the real exchange;
- on CUDA the *stream* waits, not the host: a ``torch.cuda._sleep`` of the whole modelled time is
  queued on the current stream (the communication stream under the overlap engine) after the
  real exchange, whose own duration is not known to the host when it queues the sleep. The sleep's
  clock rate is measured once per device and link (``gpu_cycles_per_second``: one synchronising
  measurement the first time the link is used on a device).

The bytes are those sent to other ranks. With ep = 1 (no other rank) ``delay`` models a link that
every row crosses, so a single process or GPU can model one. Off by default; anything measured
with it must say so (``describe()``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

_CALIBRATION_CYCLES = 20_000_000


@dataclass(frozen=True)
class EmulatedLink:
    """A link of ``bandwidth_bytes_per_s`` with a fixed ``latency_s`` per exchange."""

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0
    # measured GPU sleep rate per device index (filled on first use on a GPU)
    _gpu_rate: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError(
                f"EmulatedLink bandwidth_bytes_per_s={self.bandwidth_bytes_per_s} must be > 0"
            )
        if not self.latency_s >= 0:
            raise ValueError(f"EmulatedLink latency_s={self.latency_s} must be >= 0")

    def transfer_time(self, num_bytes: int) -> float:
        """Modelled seconds to send ``num_bytes`` over this link."""
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s

    def wait_rest(
        self, num_bytes: int, started: float, device: torch.device | str | None = None
    ) -> float:
        """Stretch an exchange of ``num_bytes`` to its modelled time; returns the seconds added.

        On CPU: sleep until ``transfer_time(num_bytes)`` has passed since ``started`` (a
        ``time.perf_counter()`` value). On a CUDA ``device``: queue a GPU sleep of the whole
        modelled time on the current stream; the host goes on at once.
        """
        if device is not None and torch.device(device).type == "cuda":
            seconds = self.transfer_time(num_bytes)
            torch.cuda._sleep(int(seconds * self.gpu_cycles_per_second(device)))
            return seconds
        remaining = self.transfer_time(num_bytes) - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)
            return remaining
        return 0.0

    def gpu_cycles_per_second(self, device: torch.device | str) -> float:
        """How many ``torch.cuda._sleep`` cycles make a second on ``device`` (measured once)."""
        device = torch.device(device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._gpu_rate:
            with torch.cuda.device(index):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(1000)  # warm up the kernel
                start.record()
                torch.cuda._sleep(_CALIBRATION_CYCLES)
                end.record()
                end.synchronize()
                self._gpu_rate[index] = _CALIBRATION_CYCLES / (start.elapsed_time(end) / 1e3)
        return self._gpu_rate[index]

    def delay(self, rows: torch.Tensor) -> torch.Tensor:
        """A copy of ``rows`` written after waiting as if all of them crossed the link (forward
        and backward): the link of an exchange without peers (ep = 1). As over a real link, the
        rows arrive in a new buffer when the transfer ends, so on CUDA a consumer that does not
        wait for the communication stream reads memory not yet written: a missing cross-stream
        wait changes the bits of any bitwise comparison run with a link (the GPU check's race
        detector)."""
        return _LinkDelay.apply(rows, self)

    def describe(self) -> str:
        return (
            f"emulated link ON: {self.bandwidth_bytes_per_s / 1e9:.3g} GB/s, "
            f"{self.latency_s * 1e6:.3g} us latency per all-to-all"
        )


class _LinkDelay(torch.autograd.Function):
    """Identity whose forward and backward each take the link's time for the tensor's bytes."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, link: EmulatedLink) -> torch.Tensor:
        ctx.link = link
        _wait_whole(link, rows)
        return rows.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _wait_whole(ctx.link, grad)
        return grad.clone(), None


def _wait_whole(link: EmulatedLink, tensor: torch.Tensor) -> None:
    link.wait_rest(tensor.numel() * tensor.element_size(), time.perf_counter(), tensor.device)
