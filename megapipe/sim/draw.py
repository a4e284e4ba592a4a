"""PNG timeline of a simulated run: ranks top to bottom, time left to right.

One colour per action kind (F, B, I, W); later stages of a rank (virtual pipeline chunks) are
drawn in a lighter shade of the same colour. Each box carries its microbatch number. An OVERLAP
is one outlined box split in two halves: its forward on top, its backward below. When the
all-to-all costs time, a thin strip under each rank shows it: grey where it runs beside compute
(hidden), red where the rank waits for it (exposed).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..pairing.timing import COMM, COMPUTE
from ..schedule.ir import Action, Kind, plain_key
from ..schedule.timing.intervals import subtract
from .simulate import SimResult

_COLOURS = {
    Kind.F: "#1f5fbf",  # blue
    Kind.B: "#e07b00",  # orange
    Kind.I: "#0f8f8f",  # teal
    Kind.W: "#3a9a3a",  # green
}
_NAMES = {
    Kind.F: "F forward",
    Kind.B: "B backward",
    Kind.I: "I input grad",
    Kind.W: "W weight grad",
}
_EXPOSED = "#d62728"
_HIDDEN = "#b0b0b0"


def _lighten(colour: str, amount: float) -> tuple[float, float, float]:
    r, g, b = (int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5))
    return r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount


def _title(result: SimResult, title: str | None) -> str:
    head = title or result.name or "schedule"
    low, high = min(result.bubble, default=0), max(result.bubble, default=0)
    per_rank = f"{high:.3g} per rank" if high - low < 1e-9 else f"{low:.3g} to {high:.3g} per rank"
    metrics = (
        f"makespan {result.makespan:g}   bubble {result.bubble_fraction:.1%} ({per_rank})   "
        f"peak in flight {max(result.peak_in_flight, default=0)}"
    )
    if sum(result.comm):
        metrics += f"   exposed all-to-all {result.exposed_comm_fraction:.1%}"
    return f"{head}\n{metrics}\ncosts: {result.costs.describe()}"


@dataclass
class _Box:
    x: float
    y: float
    width: float
    height: float
    face: tuple[float, float, float] | str  # a colour (RGB, or "#rrggbb"), or "none"
    edge: str = "white"
    line: float = 0.5


@dataclass(frozen=True)
class _Geometry:
    """Where and how boxes go: the shade of each stage, the box height, the label size."""

    local_chunk: dict[int, int]
    chunks: int
    span: float
    axes_width_in: float
    box_h: float

    @property
    def top(self) -> float:
        """The boxes of rank r span r + top .. r + top + box_h."""
        return -self.box_h / 2

    def shade(self, action: Action) -> tuple[float, float, float]:
        stage, _ = plain_key(action)
        amount = 0.45 * self.local_chunk.get(stage, 0) / max(self.chunks - 1, 1)
        return _lighten(_COLOURS[action.kind], amount)

    def label(self, ax, box: _Box, text: str) -> None:
        box_in = box.width / self.span * self.axes_width_in
        size = min(9.0, box_in * 72 / (0.62 * len(text) + 0.4), box.height * 0.75 * 72 * 0.75)
        face = box.face
        assert not isinstance(face, str)  # a labelled box is an action's, in its shade
        luminance = 0.3 * face[0] + 0.59 * face[1] + 0.11 * face[2]
        if size >= 4.5:
            ax.text(
                box.x + box.width / 2,
                box.y + box.height / 2,
                text,
                ha="center",
                va="center",
                fontsize=size,
                fontweight="bold",
                color="black" if luminance > 0.6 else "white",
            )


def draw_timeline(
    result: SimResult, path: str, title: str | None = None, stage_to_rank: tuple[int, ...] = ()
) -> None:
    """Write the timeline of ``result`` as a PNG to ``path``.

    ``title`` defaults to the schedule's name; the metrics are always added below it.
    ``stage_to_rank`` (the schedule's placement) lets later stages of a rank get lighter shades;
    without it the shades are inferred from the stages each rank runs.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pp = result.pp
    local_chunk = _local_chunks(result, stage_to_rank)
    show_comm = sum(result.comm) > 0
    per_rank = max((len(result.actions_of(r)) for r in range(pp)), default=1)
    width = min(max(10.0, 0.42 * per_rank + 2.5), 40.0)
    fig, ax = plt.subplots(figsize=(width, 2.0 + 0.75 * pp), dpi=110)
    geometry = _Geometry(
        local_chunk,
        max(local_chunk.values(), default=0) + 1,
        result.makespan or 1.0,
        width * 0.86,
        0.62 if show_comm else 0.8,
    )
    boxes, seen = _action_boxes(result, geometry, ax)
    if show_comm:
        boxes += _comm_boxes(result, geometry.top + geometry.box_h + 0.04, 0.16)
    _draw_boxes(ax, boxes)
    _label_axes(ax, result, geometry, _title(result, title), seen)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def _draw_boxes(ax, boxes: list[_Box]) -> None:
    """Every box, actions and all-to-alls, as one matplotlib collection on ``ax``."""
    from matplotlib.collections import PolyCollection

    ax.add_collection(
        PolyCollection(
            [
                [
                    (b.x, b.y),
                    (b.x + b.width, b.y),
                    (b.x + b.width, b.y + b.height),
                    (b.x, b.y + b.height),
                ]
                for b in boxes
            ],
            facecolors=[b.face for b in boxes],
            edgecolors=[b.edge for b in boxes],
            linewidths=[b.line for b in boxes],
        )
    )


def _label_axes(ax, result: SimResult, geometry: _Geometry, title: str, seen: set) -> None:
    """The axes' limits and rank labels, the title with the metrics, and the legend of the
    kinds ``seen``."""
    pp = result.pp
    ax.set_xlim(0, geometry.span)
    ax.set_ylim(pp - 0.5, -0.5)
    ax.set_yticks(range(pp))
    ax.set_yticklabels([f"rank {r}" for r in range(pp)])
    ax.set_xlabel("time (cost units);  numbers in boxes: microbatch")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(title, fontsize=10, loc="left")
    handles = _legend_handles(result, geometry, seen)
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.4 / (0.75 * pp)),
        ncol=min(len(handles), 4),
        fontsize=8,
        frameon=False,
    )


