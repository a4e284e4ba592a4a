"""megapipe.sim: cost model and event simulation of a Schedule; PNG timelines and Chrome traces."""

from .costs import Costs
from .draw import draw_timeline
from .programs import Segment
from .simulate import SimResult, TimedAction, simulate
from .trace import write_trace

__all__ = [
    "Costs",
    "Segment",
    "SimResult",
    "TimedAction",
    "draw_timeline",
    "simulate",
    "write_trace",
]
