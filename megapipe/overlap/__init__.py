"""megapipe.overlap: node plans, the tape, streams and the co-scheduler (the combined step)."""

from megapipe.overlap.coscheduler import CoScheduler, TapeBackward, combined_step
from megapipe.overlap.node_trace import NodeSpan, NodeTrace
from megapipe.overlap.plan import (
    ChunkedPlan, Fork, LayerState, Node, NodeKind, NodeRunner, layer_graph, run_nodes,
)
from megapipe.overlap.streams import (
    CudaStream, Event, InlineStream, Stream, Streams, WorkerStream, make_streams,
)
from megapipe.overlap.tape import Tape, TapeRunner, record_forward, run_backward
from megapipe.overlap.wgrad import WeightGradQueue, grouped_matmul

__all__ = [
    "ChunkedPlan", "CoScheduler", "Fork", "layer_graph", "CudaStream", "Event", "InlineStream", "LayerState", "Node", "NodeKind",
    "NodeRunner", "NodeSpan", "NodeTrace", "Stream", "Streams", "Tape", "TapeBackward",
    "TapeRunner", "WeightGradQueue", "WorkerStream", "combined_step", "grouped_matmul",
    "make_streams", "record_forward", "run_backward", "run_nodes",
]
