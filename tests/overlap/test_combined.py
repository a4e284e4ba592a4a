"""The combined step: bitwise equal to the sequential path, the four pairs, real concurrency."""

import contextlib
import copy
import time
import warnings
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megapipe.overlap.combined import BackwardHalf, CombinedStep, combined_step
from megapipe.overlap.cuda_api import CudaApi
from megapipe.overlap.cuda_streams import CudaStream
from megapipe.overlap.device_streams import make_streams
from megapipe.overlap.node_trace import NodeTrace
from megapipe.overlap.plan import Node, NodeKind
from megapipe.overlap.sequential import record_forward, run_backward
from megapipe.overlap.streams import InlineStream, Streams, WorkerStream
from megapipe.overlap.wgrad import WeightGradQueue
from megapipe.pairing.order import FILL, HEAD
from megapipe.pairing.timing import NodeTimes
from support.overlap_asserts import assert_same_tensors
from support.overlap_toys import ToyOpaque, toy_stack


def _grads(*modules):
    return [p.grad for m in modules for p in m.parameters()]


def _plans(stack):
    return [layer.node_plan() for layer in stack]


def combined_matches_sequential(
    fwd_kinds: str, bwd_kinds: str, defer: bool, use_group: bool
) -> int:
    """F(i) on stack A beside B(j) on stack B, against F(i) then B(j); returns #checks."""
    group = dist.group.WORLD if use_group else None
    rank = dist.get_rank() if use_group else 0
    gen = torch.Generator().manual_seed(rank)
    x_i = torch.randn(6, 8, generator=gen, requires_grad=True)
    x_j = torch.randn(6, 8, generator=gen, requires_grad=True)
    g_j = torch.randn(6, 8, generator=gen)
    g_i = torch.randn(6, 8, generator=gen)

    results = []
    for combined in (False, True):
        stack_f = toy_stack(fwd_kinds, group=group, seed=10 + rank)
        stack_b = toy_stack(bwd_kinds, group=group, seed=20 + rank)
        _, tape_j = record_forward(_plans(stack_b), (x_j,))
        if combined:
            with make_streams("cpu") as streams:
                out_i, tape_i, gx_j = combined_step(
                    _plans(stack_f), (x_i,), tape_j, (g_j,), streams, delay_wgrad_compute=defer
                )
        else:
            out_i, tape_i = record_forward(_plans(stack_f), (x_i,))
            queue = WeightGradQueue() if defer else None
            gx_j = run_backward(tape_j, (g_j,), wgrad=queue)
            if queue is not None:
                queue.run()
        assert tape_j.live_tensors() == 0
        mid = _grads(stack_f, stack_b)
        mid = [None if g is None else g.clone() for g in mid]
        gx_i = run_backward(tape_i, (g_i,))  # the forward tape of the pair is a working tape
        results.append((out_i, gx_j, mid, gx_i, _grads(stack_f, stack_b)))
    seq, comb = results
    assert_same_tensors(list(seq[0]), list(comb[0]))
    assert_same_tensors(list(seq[1]), list(comb[1]))
    assert_same_tensors(seq[2], comb[2])
    assert_same_tensors(list(seq[3]), list(comb[3]))
    assert_same_tensors(seq[4], comb[4])
    return len(seq[4])


@pytest.mark.parametrize(
    "fwd_kinds,bwd_kinds,defer",
    [
        ("mm", "mm", False),
        ("mm", "mm", True),
        ("dmm", "mdm", True),
        ("dm", "mmdm", False),
        ("mmm", "m", True),
    ],
)
def test_combined_step_is_bitwise_sequential_single_process(fwd_kinds, bwd_kinds, defer):
    assert combined_matches_sequential(fwd_kinds, bwd_kinds, defer, use_group=False) > 0


def _combined_on_ranks(cases):
    return [combined_matches_sequential(*case, use_group=True) for case in cases]


def test_combined_step_is_bitwise_sequential_with_all_to_all_on_two_ranks(rank_pools):
    cases = [("mm", "mm", False), ("mm", "mm", True), ("dmm", "mdmm", True), ("mdm", "dm", False)]
    assert all(n > 0 for r in rank_pools(2).run(_combined_on_ranks, cases) for n in r)


def _pairs_in_trace(trace):
    """For each comm node: the compute nodes of the other microbatch issued beside it."""
    found = []
    for slot in trace.slots():
        for comm in (s for s in slot if s.kind == "comm"):
            partners = [s for s in slot if s.kind == "compute" and s.direction != comm.direction]
            found.append(
                (
                    comm.direction,
                    comm.layer,
                    comm.node,
                    sorted((p.direction, p.layer, p.node) for p in partners),
                )
            )
    return found


