"""PipelineExecutor: runs one rank's part of a lowered schedule on its real stages.

The executor walks this rank's action list once per step. Each maximal run of consecutive comm
actions is posted as one batch (``p2p.PipelineP2P``) when reached; a compute action first waits
for the batches that hold the tensors it consumes, then calls the stage's ``StageWorker``.
Tensors between two stages of the same rank are handed over locally. An OVERLAP action runs
its two halves through the co-scheduler (``runtime.combined``). After the last action the
outstanding sends are completed, DualPipe's mirrored gradients summed and data-parallel
gradients averaged (``grad_sync``).

Everything is checked before the first action runs: the schedule is validated (a lowered one
must run to the end under the batched p2p model), the stages must be exactly those the
placement gives this rank, the inputs must cover the schedule's microbatches, and a schedule
that is not lowered is lowered here. Forward-only evaluation runs the schedule's forward steps
(under ``torch.no_grad``) lowered on their own, so it stores no activation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megapipe.parallel.groups import ProcessGroups
from megapipe.overlap.trace import NodeTrace
from megapipe.runtime.checks import check_inputs, check_stages
from megapipe.runtime.combined import CombinedSteps
from megapipe.runtime.grad_sync import all_reduce_grads, sum_mirrored_grads
from megapipe.runtime.p2p import CommOp, PipelineP2P, PostedBatch, SpecFn, TensorSpec
from megapipe.schedule.rank_plan import forward_only_schedule, is_lowered, lower_schedule
from megapipe.runtime.steps import ForwardFn, StageWorker, module_forward
from megapipe.schedule.ir import Action, Kind, Schedule
from megapipe.schedule.lower import check_runs
from megapipe.schedule.validate import validate

LossFn = Callable[[torch.Tensor, Any], torch.Tensor]
"""``loss_fn(last_stage_output, target) -> scalar loss`` (unscaled)."""


@dataclass
class StepResult:
    """What one step produced on this rank.

    - ``losses``: per-microbatch unscaled losses of this rank's last stages (detached);
    - ``outputs``: last-stage outputs when there is no ``loss_fn``;
    - ``peak_live_activations``: the most microbatches whose activations were held at once;
    - with ``record_trace=True`` and a combined schedule (OVERLAP actions): ``trace``, the
      ``NodeTrace`` of every node this rank ran on the streams; ``a2a_time``, the summed
      seconds of its comm nodes (the expert-parallel all-to-alls, including an emulated link's
      wait); ``compute_time``, the summed seconds of its compute nodes; and
      ``exposed_comm_fraction``, the share of ``a2a_time`` during which no compute node ran
      (0: all hidden, 1: none). They are None otherwise (no trace, or nothing ran on streams).
    """

    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)  # what loss_fn returned beyond the loss
    peak_live_activations: int = 0
    trace: NodeTrace | None = None
    a2a_time: float | None = None
    compute_time: float | None = None
    exposed_comm_fraction: float | None = None


@dataclass
class _StepState:
    """One step's inputs and the tensors in transit, keyed by (stage, microbatch)."""

    microbatches: Sequence[Any] | None
    targets: Sequence[Any] | None
    forward_only: bool

    forward_inputs: dict[tuple[int, int], Any] = field(default_factory=dict)
    grad_outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    to_send_forward: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    to_send_backward: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    pending: dict[tuple[Kind, int, int], PostedBatch] = field(default_factory=dict)
    sends: list[PostedBatch] = field(default_factory=list)
    result: StepResult = field(default_factory=StepResult)


