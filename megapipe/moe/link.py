"""An emulated interconnect, for measuring communication/computation overlap on CPU.

gloo on one machine moves tokens almost for free, so overlap would have nothing to hide. With an
``EmulatedLink`` the dispatcher, after each real all-to-all, sleeps on the thread that ran it
(the communication stream's thread under the overlap engine) for the rest of the modelled time
``latency + bytes sent to other ranks / bandwidth``. Off by default; anything measured with it
must say so (``describe()``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class EmulatedLink:
    """A link of ``bandwidth_bytes_per_s`` with a fixed ``latency_s`` per exchange."""

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0

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

    def wait_rest(self, num_bytes: int, started: float) -> float:
        """Sleep until ``transfer_time(num_bytes)`` has passed since ``started``
        (a ``time.perf_counter()`` value); returns the seconds slept."""
        remaining = self.transfer_time(num_bytes) - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)
            return remaining
        return 0.0

    def describe(self) -> str:
        return (
            f"emulated link ON: {self.bandwidth_bytes_per_s / 1e9:.3g} GB/s, "
            f"{self.latency_s * 1e6:.3g} us latency per all-to-all"
        )