def test_trace_shows_the_four_pairs_in_every_moe_layer():
    stack = toy_stack("mmm")
    _, tape_j = record_forward(_plans(stack), (torch.randn(4, 8, requires_grad=True),))
    trace = NodeTrace()
    with make_streams("cpu") as streams:
        combined_step(
            _plans(stack),
            (torch.randn(4, 8, requires_grad=True),),
            tape_j,
            (torch.ones(4, 8),),
            streams,
            delay_wgrad_compute=True,
            trace=trace,
            fwd_microbatch=1,
            bwd_microbatch=0,
        )
    found = _pairs_in_trace(trace)
    expected = []
    for k in range(3):
        b = 2 - k
        # deferred weight gradients: the first half of layer b's beside its B dispatch, the
        # rest held for the next layer's B combine (after the short forward attention)
        held = [("W", b + 1, "wgrad")] if k > 0 else []
        expected += [
            ("B", b, "combine", sorted([("F", k, "attention")] + held)),
            ("F", k, "dispatch", [("B", b, "experts")]),
            ("B", b, "dispatch", [("F", k, "experts"), ("W", b, "wgrad")]),
            ("F", k, "combine", [("B", b, "attention")]),
        ]
    assert found == expected
    # issue order of the compute stream within one pair of layers, and into the next
    compute = [s.label() for s in trace.by_start() if s.stream == "compute"][:10]
    assert compute == [
        "B0.2.finish",
        "F1.0.attention",
        "B0.2.experts",
        "F1.0.experts",
        "W0.2.wgrad",
        "B0.2.attention",
        "F1.0.finish",
        "B0.1.finish",
        "F1.1.attention",
        "W0.2.wgrad",
    ]
    # the last layer's held half runs at the end of the step
    assert [s.label() for s in trace.by_start()][-1] == "W0.0.wgrad"


def test_dense_and_leftover_layers_run_alone():
    f_stack, b_stack = toy_stack("dm"), toy_stack("mmd")
    _, tape_j = record_forward(_plans(b_stack), (torch.randn(4, 8, requires_grad=True),))
    trace = NodeTrace()
    with make_streams("cpu") as streams:
        combined_step(
            _plans(f_stack), (torch.randn(4, 8),), tape_j, (torch.ones(4, 8),), streams, trace=trace
        )
    order = [s.label() for s in trace.by_start()]
    # F layer 0 (dense) beside B layer 2 (dense): B alone, then F alone
    assert order[:2] == ["B.2.dense", "F.0.dense"]
    # B layer 0 is a leftover: its five nodes run alone, last, in backward order
    assert order[-5:] == [
        "B.0.finish",
        "B.0.combine",
        "B.0.experts",
        "B.0.dispatch",
        "B.0.attention",
    ]


def overlapped_step_times(use_group: bool) -> tuple[float, float, float]:
    """(wall time, summed comm + compute time, exposed comm fraction) of one combined step."""
    # every comm node sleeps 60 ms after its exchange (emulated link); attention and experts
    # take 60 ms (forward and backward): 2 x 4 slots of 60 ms against 16 parts of 60 ms
    group = dist.group.WORLD if use_group else None
    stack = toy_stack("mm", group=group, sleep_s=0.06, compute_sleep_s=0.06)
    with make_streams("cpu") as streams:
        for _ in range(2):  # the first step warms up (gloo's first exchange from a thread is slow)
            _, tape_j = record_forward(_plans(stack), (torch.randn(4, 8, requires_grad=True),))
            trace = NodeTrace()
            start = time.perf_counter()
            combined_step(
                _plans(stack),
                (torch.randn(4, 8),),
                tape_j,
                (torch.ones(4, 8),),
                streams,
                trace=trace,
            )
            wall = time.perf_counter() - start
    return wall, trace.total("comm") + trace.total("compute"), trace.exposed_comm_fraction()


def _check_overlap(wall, parts, exposed):
    assert parts > 0.9  # 2 layers x 2 microbatches x (2 comm + 2 compute) x 60 ms
    # the trace's spans: most of the comm time ran while a compute node ran (a measure of
    # concurrency from the nodes' own spans, not a wall-clock bound)
    assert exposed < 0.5, (wall, parts, exposed)


def test_combined_step_overlaps_comm_with_compute():
    _check_overlap(*overlapped_step_times(use_group=False))


def test_combined_step_overlaps_a_real_all_to_all_with_compute_on_two_ranks(rank_pools):
    for times in rank_pools(2).run(overlapped_step_times, True):
        _check_overlap(*times)


