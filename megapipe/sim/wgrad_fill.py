"""Deferred weight gradients placed by time: W items go where the compute stream would wait.

The pair planner (``pair_plan.StepPlanner``) splits a backward layer's deferred weight-gradient
items (``delay_wgrad_compute``) by one of two rules:

- **by count** (nodes without times; the default of a training run): the first ceil(n/2) items
  beside the layer's backward dispatch, the rest beside the next backward combine;
- **by time** (every node of the backward carries ``NodeTimes``; the replay benchmark's nodes
  carry their profile times): the planner keeps a clock of the issues it plans (each stream in
  order, each issue after the issues it needs, as the device and host run them) and, before
  each compute node that would wait for an input from the comm stream, runs queued W items in
  the gap, oldest first, one at a time while at least ``MIN_FILL`` (a tenth) of the next item
  would run in what is still idle time. An item may so overrun the gap, delaying the node by up
  to nine tenths of the item: a gap left idle is lost for good, while the delay often vanishes
  in the next gap; the tenth keeps an item out of the sliver the previous one left.

For DeepSeek-V3's profile (issue 15) a MoE layer pair has three such gaps: beside the backward
combine while the forward attention runs, after the backward experts (waiting for the forward
dispatch), after the forward experts (waiting for the backward dispatch). The count rule puts
4.3 ms of W into the 2.9 ms of the last gap and none into the second; the time rule fills all
three: 130.9 ms for four layer pairs (1.86x their 244 ms in sequence) against 135.2 ms. Not a
proof of anything: over 600 random profiles (every time of this one times 0.4 to 1.6, 1 to 3
chunks) the time rule's pair was 2 % shorter than the count rule's on average, up to 12 %
shorter and up to 4 % longer (``MIN_FILL`` from 0.05 to 0.2 gave the same within 0.1 %; 0.5,
"at least half the item in the gap", missed DeepSeek's pair: 1.79x).

Pure Python, no torch: the co-scheduler reads each node's ``NodeTimes`` from its ``Node`` and the
simulator (``node_steps``) from the profile; both plan with the same rule.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

COMPUTE = "compute"
COMM = "comm"
# an item goes into a gap when at least this share of it runs in what would be idle time
MIN_FILL = 0.1


@dataclass(frozen=True)
class NodeTimes:
    """Expected times of one node, in ms (any consistent unit).

    ``backward``: its backward, including any weight gradient it always computes at once;
    ``wgrad``: the weight-gradient items its backward defers when deferral is on (in the order it
    queues them), which a backward without deferral computes at once instead.
    """

    forward: float
    backward: float
    wgrad: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for value in (self.forward, self.backward, *self.wgrad):
            if not value >= 0:
                raise ValueError(f"NodeTimes needs times >= 0, got {self!r}")

    def backward_time(self, defer: bool) -> float:
        """The backward node's own time: without deferral its W items run inside it."""
        return self.backward + (0.0 if defer else sum(self.wgrad))


LayerTimes = Sequence[NodeTimes]  # one per node of a layer, in the planner's node numbering


class WgradClock:
    """The planner's clock in the time rule: when each planned issue ends, and the W items
    queued so far that have not been placed (per backward layer, oldest layer first).
    ``host_runs_compute``: the host is the compute stream (CPU) and reaches a comm issue only
    after the compute issues before it (``time_issues``)."""

    def __init__(self, backward: Sequence[LayerTimes], host_runs_compute: bool = False) -> None:
        self.backward = [tuple(layer) for layer in backward]
        self.host_runs_compute = host_runs_compute
        self.forward: list[tuple[NodeTimes, ...]] = []
        self.ends: list[float] = []
        self.free: dict[str, float] = {COMPUTE: 0.0, COMM: 0.0}
        self.queued: deque[tuple[int, deque[float]]] = deque()

    def node_time(self, side: str, layer: int, node: int) -> float:
        """The duration of a forward (``F``) or backward (``B``, deferring) node."""
        if side == "F":
            return self.forward[layer][node].forward
        return self.backward[layer][node].backward_time(True)

    def add(self, stream: str, needs: Sequence[int], duration: float) -> float:
        """Plan one issue on ``stream`` after ``needs`` (positions of earlier issues); return
        its start."""
        host = self.free[COMPUTE] if self.host_runs_compute and stream == COMM else 0.0
        return issue_clock(self.free, self.ends, stream, needs, duration, host)

    def queue(self, layer: int, node: int) -> None:
        """Backward node ``node`` of ``layer`` was planned on the compute stream: its deferred
        items are queued from here on."""
        items = self.backward[layer][node].wgrad
        if not items:
            return
        if self.queued and self.queued[-1][0] == layer:
            self.queued[-1][1].extend(items)
        else:
            self.queued.append((layer, deque(items)))

    def fill(self, stream: str, needs: Sequence[int]) -> list[tuple[int, int, float]]:
        """The W items to run on ``stream`` before an issue that waits for ``needs``, as
        ``(layer, item count, their time)`` per layer in queue order (module docstring: the time
        rule). The caller plans one issue per entry (``add``)."""
        ready = max([self.ends[n] for n in needs], default=0.0)
        free = self.free[stream]
        taken: list[tuple[int, int, float]] = []
        while self.queued and free + MIN_FILL * self.queued[0][1][0] <= ready:
            layer, items = self.queued[0]
            duration = items.popleft()
            free += duration
            if taken and taken[-1][0] == layer:
                taken[-1] = (layer, taken[-1][1] + 1, taken[-1][2] + duration)
            else:
                taken.append((layer, 1, duration))
            if not items:
                self.queued.popleft()
        return taken


def issue_clock(free: dict[str, float], ends: list[float], stream: str, needs: Sequence[int],
                duration: float, earliest: float = 0.0) -> float:
    """Time one issue: it starts when ``stream`` is ``free``, its ``needs`` (positions in
    ``ends``) have ended and not before ``earliest``; append its end, return its start."""
    start = max([free[stream], earliest] + [ends[n] for n in needs])
    ends.append(start + duration)
    free[stream] = start + duration
    return start


def time_issues(
    issues: Sequence[Any], duration: Callable[[Any], float], host_runs_compute: bool = False
) -> list[tuple[float, float]]:
    """(start, end) of every planned issue (``pair_plan.Issue``) when each takes
    ``duration(issue)``.

    Each stream runs its issues in list order, each issue after its ``needs``: a device whose
    host only queues work (CUDA). With ``host_runs_compute`` (CPU: the compute stream is the
    host thread, which also queues the comm issues in the planned host order) a comm issue also
    starts no earlier than the host reaches it, i.e. the end of the compute issues before it.
    """
    free = {COMPUTE: 0.0, COMM: 0.0}
    ends: list[float] = []
    spans: list[tuple[float, float]] = []
    for issue in issues:
        host = free[COMPUTE] if host_runs_compute and issue.stream == COMM else 0.0
        start = issue_clock(free, ends, issue.stream, issue.needs, duration(issue), host)
        spans.append((start, ends[-1]))
    return spans
