"""A device's compute and communication streams: CUDA streams, or the CPU stand-ins.

``make_streams`` picks the implementation of ``streams``' interface for a device: on CUDA the
device's current stream and a new (high-priority) one (``cuda_streams``), on CPU the calling
thread and a worker thread (``streams``).
"""

from __future__ import annotations

import torch

from megapipe.overlap.cuda_streams import CudaStream
from megapipe.overlap.streams import InlineStream, Streams, WorkerStream


def make_streams(device: torch.device | str = "cpu", high_priority_comm: bool = True) -> Streams:
    """Compute + communication streams for ``device``. CUDA: the device's current stream and a
    new one (high priority unless ``high_priority_comm`` is False). CPU: the calling thread and
    a worker thread."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"make_streams({device}) needs CUDA, which is not available")
        # out-of-range priorities map to the nearest valid one: -1000 means the highest
        priority = -1000 if high_priority_comm else 0
        return Streams(
            CudaStream("compute", device, stream=torch.cuda.current_stream(device), current=True),
            CudaStream("comm", device, priority=priority),
        )
    if device.type == "cpu":
        return Streams(InlineStream("compute"), WorkerStream("comm"))
    raise ValueError(f"make_streams: device type {device.type!r} is not supported (cpu or cuda)")