def test_memory_of_combined_step_is_at_most_sequential():
    stack = toy_stack("mmm")
    peaks = []
    for combined in (False, True):
        _, tape_j = record_forward(_plans(stack), (torch.randn(4, 8, requires_grad=True),))
        full = tape_j.live_tensors()
        if combined:
            live = []
            with make_streams("cpu") as streams:
                runner = CombinedStep(streams, BackwardHalf(tape_j, (torch.ones(4, 8),)))
                x = (torch.randn(4, 8),)
                for layer in stack:
                    x = runner.run_layer(layer, x)
                    live.append(tape_j.live_tensors() + runner.tape.live_tensors())
                runner.finish()
            peaks.append(max(live))
            # the backward tape shrinks layer by layer as the forward tape grows: one microbatch
            # in flight, not two
            assert max(live) <= full, (live, full)
        else:
            out, tape_i = record_forward(_plans(stack), (torch.randn(4, 8),))
            peaks.append(tape_j.live_tensors() + tape_i.live_tensors())
            run_backward(tape_j, (torch.ones(4, 8),))
        assert tape_j.live_tensors() == 0
    assert peaks[1] < peaks[0]


class _HostCudaApi(CudaApi):
    """The CUDA path's calls, done on the host: events and streams are plain objects."""

    def new_event(self):
        return SimpleNamespace(synchronize=lambda: None, query=lambda: True)

    def record(self, event, stream):
        pass

    def wait(self, stream, event):
        pass

    def switch(self, stream):
        return contextlib.nullcontext()

    def current_stream(self, device):
        return "compute"


def _streams(kind):
    if kind == "cpu":
        return make_streams("cpu")
    if kind == "inline":
        return Streams(InlineStream("compute"), InlineStream("comm"))
    api, cpu = _HostCudaApi(), torch.device("cpu")  # the CUDA path's events, on CPU
    return Streams(CudaStream("compute", cpu, stream="compute", current=True, api=api),
                   CudaStream("comm", cpu, stream="comm", api=api))


@pytest.mark.parametrize("kind", ["cpu", "inline", "cuda path"])
def test_a_gradient_handed_between_nodes_dies_once_read_not_at_the_steps_end(kind, monkeypatch):
    """The step's events carry no node's values: the gradients a backward node hands to the
    node before it are freed once that node ran, while the step still runs (its events live
    until its end); only the backward tape's input gradients, returned, stay. On the CUDA path
    (its events on the host here) every comm issue records an event."""
    import gc
    import weakref

    from megapipe.overlap.tape import Tape

    handed = []
    real = Tape.backward_node

    def backward_node(tape, layer, index):
        grads = real(tape, layer, index)
        handed.extend(weakref.ref(g) for g in grads if isinstance(g, torch.Tensor))
        return grads

    monkeypatch.setattr(Tape, "backward_node", backward_node)
    stack_b, stack_f = toy_stack("mdm", seed=1), toy_stack("mdm", seed=2)
    _, tape = record_forward(_plans(stack_b), (torch.randn(4, 8, requires_grad=True),))
    with _streams(kind) as streams:
        step = CombinedStep(streams, BackwardHalf(tape, (torch.ones(4, 8),)))
        x = (torch.randn(4, 8),)
        for layer in stack_f:
            x = step.run_layer(layer, x)
        (grad_in,) = step.finish()
        gc.collect()
        alive = [ref() for ref in handed if ref() is not None]
        assert len(handed) > 10
        assert len(alive) == 1 and alive[0] is grad_in, len(alive)  # the step is still alive


def test_layer_without_node_protocol_runs_whole_and_warns_once():
    stack = toy_stack("mo")
    ref = copy.deepcopy(stack)
    x = torch.randn(4, 8)
    with make_streams("cpu") as streams:
        runner = CombinedStep(streams)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                out = x
                for layer in stack:
                    out = runner.run_layer(layer, (out,))[0]
        runner.finish()
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "ToyOpaque does not follow the node protocol" in messages[0]
    assert runner.warn_once.types == {ToyOpaque}
    expected = ref[1](ref[0](x))
    assert torch.equal(out, expected)


def test_comm_node_failure_is_raised_and_named():
    def boom(state, t):
        raise ValueError("link down")

    plan = [
        Node("attention", NodeKind.COMPUTE, lambda s, t: (t[0] * 2,)),
        Node("dispatch", NodeKind.COMM, boom),
    ]
    with make_streams("cpu") as streams:
        with pytest.raises(ValueError, match="link down"):
            combined_step([plan], (torch.ones(2),), None, None, streams)