def _action_boxes(result: SimResult, geometry: _Geometry, ax) -> tuple[list[_Box], set]:
    """One box per action (an OVERLAP: its two halves and an outline), labelled; and the
    (kind, chunk) pairs seen, plus ``"overlap"`` if any OVERLAP was drawn."""
    boxes: list[_Box] = []
    seen: set = set()
    for timed in result.timeline:
        y, length = timed.rank + geometry.top, timed.end - timed.start
        halves = timed.action.computations()
        for i, half in enumerate(halves):
            seen.add((half.kind, geometry.local_chunk.get(plain_key(half)[0], 0)))
            h = geometry.box_h / len(halves)
            box = _Box(timed.start, y + i * h, length, h, geometry.shade(half))
            boxes.append(box)
            geometry.label(ax, box, str(half.microbatch))
        if len(halves) > 1:
            seen.add("overlap")
            boxes.append(_Box(timed.start, y, length, geometry.box_h, "none", "black", 1.4))
    return boxes, seen


def _legend_handles(result: SimResult, geometry: _Geometry, seen: set) -> list:
    from matplotlib.patches import Patch

    handles = []
    for kind in _COLOURS:
        for chunk in range(geometry.chunks):
            if (kind, chunk) in seen:
                probe = Action(_first_stage(geometry.local_chunk, chunk), kind, 0)
                name = _NAMES[kind] + (f", chunk {chunk}" if geometry.chunks > 1 else "")
                handles.append(Patch(facecolor=geometry.shade(probe), label=name))
    if "overlap" in seen:
        handles.append(
            Patch(fill=False, edgecolor="black", linewidth=1.4, label="OVERLAP (F top, B/I below)")
        )
    if sum(result.comm) - sum(result.exposed_comm) > 1e-9:
        handles.append(Patch(facecolor=_HIDDEN, label="all-to-all hidden"))
    if sum(result.exposed_comm) > 1e-9:
        handles.append(Patch(facecolor=_EXPOSED, label="all-to-all exposed"))
    return handles


def _first_stage(local_chunk: dict[int, int], chunk: int) -> int:
    return min(s for s, c in local_chunk.items() if c == chunk)


def _local_chunks(result: SimResult, stage_to_rank: tuple[int, ...]) -> dict[int, int]:
    """Stage -> its index among the stages of its rank (0 for the first)."""
    stages_by_rank: dict[int, set[int]] = {}
    if stage_to_rank:
        for stage, rank in enumerate(stage_to_rank):
            stages_by_rank.setdefault(rank, set()).add(stage)
    else:
        for timed in result.timeline:
            for comp in timed.action.computations():
                stages_by_rank.setdefault(timed.rank, set()).add(plain_key(comp)[0])
    return {s: i for stages in stages_by_rank.values() for i, s in enumerate(sorted(stages))}


def _comm_boxes(result: SimResult, offset: float, height: float) -> list[_Box]:
    """The all-to-all strip of each rank: grey where hidden, red where the rank waits on it."""
    boxes = []
    for rank in range(result.pp):
        segments = [s for t in result.actions_of(rank) for s in t.segments if s.end > s.start]
        compute = sorted((s.start, s.end) for s in segments if s.stream == COMPUTE)
        for seg in segments:
            if seg.stream != COMM:
                continue
            y = rank + offset
            boxes.append(_Box(seg.start, y, seg.end - seg.start, height, _HIDDEN, "none", 0))
            for x0, x1 in subtract((seg.start, seg.end), compute):
                boxes.append(_Box(x0, y, x1 - x0, height, _EXPOSED, "none", 0))
    return boxes
