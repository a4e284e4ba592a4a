"""The node-level timing model: when each node issued on a rank's two streams runs.

A rank has a compute stream and a communication stream. Issued work runs on its stream in
issue order, each item after the items it ``needs`` (positions of earlier items, on either
stream) have ended. On a CPU host the compute stream is the host thread itself, which also
issues the comm items, so a comm item starts no earlier than the compute items issued before
it have ended (``host_runs_compute``). That is the whole model; it serves three users:

- the pair order's *time rule* (``pair_order``), which times the issues it plans to find the
  gaps where deferred weight gradients fit (``IssueClock``);
- the simulator (``megapipe.sim``), which times every action of a schedule as a program of issues
  (``time_issues``; with ``maximum=np.maximum`` the same float operations run on an array of
  starts, one per action of the same program);
- tests and benchmarks that model one combined step.

``schedule.timing.timeline`` (the unit-cost run of whole actions) is the only other timing model.
Pure Python, no torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

COMPUTE = "compute"
COMM = "comm"
# a deferred W item goes into a gap when at least this share of it runs in what would be idle
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


LayerTimes = Sequence[NodeTimes]  # one per node of a layer, in its ``LayerWalk`` numbering


def time_issues(
    issues: Sequence[Any],
    duration: Callable[[Any], Any],
    host_runs_compute: bool = False,
    start: Any = 0.0,
    maximum: Callable[[Any, Any], Any] = max,
) -> list[tuple[Any, Any]]:
    """(start, end) of every issue (anything with ``stream`` and ``needs``: positions of earlier
    items, or an ``Issue``'s names of earlier issues) when each takes ``duration(issue)``, the
    first starting at ``start`` (module docstring).

    ``start`` may be an array of starts with ``maximum=np.maximum``: the same operations,
    element by element."""
    free = {COMPUTE: start, COMM: start}
    spans: list[tuple[Any, Any]] = []
    ends: dict[Any, Any] = {}  # by position, and by name for an ``Issue``
    for issue in issues:
        begin = free[issue.stream]
        if host_runs_compute and issue.stream == COMM:
            begin = maximum(begin, free[COMPUTE])
        for need in issue.needs:
            begin = maximum(begin, ends[need])
        end = begin + duration(issue)
        free[issue.stream] = end
        ends[len(spans)] = end
        name = getattr(issue, "name", None)
        if name is not None:
            ends[name] = end
        spans.append((begin, end))
    return spans


class IssueClock:
    """The time rule's clock while a combined step is ordered: when each ordered issue ends,
    and the deferred W items queued so far that no gap has taken (per backward layer, oldest
    first). ``add`` times one issue as ``time_issues`` does."""

    def __init__(self, backward: Sequence[LayerTimes], host_runs_compute: bool = False) -> None:
        self.backward = [tuple(layer) for layer in backward]
        self.host_runs_compute = host_runs_compute
        self.forward: list[tuple[NodeTimes, ...]] = []
        self.ends: dict[Any, float] = {}  # per planned issue's name
        self.free = {COMPUTE: 0.0, COMM: 0.0}
        self.queued: deque[tuple[int, deque[float]]] = deque()

    def node_time(self, side: str, layer: int, node: int) -> float:
        """The duration of a forward (``F``) or backward (``B``, deferring) node."""
        if side == "F":
            return self.forward[layer][node].forward
        return self.backward[layer][node].backward_time(True)

    def add(self, stream: str, needs: Sequence[Any], duration: float, name: Any = None) -> None:
        """Plan one issue (``name``: None for one nothing waits for) on ``stream`` after
        ``needs`` (names of earlier issues)."""
        begin = self.free[stream]
        if self.host_runs_compute and stream == COMM:
            begin = max(begin, self.free[COMPUTE])
        begin = max([begin] + [self.ends[n] for n in needs])
        if name is not None:
            self.ends[name] = begin + duration
        self.free[stream] = begin + duration

    def queue(self, layer: int, node: int) -> None:
        """Backward node ``node`` of ``layer`` was ordered on the compute stream: its deferred
        items are queued from here on."""
        items = self.backward[layer][node].wgrad
        if not items:
            return
        if self.queued and self.queued[-1][0] == layer:
            self.queued[-1][1].extend(items)
        else:
            self.queued.append((layer, deque(items)))

    def fill(self, needs: Sequence[Any]) -> list[tuple[int, int, float]]:
        """The W items to run on the compute stream before an issue that waits for ``needs``:
        oldest first, one at a time while at least ``MIN_FILL`` of the next item would run in
        still idle time. As ``(layer, item count, their time)`` per layer in queue order."""
        ready = max([self.ends[n] for n in needs], default=0.0)
        free = self.free[COMPUTE]
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