class PipelineExecutor:
    """Runs ``schedule`` on this rank's ``stages`` ({stage id: module}).

    ``schedule`` is a compute-only schedule (lowered here) or an already lowered one.
    ``groups`` gives the pipeline rank, the PP group for p2p and the DP/expert-DP groups for the
    gradient all-reduce; without it the pipeline spans the default group (rank = global rank).
    ``spec`` declares what each stage sends forward: one ``TensorSpec`` for every boundary, or a
    function ``spec(stage, microbatch)`` (variable sequence lengths). ``loss_fn(output, target)``
    gives the unscaled loss of a last stage; the executor scales it by 1/num_microbatches.
    ``timeout`` (seconds) bounds every wait for a peer.

    ``use_tape`` chooses how stages with ``layer_plans()`` run: node by node on the tape
    (``megapipe.overlap.tape``) or as one autograd graph. Both perform the same operations, so
    results are bitwise equal either way; the tape costs one autograd call per node. ``None``
    (default) puts on the tape exactly the microbatches an OVERLAP action touches (the
    co-scheduler needs their nodes), ``True`` every microbatch, ``False`` none.

    Combined schedules (any OVERLAP action, ``build_schedule(..., overlap=True)``): every
    training F/B/I of a stage with ``layer_plans()`` runs on the tape through the co-scheduler
    (``runtime.combined``): an OVERLAP action as a real combined step, the others alone, all
    with their comm nodes on one communication stream (made once, closed by ``close()``).
    ``delay_wgrad_compute`` (Megatron's flag; needs a combined schedule) defers the expert
    weight gradients of each backward to run while a backward all-to-all is in flight.
    ``record_trace`` records a ``NodeTrace`` per step and fills the timing fields of
    ``StepResult``. Pipeline p2p stays on the calling thread: a pair's receives are posted in
    the batch before its OVERLAP action and its sends in the batch after it (the lowering's
    batches), so they are in flight while the pair computes.
    """

    def __init__(
        self,
        schedule: Schedule,
        stages: Mapping[int, nn.Module],
        *,
        spec: TensorSpec | SpecFn | None = None,
        loss_fn: LossFn | None = None,
        groups: ProcessGroups | None = None,
        forward_fn: ForwardFn = module_forward,
        timeout: float = 300.0,
        pp_group: dist.ProcessGroup | None = None,
        use_tape: bool | None = None,
        delay_wgrad_compute: bool = False,
        record_trace: bool = False,
    ) -> None:
        self.schedule = schedule
        self.groups = groups
        if groups is not None:
            if groups.config.pp != schedule.pp:
                raise ValueError(
                    f"the schedule has pp={schedule.pp} ranks but the process groups have "
                    f"pp={groups.config.pp}"
                )
            self.pp_rank = groups.pp_rank
            self.pp_ranks = groups.pp_ranks
            self.pp_group = groups.pp
        elif schedule.pp == 1:
            self.pp_rank, self.pp_ranks, self.pp_group = 0, (0,), None
        else:
            if not dist.is_initialized():
                raise RuntimeError(
                    f"a {schedule.pp}-rank pipeline needs torch.distributed initialised "
                    "(or pass groups=create_groups(...))"
                )
            group = pp_group
            self.pp_rank = dist.get_rank(group) if group is not None else dist.get_rank()
            size = dist.get_world_size(group) if group is not None else dist.get_world_size()
            if size != schedule.pp:
                raise ValueError(
                    f"the schedule has pp={schedule.pp} ranks but the pipeline group has {size}"
                )
            self.pp_ranks = tuple(
                dist.get_global_rank(group, r) if group is not None else r for r in range(size)
            )
            self.pp_group = group
        check_stages(schedule, self.pp_rank, stages)
        self.stages = dict(stages)
        self.loss_fn = loss_fn
        if isinstance(spec, TensorSpec):
            fixed = spec
            spec = lambda stage, microbatch: fixed  # noqa: E731
        self.spec = spec
        self.timeout = timeout
        self.workers = {
            s: StageWorker(s, m, forward_fn, use_tape=bool(use_tape)) for s, m in self.stages.items()
        }
        # a broken schedule (hand-written, from a CSV) fails here, naming rank, action and rule
        if is_lowered(schedule):
            check_runs(schedule)
            self.lowered = schedule
        else:
            validate(schedule)
            self.lowered = lower_schedule(schedule)
        forward = forward_only_schedule(self.lowered)
        self.lowered_forward_only = forward
        self.actions = self.lowered.actions[self.pp_rank]
        self.forward_only_actions = forward.actions[self.pp_rank]
        self._needs_comm = any(not a.is_compute for a in self.actions)
        if self._needs_comm and spec is None:
            raise ValueError(
                "spec is required when stages talk across ranks: pass TensorSpec(shape, dtype) "
                "of the activation each stage sends forward, or spec(stage, microbatch)"
            )
        self._p2p: PipelineP2P | None = None
        self.combined_schedule = any(
            a.kind is Kind.OVERLAP for row in self.lowered.actions for a in row
        )
        if delay_wgrad_compute and not self.combined_schedule:
            raise ValueError(
                f"delay_wgrad_compute=True needs a combined schedule (OVERLAP actions; build it "
                f"with overlap=True): {schedule.name!r} has none, so no backward all-to-all "
                "would be in flight to hide the weight gradients behind"
            )
        self.record_trace = record_trace
        self._combined: CombinedSteps | None = None
        if self.combined_schedule:
            self._combined = CombinedSteps(self._device() or "cpu", delay_wgrad_compute)
        # (stage, microbatch) pairs an OVERLAP action touches: recorded on the tape when possible
        self._tape_keys = {
            (comp.stage, comp.microbatch)
            for action in self.actions
            if action.kind is Kind.OVERLAP
            for comp in action.computations()
        } if use_tape is None else set()

    def _device(self) -> torch.device | None:
        first = next((p for m in self.stages.values() for p in m.parameters()), None)
        return first.device if first is not None else None

    def close(self) -> None:
        """Stop the communication stream's worker (combined schedules); idempotent."""
        if self._combined is not None:
            self._combined.close()

    def __enter__(self) -> "PipelineExecutor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ step
    def step(
        self,
        microbatches: Sequence[Any] | None = None,
        targets: Sequence[Any] | None = None,
        forward_only: bool = False,
    ) -> StepResult:
        """Run one step over all microbatches: forward and backward, or forward only.

        ``microbatches[i]`` is the first stage's input of microbatch i and ``targets[i]`` the
        last stage's (needed only on ranks holding those stages). Gradients accumulate into
        ``.grad`` (zero them between steps); after a training step they are synchronised.
        """
        check_inputs(
            self.schedule, self.pp_rank, self.stages, self.loss_fn is not None,
            microbatches, targets, forward_only,
        )
        self._set_aux_loss_scale(1.0 / self.schedule.num_microbatches)
        actions = self.forward_only_actions if forward_only else self.actions
        state = _StepState(microbatches, targets, forward_only)
        trace = None
        if self._combined is not None:
            trace = NodeTrace() if self.record_trace and not forward_only else None
            self._combined.trace = trace
        try:
            index = 0
            while index < len(actions):
                action = actions[index]
                if action.is_compute:
                    self._run_compute(action, state)
                    index += 1
                    continue
                end = index
                while end < len(actions) and not actions[end].is_compute:
                    end += 1
                self._post(actions[index:end], state)
                index = end
            for batch in state.sends:
                batch.wait()
        finally:
            for worker in self.workers.values():
                worker.clear()
            if self._combined is not None:
                self._combined.trace = None
        if trace is not None and trace.spans:
            result = state.result
            result.trace = trace
            result.a2a_time = trace.total("comm")
            result.compute_time = trace.total("compute")
            result.exposed_comm_fraction = trace.exposed_comm_fraction()
        if not forward_only:
            if self.schedule.bidirectional:
                sum_mirrored_grads(
                    self.schedule, self.pp_rank, self.stages, self.pp_group, self.pp_ranks
                )
            if self.groups is not None:
                all_reduce_grads(self.stages, self.groups)
        return state.result

    def _set_aux_loss_scale(self, scale: float) -> None:
        for module in self.stages.values():
            for sub in module.modules():
                if hasattr(sub, "aux_loss_scale"):
                    sub.aux_loss_scale = scale

    # ------------------------------------------------------------------ comm
    def _channel(self) -> PipelineP2P:
        if self._p2p is None:
            assert self.spec is not None
            self._p2p = PipelineP2P(
                self.pp_group, self.pp_ranks, self.schedule.stage_to_rank, self.spec,
                self.timeout, self._device(),
            )
        return self._p2p

    def _post(self, actions: Sequence[Action], state: _StepState) -> None:
        p2p = self._channel()
        sched = self.schedule
        ops: list[CommOp] = []
        receives: list[tuple[Kind, int, int, torch.Tensor]] = []
        for action in actions:
            s, i, kind = action.stage, action.microbatch, action.kind
            if kind is Kind.SEND_F:
                tensor = state.to_send_forward.pop((s, i), None)
                if tensor is None:
                    raise RuntimeError(f"rank {self.pp_rank}: {action} before F({s},{i}) produced it")
                self.spec(s, i).check(tensor, f"rank {self.pp_rank}, {action}")
                ops.append(CommOp(action, p2p.peer_of(action, sched.next_stage(s)), tensor))
            elif kind is Kind.SEND_B:
                tensor = state.to_send_backward.pop((s, i), None)
                if tensor is None:
                    raise RuntimeError(f"rank {self.pp_rank}: {action} before the backward of ({s},{i})")
                prev = sched.prev_stage(s)
                self.spec(prev, i).check(tensor, f"rank {self.pp_rank}, {action}")
                ops.append(CommOp(action, p2p.peer_of(action, prev), tensor))
            elif kind is Kind.RECV_F:
                prev = sched.prev_stage(s)
                buffer = p2p.receive_buffer(action, prev)
                ops.append(CommOp(action, p2p.peer_of(action, prev), buffer))
                receives.append((Kind.RECV_F, s, i, buffer))
            elif kind is Kind.RECV_B:
                buffer = p2p.receive_buffer(action, s)
                ops.append(CommOp(action, p2p.peer_of(action, sched.next_stage(s)), buffer))
                receives.append((Kind.RECV_B, s, i, buffer))
            else:
                raise ValueError(f"rank {self.pp_rank}: {action} is not a comm action")
        batch = p2p.post(ops)
        for kind, s, i, buffer in receives:
            state.pending[(kind, s, i)] = batch
            target = state.forward_inputs if kind is Kind.RECV_F else state.grad_outputs
            target[(s, i)] = buffer
        if any(op.is_send for op in ops):
            state.sends.append(batch)
            # drop completed sends so their tensors can be freed early
            state.sends = [b for b in state.sends if not b.is_completed()]

    def _wait_for(self, kind: Kind, stage: int, microbatch: int, state: _StepState) -> None:
        batch = state.pending.pop((kind, stage, microbatch), None)
        if batch is not None:
            batch.wait()

    # ------------------------------------------------------------------ compute
    def _run_compute(self, action: Action, state: _StepState) -> None:
        if action.kind is Kind.OVERLAP:
            self._run_overlap(action, state)
        elif action.kind is Kind.F:
            self._forward(action, state)
        elif action.kind in (Kind.B, Kind.I):
            self._backward(action, state)
        elif action.kind is Kind.W:
            self.workers[action.stage].backward_weight(action.microbatch)
        else:
            raise ValueError(f"rank {self.pp_rank}: cannot run {action}")

    def _run_overlap(self, action: Action, state: _StepState) -> None:
        """An OVERLAP action: its two halves co-scheduled (``CombinedSteps.combined``).

        Stages that do not follow the node protocol run F then B (warned once per type)."""
        f, b = action.forward, action.backward
        combined = self._combined
        assert combined is not None  # an OVERLAP action makes the schedule a combined one
        f_worker, b_worker = self.workers[f.stage], self.workers[b.stage]
        if state.forward_only or not combined.can_combine(f_worker, b_worker):
            self._forward(f, state)
            self._backward(b, state)
            return
        stage_input = self._forward_input(f, state)
        grad_output = self._grad_output(b, state)
        output, grad_input = combined.combined(
            (f_worker, f, stage_input), (b_worker, b, grad_output)
        )
        self._forward_done(f, output, state)
        self._backward_done(b, grad_input, state)

    def _on_streams(self, worker: StageWorker, state: _StepState) -> bool:
        """Whether a lone step runs on the streams: training steps of node-protocol stages
        in a combined schedule (so every EP collective is issued from the comm stream)."""
        return self._combined is not None and not state.forward_only and worker.can_tape

    def _forward_input(self, action: Action, state: _StepState) -> Any:
        s, i = action.stage, action.microbatch
        sched = self.schedule
        if sched.is_first_stage(s):
            assert state.microbatches is not None
            return state.microbatches[i]
        self._wait_for(Kind.RECV_F, s, i, state)
        stage_input = state.forward_inputs.pop((s, i), None)
        if stage_input is None:
            raise RuntimeError(
                f"rank {self.pp_rank}: {action} has no input (no RECV_F and no local stage "
                f"{sched.prev_stage(s)} forward before it)"
            )
        return stage_input

    def _forward(self, action: Action, state: _StepState) -> None:
        s, i = action.stage, action.microbatch
        stage_input = self._forward_input(action, state)
        worker = self.workers[s]
        if self._on_streams(worker, state):
            assert self._combined is not None
            output = self._combined.forward(worker, action, stage_input)
        else:
            tape = worker.use_tape or (worker.can_tape and (s, i) in self._tape_keys)
            output = worker.forward(i, stage_input, keep_graph=not state.forward_only, tape=tape)
        self._forward_done(action, output, state)

    def _forward_done(self, action: Action, output: torch.Tensor, state: _StepState) -> None:
        s, i = action.stage, action.microbatch
        sched = self.schedule
        worker = self.workers[s]
        nxt = sched.next_stage(s)
        if nxt is None:
            self._finish_last_stage(worker, i, output, state)
        elif sched.stage_to_rank[nxt] == self.pp_rank:
            state.forward_inputs[(nxt, i)] = output.detach()
        else:
            state.to_send_forward[(s, i)] = output.detach()
        live = sum(w.live_activations for w in self.workers.values())
        state.result.peak_live_activations = max(state.result.peak_live_activations, live)

    def _finish_last_stage(
        self,
        worker: StageWorker,
        microbatch: int,
        output: torch.Tensor,
        state: _StepState,
    ) -> None:
        forward_only, targets = state.forward_only, state.targets
        if self.loss_fn is None:
            state.result.outputs[microbatch] = output.detach()
            if not forward_only:
                raise ValueError("training needs loss_fn on the last stage")
            return
        assert targets is not None
        if forward_only:
            with torch.no_grad():
                loss = self.loss_fn(output, targets[microbatch])
        else:
            loss = self.loss_fn(output, targets[microbatch])
            worker.attach_loss(microbatch, loss / self.schedule.num_microbatches)
        state.result.losses[microbatch] = loss.detach()

    def _grad_output(self, action: Action, state: _StepState) -> torch.Tensor | None:
        s, i = action.stage, action.microbatch
        sched = self.schedule
        if sched.is_last_stage(s):
            return None
        self._wait_for(Kind.RECV_B, s, i, state)
        grad_output = state.grad_outputs.pop((s, i), None)
        if grad_output is None:
            raise RuntimeError(
                f"rank {self.pp_rank}: {action} has no output gradient (no RECV_B and no "
                f"local stage {sched.next_stage(s)} backward before it)"
            )
        return grad_output

    def _backward(self, action: Action, state: _StepState) -> None:
        i = action.microbatch
        grad_output = self._grad_output(action, state)
        worker = self.workers[action.stage]
        if self._on_streams(worker, state) and worker.has_tape(i):
            assert self._combined is not None
            grad_input = self._combined.backward(worker, action, grad_output)
        elif action.kind is Kind.B:
            grad_input = worker.backward(i, grad_output)
        else:
            grad_input = worker.backward_input(i, grad_output)
        self._backward_done(action, grad_input, state)

    def _backward_done(
        self, action: Action, grad_input: torch.Tensor | None, state: _StepState
    ) -> None:
        s, i = action.stage, action.microbatch
        sched = self.schedule
        prev = sched.prev_stage(s)
        if prev is None:
            return
        if grad_input is None:
            raise RuntimeError(
                f"rank {self.pp_rank}: stage {s} produced no input gradient for {action}; its "
                "input must be a floating-point tensor that the output depends on"
            )
        if sched.stage_to_rank[prev] == self.pp_rank:
            state.grad_outputs[(prev, i)] = grad_input
        else:
            state.to_send_backward[(s, i)] = grad_input
