"""Replay: every node of a real model stage lasts its profile time, as on the profiled GPU.

``ReplayStage`` is a ``GPTStage`` whose node plans (plain and waved) are wrapped by
``timed_node``: a node does its real (small) work and then sleeps until its profile time has
passed since it started (``time.sleep`` releases the GIL and leaves the core free, as a GPU
kernel leaves the host free). Its backward does the same with the B time: a marker on the node's
outputs notes when autograd reaches the node, one on its inputs sleeps until the B time has
passed (so the sleep is in whichever thread runs the node's backward: the comm stream's worker
for a comm node). Weight gradients the backward deferred into the layer's queue
(``delay_wgrad_compute``, an I action) are wrapped to last the W time between them; a backward
that computed them at once lasts B + W instead. Each timed node also carries its profile times
(``Node.times``), so the combined step places deferred weight gradients by time, as the
simulator does (``wgrad_by_time``). Everything else (streams, combined step, tape,
gloo all-to-alls and p2p) is the real engine.
"""

from __future__ import annotations

import ctypes
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from megapipe.models.gpt import GPTStage
from megapipe.overlap.plan import Fork, LayerState, Node, Plan, WavePlan
from megapipe.sim.profile import NodeProfile, role_of

PR_SET_TIMERSLACK = 29  # linux/prctl.h
TIMER_SLACK_NS = 1  # the smallest slack (0 would restore the default, 50 us)


def precise_sleeps() -> bool:
    """Wake this thread's sleeps, and those of threads it starts later, without Linux's default
    50 us timer slack: a replayed node then ends closer to its profile time, as a kernel does
    (a 9 ms sleep overshot by 0.13 ms here, 0.07 ms without the slack). False off Linux."""
    if not sys.platform.startswith("linux"):
        return False
    return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, TIMER_SLACK_NS, 0, 0, 0) == 0


def sleep_until(deadline: float) -> None:
    rest = deadline - time.perf_counter()
    if rest > 0:
        time.sleep(rest)


class _Clock:
    """One node run's backward: when it began and the W items queued before it."""

    def __init__(self, backward_s: float, weight_s: float, state: LayerState) -> None:
        self.backward_s, self.weight_s, self.state = backward_s, weight_s, state
        self.start = 0.0
        self.queued = 0
        self.done = False

    def begin(self) -> None:
        self.start = time.perf_counter()
        queue = self.state.wgrad_queue
        self.queued = len(queue) if queue is not None else 0

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        queue = self.state.wgrad_queue
        new = (len(queue) - self.queued) if queue is not None else 0
        if new > 0:
            share = self.weight_s / new
            queue.wrap_last(new, lambda fn: _timed_item(fn, share))
            sleep_until(self.start + self.backward_s)
        else:
            sleep_until(self.start + self.backward_s + self.weight_s)


def _timed_item(fn: Callable[[], None], seconds: float) -> Callable[[], None]:
    def run() -> None:
        start = time.perf_counter()
        fn()
        sleep_until(start + seconds)

    return run


class _OutputMark(torch.autograd.Function):
    """Identity; its backward (the first of the node's) starts the node's backward clock."""

    @staticmethod
    # autograd.Function's own arguments
    def forward(ctx, clock: _Clock, has_inputs: bool, *tensors):  # type: ignore[override]
        ctx.clock, ctx.has_inputs = clock, has_inputs
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]  # autograd.Function's own arguments
        ctx.clock.begin()
        if not ctx.has_inputs:  # nothing flows on to the inputs: wait here
            ctx.clock.wait()
        return (None, None, *grads)


class _InputMark(torch.autograd.Function):
    """Identity; its backward (the node's last) waits out the node's backward time."""

    @staticmethod
    # autograd.Function's own arguments
    def forward(ctx, clock: _Clock, *tensors):  # type: ignore[override]
        ctx.clock = clock
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]  # autograd.Function's own arguments
        ctx.clock.wait()
        return (None, *grads)


def _marked(mark: Any, clock: _Clock, extra: tuple, values: tuple) -> tuple:
    """``values`` with the float tensors that need grad passed through ``mark``."""
    picked = [n for n, v in enumerate(values)
              if isinstance(v, torch.Tensor) and v.requires_grad and v.is_floating_point()]
    if not picked or not torch.is_grad_enabled():
        return values
    marked = mark.apply(clock, *extra, *(values[n] for n in picked))
    out = list(values)
    for n, tensor in zip(picked, marked):
        out[n] = tensor
    return tuple(out)


def timed_node(node: Node, profile: NodeProfile, waves: int) -> Node:
    """``node`` lasting its profile time (seconds = profile ms / 1000) forward and backward."""
    role = role_of(node.name)
    forward_s = profile.time(role, "F", waves) / 1e3
    backward_s = profile.time(role, "B", waves) / 1e3
    weight_s = profile.time(role, "W", waves) / 1e3
    times = profile.node_times(role, waves)
    if not (forward_s or backward_s or weight_s):  # nothing to wait for (a MoE layer's finish)
        return replace(node, times=times)

    def fn(state: LayerState, inputs: tuple) -> tuple:
        start = time.perf_counter()
        clock = _Clock(backward_s, weight_s, state)
        marked = _marked(_InputMark, clock, (), tuple(inputs))
        has_inputs = marked is not inputs and any(a is not b for a, b in zip(marked, inputs))
        outputs = node.fn(state, marked)
        outputs = _marked(_OutputMark, clock, (has_inputs,), tuple(outputs))
        sleep_until(start + forward_s)
        return outputs

    # the times travel with the node: the combined step places deferred weight gradients by them
    return replace(node, fn=fn, times=times)


def timed_plan(plan: list, profile: NodeProfile, waves: int = 1) -> list:
    """A layer plan (nodes and forks) with every node timed; a ``WavePlan`` stays one."""
    def wrap(item: Any) -> Any:
        if isinstance(item, Fork):
            branches = tuple(tuple(timed_node(n, profile, waves) for n in b)
                             for b in item.branches)
            return Fork(branches, item.width)
        return timed_node(item, profile, waves)

    nodes = [wrap(item) for item in plan]
    if isinstance(plan, WavePlan):
        forms: dict[int, list] = {}  # the wave forms made so far, by k

        def in_waves(k: int) -> list:
            if k not in forms:
                forms[k] = timed_plan(plan.in_waves(k), profile, k)
            return forms[k]

        return WavePlan(nodes, in_waves, plan.state_type)
    return Plan(nodes, plan.state_type) if isinstance(plan, Plan) else nodes


class ReplayStage(GPTStage):
    """A ``GPTStage`` whose every node lasts its time in ``profile`` (module docstring).

    The timed plans are made once per profile and reused by every forward (their nodes keep
    no state between calls: a node's clock and the layer's state are made per call), so the
    wrapping, which is instrumentation, costs no host time inside the measured steps."""

    def __init__(self, profile: NodeProfile, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.profile = profile
        self._plans: tuple[NodeProfile, list] | None = None  # (profile, its timed plans)

    def layer_plans(self) -> list:
        if self._plans is None or self._plans[0] is not self.profile:
            plans = [timed_plan(plan, self.profile) for plan in super().layer_plans()]
            self._plans = (self.profile, plans)
        return list(self._plans[1])
