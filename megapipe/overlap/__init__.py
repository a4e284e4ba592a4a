"""megapipe.overlap: node plans, the tape, streams and the co-scheduler (the combined step)."""

from megapipe.overlap.coscheduler import CombinedRunner, combined_step
from megapipe.overlap.plan import (
    LayerState, Node, NodeKind, NodeLayer, NodeRunner, PlainRunner, run_nodes,
)
from megapipe.overlap.streams import (
    CudaStream, Event, InlineStream, Stream, Streams, WorkerStream, make_streams,
)
from megapipe.overlap.tape import Tape, TapeRunner, record_forward, run_backward
from megapipe.overlap.trace import NodeSpan, NodeTrace
from megapipe.overlap.wgrad import WeightGradQueue, grouped_matmul

__all__ = [
    "CombinedRunner", "CudaStream", "Event", "InlineStream", "LayerState", "Node", "NodeKind",
    "NodeLayer", "NodeRunner", "NodeSpan", "NodeTrace", "PlainRunner", "Stream", "Streams", "Tape",
    "TapeRunner", "WeightGradQueue", "WorkerStream", "combined_step", "grouped_matmul",
    "make_streams", "record_forward", "run_backward", "run_nodes",
]
