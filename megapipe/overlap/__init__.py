"""megapipe.overlap: node plans, streams, the combined step and its tape."""

from megapipe.overlap.combined import BackwardHalf, CombinedStep, combined_step
from megapipe.overlap.cuda_streams import CudaStream
from megapipe.overlap.device_streams import make_streams
from megapipe.overlap.node_trace import NodeSpan, NodeTrace
from megapipe.overlap.plan import (
    Fork,
    LayerState,
    Node,
    NodeKind,
    NodeRunner,
    WavePlan,
    layer_graph,
    run_nodes,
)
from megapipe.overlap.sequential import TapeRunner, record_forward, run_backward
from megapipe.overlap.streams import Event, InlineStream, Stream, Streams, WorkerStream
from megapipe.overlap.tape import Tape
from megapipe.overlap.wgrad import WeightGradQueue

__all__ = [
    "BackwardHalf",
    "WavePlan",
    "CombinedStep",
    "CudaStream",
    "Event",
    "Fork",
    "InlineStream",
    "LayerState",
    "Node",
    "NodeKind",
    "NodeRunner",
    "NodeSpan",
    "NodeTrace",
    "Stream",
    "Streams",
    "Tape",
    "TapeRunner",
    "WeightGradQueue",
    "WorkerStream",
    "combined_step",
    "layer_graph",
    "make_streams",
    "record_forward",
    "run_backward",
    "run_nodes",
]
