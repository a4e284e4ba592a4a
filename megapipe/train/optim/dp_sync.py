"""Bucketed data-parallel gradient reduction and parameter all-gather on a communication stream.

``DataParallelSync`` drives the collectives of the flat buffers (``grad_buffers``) of this
rank's stages. It implements the engine's ``GradSyncHooks`` (``pipeline.grad_points``), so the
executor tells it, during a training step, when each stage's last backward is done.

Reductions (dense gradients summed over the DP group, experts over the expert-DP group, both
then divided by dp, as ``pipeline.grad_sync`` does): all-reduce of each bucket, or with the
distributed optimizer reduce-scatter into each rank's shard. When one starts:

- ``overlap=False``: every bucket after the step (``step_finished``);
- ``overlap=True`` (``--overlap-grad-reduce``): a bucket as soon as its gradients are final in
  the step. Each parameter's post-accumulate hook moves autograd's gradient into its
  ``main_grad`` and, during the stage's last backward (``before_last_backward`` ..
  ``stage_grads_final``), counts it. A bucket whose parameters have all received as many
  gradients as in the first step starts at once (Megatron's rule; the first step records the
  counts, and the ranks of each group check once that they agree); a bucket holding a
  parameter whose gradient comes outside autograd (a deferred weight gradient) starts when the
  executor says the stage's gradients are final. Per buffer the buckets start in index order,
  so every rank of a group issues the same collectives in the same order. A gradient arriving
  for a bucket already being reduced is an error, not a silent wrong sum.

Everything runs on one communication stream (a worker thread on CPU, a CUDA stream on GPUs):
before a reduction it waits for the compute stream (an event), and ``finish_grad_sync`` makes
the compute stream wait for it (an event wait on CUDA; the host waits on CPU). No host sync in
the step on CUDA. The DP and expert-DP groups are driven from this stream only.

Parameter all-gather (distributed optimizer): ``start_param_gather`` after the optimizer step
queues one all-gather per bucket, in the order the next step's forwards need them. Without
``overlap_param_gather`` the compute stream waits for all of them at once; with it, each
module's forward pre-hook waits only for the buckets of its own parameters, so the gathers
overlap the next step's first forwards. ``finish_param_gather`` waits for whatever is left
(before an evaluation or a checkpoint). A stage whose last backward ends with a gather never
waited for had a parameter used outside its module's forward call: that is an error.

With a ``trace`` (a ``NodeTrace``) set, every collective is a span of kind ``"dp"`` on stream
``"dp"`` and each wait of the compute stream for it a span of kind ``"dp_wait"``. With an
emulated ``link`` (``--dp-emulated-link-gbps``, CPU overlap studies) every collective lasts at
least the time its ring traffic takes on that link: (n - 1) / n of the bucket's bytes per rank
for a reduce-scatter or an all-gather, twice that for an all-reduce (``moe.link.EmulatedLink``:
the stream's thread sleeps on CPU, the stream itself on CUDA).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megapipe.moe.link import EmulatedLink
from megapipe.overlap.cuda_streams import CudaEvent, CudaStream
from megapipe.overlap.node_trace import NodeTrace
from megapipe.overlap.streams import Event, InlineStream, Streams, WorkerStream
from megapipe.precision.main_grad import accumulate_grad
from megapipe.train.optim.grad_buffers import Bucket, FlatBuffer

DP_KIND, DP_WAIT_KIND, DP_STREAM = "dp", "dp_wait", "dp"

# torch 2.13 renames the tensor forms of the two collectives (the old names warn)
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def dp_streams(device: torch.device) -> Streams:
    """The compute stream (the device's current one, or the host thread) and a new
    communication stream ``"dp"`` for the data-parallel collectives."""
    if device.type == "cuda":
        compute = CudaStream("compute", device, stream=torch.cuda.current_stream(device))
        return Streams(compute, CudaStream(DP_STREAM, device))
    return Streams(InlineStream("compute"), WorkerStream(DP_STREAM))


def wait_on_current_stream(event: Event) -> None:
    """Make the work issued next on the current stream start after ``event``: a CUDA stream
    wait, or on CPU a host wait."""
    if isinstance(event, CudaEvent):
        torch.cuda.current_stream(event.producer.device).wait_event(event.event)
    else:
        event.synchronize()


class DataParallelSync:
    """Reductions and gathers of ``buffers`` ({stage: its flat buffers}) of the modules
    ``stages`` ({stage: module}); see the module docstring."""

    def __init__(
        self,
        stages: dict[int, nn.Module],
        buffers: dict[int, list[FlatBuffer]],
        dp: int,
        device: torch.device,
        overlap: bool,
        overlap_param_gather: bool = False,
        link: EmulatedLink | None = None,
    ) -> None:
        self.buffers = buffers
        self.dp = dp
        self.link = link
        self.overlap = overlap
        self.overlap_param_gather = overlap_param_gather
        self.sharded = any(b.sharded for bs in buffers.values() for b in bs)
        self.streams = dp_streams(device)
        self.trace: NodeTrace | None = None
        self._stage_of: dict[int, int] = {}  # id(param) or id(buffer) -> its stage
        self._where: dict[int, tuple[FlatBuffer, int]] = {}  # id(param) -> buffer, bucket
        self._hooks: list[Any] = []  # handles: gradient hooks, gather waits
        for stage, stage_buffers in buffers.items():
            for buffer in stage_buffers:
                self._stage_of[id(buffer)] = stage
                for param in buffer.params:
                    self._stage_of[id(param)] = stage
                    self._where[id(param)] = (buffer, buffer.bucket_of[id(param)])
                    self._hooks.append(param.register_post_accumulate_grad_hook(self._grad_arrived))
        self._golden: dict[int, int] | None = None  # id(param) -> gradients in its last backward
        self._early: dict[int, bool] = {}  # id(buffer) -> whether hooks may start its buckets
        self._counts: dict[int, int] = {}
        # id(buffer) -> per bucket, its parameters whose count is not yet the golden one
        self._missing: dict[int, list[int]] = {}
        self._counting: set[int] = set()
        self._next: dict[int, int] = {}  # id(buffer) -> its next bucket to start
        self._pending: list[Event] = []  # reductions started this step
        self._gathers: dict[tuple[int, int], Event] = {}  # (id(buffer), bucket) -> all-gather
        if self.sharded and overlap_param_gather:
            self._hooks += self._register_gather_waits(stages)

    # ------------------------------------------------------------- GradSyncHooks
    def step_started(self, forward_stages: Sequence[int]) -> None:
        self._counts = {}
        self._missing = {
            id(b): [len(bucket.params) for bucket in b.buckets]
            for bs in self.buffers.values()
            for b in bs
        }
        self._counting = set()
        self._pending = []
        self._next = {id(b): 0 for bs in self.buffers.values() for b in bs}

    def before_first_forward(self, stage: int) -> None:
        pass  # the parameters' own modules wait for their gathers (forward pre-hooks)

    def before_last_backward(self, stage: int) -> None:
        if self.overlap:
            self._counting.add(stage)

    def after_last_backward(self, stage: int) -> None:
        pass  # deferred weight gradients may still come (a W): counted until final

    def stage_grads_final(self, stage: int) -> None:
        self._check_gathers_waited(stage)
        self._counting.discard(stage)
        if self.overlap:
            for buffer in self.buffers[stage]:
                self._start_through(buffer, len(buffer.buckets))

    def step_finished(self) -> None:
        if self.overlap and self._golden is None:
            self._record_golden()
        for stage in sorted(self.buffers):
            for buffer in self.buffers[stage]:
                self._start_through(buffer, len(buffer.buckets))

    # ------------------------------------------------------------- reductions
    def _grad_arrived(self, param: torch.Tensor) -> None:
        """Post-accumulate hook: move autograd's gradient into ``main_grad``; count it."""
        if param.grad is not None:  # None: a deferred weight gradient, outside autograd
            accumulate_grad(param, param.grad)  # into main_grad
            param.grad = None
            self.grad_added(param)

    def grad_added(self, param: torch.Tensor) -> None:
        """Count a gradient added into ``main_grad`` (the hook's, a graph's backward replay)."""
        key = id(param)
        buffer, bucket = self._where[key]
        if bucket < self._next.get(id(buffer), 0):
            raise RuntimeError(
                f"a parameter of shape {tuple(param.shape)} (stage {self._stage_of[key]}, "
                f"{buffer.kind} bucket {bucket}) received a gradient after its bucket's "
                f"reduction had started (it received {(self._golden or {}).get(key)} in the "
                "first step's last backward); its gradient count changed between steps"
            )
        if self._stage_of[key] not in self._counting:
            return
        count = self._counts[key] = self._counts.get(key, 0) + 1
        if self._golden is not None and self._early[id(buffer)]:
            # a bucket is complete when each of its parameters has exactly its golden count
            # (one that had none in the first step never completes it: it waits for final)
            want = self._golden.get(key, 0)
            missing = self._missing[id(buffer)]
            if want and count == want:
                missing[bucket] -= 1
            elif want and count == want + 1:
                missing[bucket] += 1
            ready = self._next[id(buffer)]
            while ready < len(buffer.buckets) and missing[ready] == 0:
                ready += 1
            self._start_through(buffer, ready)

    def _start_through(self, buffer: FlatBuffer, stop: int) -> None:
        """Start the reductions of ``buffer``'s buckets from its next one up to ``stop``."""
        key = id(buffer)
        first = self._next[key]
        if first >= stop:
            return
        self._next[key] = stop
        if buffer.group_size == 1 and self.dp == 1:
            return  # nothing to sum, nothing to divide
        ready = self.streams.compute.record_event()
        self.streams.comm.wait_event(ready)
        for bucket in buffer.buckets[first:stop]:
            self._pending.append(self.streams.comm.submit(self._reduce, buffer, bucket))

    def _reduce(self, buffer: FlatBuffer, bucket: Bucket) -> None:
        what = (
            "average"
            if buffer.group_size == 1
            else "reduce-scatter"
            if buffer.sharded
            else "all-reduce"
        )
        with self._span(f"{what} {self._name(buffer, bucket)}", "R"):
            whole = buffer.grad[bucket.start : bucket.end]
            lo, hi = buffer.shard_range(bucket)
            if buffer.group_size > 1:
                started = time.perf_counter()
                if buffer.sharded:
                    _reduce_scatter(buffer.grad[lo:hi], whole, group=buffer.group)
                else:
                    dist.all_reduce(whole, group=buffer.group)
                self._link_wait(whole, 1 if buffer.sharded else 2, buffer.group_size, started)
            if self.dp > 1:
                buffer.grad[lo:hi].div_(self.dp)

    def finish_grad_sync(self) -> None:
        """The compute stream waits for every reduction of the step."""
        if not self._pending:
            return
        done = self._pending[-1]  # the stream runs them in order
        self._pending = []
        with self._span("wait for the gradient reductions", "R", wait=True):
            self.streams.compute.wait_event(done)

    def _record_golden(self) -> None:
        """After the first step: how many gradients each parameter received in its last
        backward; a buffer starts buckets early only if every rank of its group agrees."""
        self._golden = dict(self._counts)
        for stage_buffers in self.buffers.values():
            for buffer in stage_buffers:
                counts = torch.tensor(
                    [self._golden.get(id(p), 0) for p in buffer.params], device=buffer.grad.device
                )
                self._early[id(buffer)] = self.run_collective(_agree, counts, buffer.group)

    # ------------------------------------------------------------- parameter gathers
    def start_param_gather(self) -> None:
        """After the optimizer step: all-gather every bucket's updated shards (sharded only),
        in the order the next step's forwards use them; wait for them now unless
        ``overlap_param_gather``."""
        if not self.sharded:
            return
        updated = self.streams.compute.record_event()
        self.streams.comm.wait_event(updated)
        for stage in sorted(self.buffers):
            for buffer in self.buffers[stage]:
                if buffer.group_size == 1:
                    continue
                for bucket in reversed(buffer.buckets):  # the forward meets the last first
                    self._gathers[(id(buffer), bucket.index)] = self.streams.comm.submit(
                        self._gather, buffer, bucket
                    )
        if not self.overlap_param_gather:
            self.finish_param_gather()

    def _gather(self, buffer: FlatBuffer, bucket: Bucket) -> None:
        assert buffer.data is not None
        with self._span(f"all-gather {self._name(buffer, bucket)}", "G"):
            lo, hi = buffer.shard_range(bucket)
            whole = buffer.data[bucket.start : bucket.end]
            started = time.perf_counter()
            _all_gather(whole, buffer.data[lo:hi], group=buffer.group)
            self._link_wait(whole, 1, buffer.group_size, started)

    def _link_wait(self, whole: torch.Tensor, passes: int, ranks: int, started: float) -> None:
        """Stretch a collective to its ring traffic's time on the emulated link (if any)."""
        if self.link is not None:
            sent = passes * (ranks - 1) * whole.numel() * whole.element_size() // ranks
            self.link.wait_rest(sent, started, whole.device)

    def finish_param_gather(self) -> None:
        """The compute stream waits for every parameter gather not yet waited for."""
        if not self._gathers:
            return
        last = list(self._gathers.values())[-1]
        self._gathers.clear()
        with self._span("wait for the parameter gathers", "G", wait=True):
            self.streams.compute.wait_event(last)

    def _register_gather_waits(self, stages: dict[int, nn.Module]) -> list[Any]:
        """A forward pre-hook on every module holding parameters directly: wait for the
        gathers of the buckets of those parameters."""
        handles = []
        for module in stages.values():
            for sub in module.modules():
                keys = sorted(
                    {
                        (id(self._where[id(p)][0]), self._where[id(p)][1])
                        for p in sub.parameters(recurse=False)
                        if id(p) in self._where
                    }
                )
                if keys:
                    handles.append(sub.register_forward_pre_hook(_wait_hook(self, keys)))
        return handles

    def wait_before_replays(self, graphs: Any) -> None:
        """With CUDA graphs (``graphs.nodes.NodeGraphs``): a replay runs no module hook, so
        before each forward replay of a captured node the engine waits for the gathers of its
        parameters' buckets (outside the graph, on the stream it replays on)."""
        if self.sharded and self.overlap_param_gather:
            graphs.before_replay.append(self.wait_param_gathers)

    def wait_param_gathers(self, params: Sequence[torch.Tensor]) -> None:
        """The current stream waits for the gathers of the buckets holding ``params``."""
        where = [self._where[id(p)] for p in params if id(p) in self._where]
        self._wait_gathers(sorted({(id(buffer), bucket) for buffer, bucket in where}))

    def _wait_gathers(self, keys: Sequence[tuple[int, int]]) -> None:
        for key in keys:
            event = self._gathers.pop(key, None)
            if event is not None:
                wait_on_current_stream(event)

    def _check_gathers_waited(self, stage: int) -> None:
        left = [(b.kind, i) for b in self.buffers[stage] for (k, i) in self._gathers if k == id(b)]
        if left:
            raise RuntimeError(
                f"stage {stage} ran its forwards with parameter all-gathers never waited for "
                f"({', '.join(f'{kind} bucket {i}' for kind, i in left)}): a parameter was used "
                "outside its module's forward call, which --overlap-param-gather needs"
            )

    # ------------------------------------------------------------- helpers
    def run_collective(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` (a collective over a DP or expert-DP group) on the stream that
        owns those groups and return its value (waits: outside the hot path)."""
        self.streams.comm.wait_event(self.streams.compute.record_event())
        return self.streams.comm.submit(fn, *args).value_on(self.streams.compute)

    def _name(self, buffer: FlatBuffer, bucket: Bucket) -> str:
        """``s2 dense bucket 0 (1.2 MB)``: stage, kind, index, gradient bytes."""
        megabytes = (bucket.end - bucket.start) * buffer.grad.element_size() / 1e6
        return (
            f"s{self._stage_of[id(buffer)]} {buffer.kind} bucket {bucket.index} "
            f"({megabytes:.3g} MB)"
        )

    def _span(self, label: str, direction: str, wait: bool = False) -> Any:
        if self.trace is None:
            return nullcontext()
        stream = self.streams.compute if wait else self.streams.comm
        return self.trace.span(
            None, -1, label, direction, stream, DP_WAIT_KIND if wait else DP_KIND
        )

    def close(self) -> None:
        """Remove the hooks and stop the stream's thread. The compute stream first waits for
        the parameter gathers issued after the last step: the flat buffers they write are freed
        with the job, and on CUDA a block freed while a gather still writes it is reused."""
        self.finish_param_gather()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.streams.comm.close()


def _agree(counts: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    """Whether every rank of ``group`` has the same ``counts`` (one host read, once)."""
    if group is None or dist.get_world_size(group) == 1:
        return True
    low, high = counts.clone(), counts.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    return bool(torch.equal(low, high))


def _wait_hook(sync: DataParallelSync, keys: list[tuple[int, int]]) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any) -> None:
        sync._wait_gathers(keys)

    return hook