def test_a_group_is_driven_from_one_stream_only():
    with make_streams("cpu") as streams:
        group = object()
        streams.claim(group, streams.comm)
        streams.claim(group, streams.comm)
        with pytest.raises(RuntimeError, match="driven from stream 'comm'"):
            streams.claim(group, streams.compute)


def test_runner_driven_forward_with_glue_and_loss_is_bitwise_sequential():
    """The Megatron front-end pattern: a model forward calls run_layer on a node runner."""
    from megapipe.overlap.sequential import TapeRunner

    def model_forward(stack, runner, x):
        out = x
        for i, layer in enumerate(stack):
            out = runner.run_layer(layer.node_plan(), (out * 0.5 if i == 1 else out,))[0]
        return out.square().mean()

    gen = torch.Generator().manual_seed(5)
    x_i, x_j = torch.randn(6, 8, generator=gen), torch.randn(6, 8, generator=gen)
    results = []
    for combined in (False, True):
        stack = toy_stack("dmm", seed=3)
        xj = x_j.clone().requires_grad_(True)
        recorder = TapeRunner()
        model_forward(stack, recorder, xj).backward()  # loss -> .grad of the tape's outputs
        xi = x_i.clone().requires_grad_(True)
        if combined:
            with make_streams("cpu") as streams:
                runner = CombinedStep(
                    streams, BackwardHalf(recorder.tape, None, wgrad=WeightGradQueue())
                )
                loss_i = model_forward(stack, runner, xi)
                (gx_j,) = runner.finish()
            tape_i = runner.tape
        else:
            runner = TapeRunner()
            loss_i = model_forward(stack, runner, xi)
            (gx_j,) = run_backward(recorder.tape)
            tape_i = runner.tape
        mid = [p.grad.clone() for p in stack.parameters()]
        loss_i.backward()
        (gx_i,) = run_backward(tape_i)
        results.append(
            [loss_i.detach(), gx_j, xj.grad, gx_i, xi.grad]
            + mid
            + [p.grad for p in stack.parameters()]
        )
    assert_same_tensors(results[0], results[1])


class _QueuingCompute(InlineStream):
    """Runs work inline but says it only queues it, as a CUDA stream's host side does; logs
    what the host issues."""

    runs_on_host = False

    def __init__(self, name, log):
        super().__init__(name)
        self.log = log

    def run(self, fn, args=(), record=True):
        self.log.append(_issued(args))
        return super().run(fn, args, record)


class _LoggedComm(WorkerStream):
    def __init__(self, name, log):
        super().__init__(name)
        self.log = log

    def run(self, fn, args=(), record=True):
        self.log.append(_issued(args))
        return super().run(fn, args, record)


def _issued(args):
    if len(args) < 2:
        return "W or event"
    layer, index = args
    return f"{layer.nodes[index].node.name} L{layer.index}"


def test_a_queuing_host_issues_comm_first_except_a_comm_node_that_reads_the_host():
    """A host that only queues work (CUDA) issues a slot's ready all-to-all before the compute
    beside it, except a dispatch that reads its split sizes back to the host: that goes after
    the compute, so the host queued the compute before it blocks. Same bits as a CPU host."""
    stack_f, stack_b = toy_stack("mm", seed=1), toy_stack("mm", seed=2)

    def plans(stack):  # the forward's dispatch reads the host, as a dropless one does
        return [[replace(n, reads_host=n.name == "dispatch") for n in layer.node_plan()]
                for layer in stack]

    x_i = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    outputs, log = [], []
    for queuing in (False, True):
        _, tape_j = record_forward(plans(stack_b), (torch.ones(4, 8, requires_grad=True),))
        compute = _QueuingCompute("compute", log) if queuing else InlineStream("compute")
        with Streams(compute, _LoggedComm("comm", log if queuing else [])) as streams:
            out, _, grads = combined_step(plans(stack_f), (x_i,), tape_j, (torch.ones(4, 8),),
                                          streams)
        outputs.append((out, grads, _grads(stack_b)))
        for p in stack_b.parameters():
            p.grad = None
    issued = [entry for entry in log if entry != "W or event"]
    # F layer 0 beside B layer 1: B combine before F attention, F dispatch after B experts
    assert issued.index("combine L1") < issued.index("attention L0")
    assert issued.index("experts L1") < issued.index("dispatch L0")
    assert issued.index("dispatch L1") < issued.index("experts L0")
    assert issued.index("combine L0") < issued.index("attention L1")
    (out_a, grads_a, params_a), (out_b, grads_b, params_b) = outputs
    assert_same_tensors(list(out_a), list(out_b))
    assert_same_tensors(list(grads_a), list(grads_b))
    assert_same_tensors(params_a, params_b)


def test_a_lone_step_with_chunked_all_to_alls_pipelines_them_and_keeps_the_bits():
    from megapipe.moe import EmulatedLink, MoEConfig, MoELayer

    # ep = 1 with an emulated link, so the comm nodes take time on the comm thread
    config = MoEConfig(hidden_size=16, num_experts=4, top_k=2, ffn_hidden_size=32, init_std=0.5,
                       aux_loss_coeff=0.01, link=EmulatedLink(1e12, 0.01))
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(4))
    g = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(5))
    results, traces = [], []
    for waves in (1, 2):
        layers = [MoELayer(config, layer_index=i, seed=3) for i in range(2)]
        trace = NodeTrace()
        with make_streams("cpu") as streams:
            forward = CombinedStep(streams, trace=trace, fwd_microbatch=0, a2a_waves=waves)
            out = (x,)
            for layer in layers:
                out = forward.run_layer(layer, out)
            forward.finish()
            backward = CombinedStep(streams, BackwardHalf(forward.tape, (g,), 0, WeightGradQueue()),
                                   trace=trace, a2a_waves=waves)
            (gx,) = backward.finish()
        results.append([out[0], gx] + [p.grad for layer in layers for p in layer.parameters()])
        traces.append(trace)
    assert_same_tensors(results[0], results[1])
    def side_by_side(trace):
        slots = [sorted((s.direction, s.node) for s in slot if s.direction != "W")
                 for slot in trace.slots()]
        return [nodes for nodes in slots if len(nodes) > 1]

    waved = side_by_side(traces[1])
    for direction in ("F", "B"):
        # one wave's all-to-all beside the other wave's experts, twice per layer
        for pair in ({"dispatch1", "experts0"}, {"combine0", "experts1"}):
            if direction == "B":
                pair = (
                    {"combine1", "experts0"} if "dispatch1" in pair else {"dispatch0", "experts1"}
                )
            found = [n for n in waved if n[0][0] == direction and {x for _, x in n} == pair]
            assert len(found) == 2, (direction, pair, waved)
    assert side_by_side(traces[0]) == []  # one-wave, a lone action runs its nodes one by one


# expected times (ms) the combined step may plan with: comm nodes three times the compute ones,
# the toy experts' two deferred GEMMs 1 ms each
TOY_TIMES = {"attention": NodeTimes(1.0, 1.0), "dispatch": NodeTimes(3.0, 3.0),
             "experts": NodeTimes(1.0, 1.0, (1.0, 1.0)), "combine": NodeTimes(3.0, 3.0),
             "finish": NodeTimes(0.0, 0.0), "dense": NodeTimes(1.0, 1.0)}


def _timed_plans(stack, timed):
    plans = _plans(stack)
    return [[replace(n, times=TOY_TIMES[n.name]) for n in p] for p in plans] if timed else plans


@pytest.mark.parametrize("kinds", ["mmm", "dmdm"])
def test_weight_gradients_placed_by_time_keep_the_bits(kinds):
    """Nodes with times: the plan runs the deferred GEMMs where the compute stream would wait
    (FILL issues), not by count; only their order changes, and each adds into its own weight,
    so the gradients stay bitwise those of F then B."""
    gen = torch.Generator().manual_seed(7)
    x_i, x_j, g_j = (torch.randn(6, 8, generator=gen) for _ in range(3))
    results, parts = [], []
    for combined, timed in ((False, False), (True, True), (True, False)):
        stack_f, stack_b = toy_stack(kinds, seed=10), toy_stack(kinds, seed=20)
        _, tape_j = record_forward(_timed_plans(stack_b, timed), (x_j.requires_grad_(),))
        queue = WeightGradQueue()
        if combined:
            with make_streams("cpu") as streams:
                runner = CombinedStep(streams, BackwardHalf(tape_j, (g_j,), wgrad=queue))
                values = (x_i.requires_grad_(),)
                for plan in _timed_plans(stack_f, timed):
                    values = runner.run_layer(plan, values)
                (gx_j,) = runner.finish()
            parts.append({i.share for i in runner.order.issues if i.side == "W"})
        else:
            values, _ = record_forward(_timed_plans(stack_f, timed), (x_i.requires_grad_(),))
            (gx_j,) = run_backward(tape_j, (g_j,), wgrad=queue)
            queue.run()
        results.append([*values, gx_j] + _grads(stack_f, stack_b))
    assert_same_tensors(results[0], results[1])
    assert_same_tensors(results[0], results[2])
    assert FILL in parts[0] and HEAD not in parts[0]  # by time
    assert FILL not in parts[1] and HEAD in parts[1]  # by count: nodes without times
