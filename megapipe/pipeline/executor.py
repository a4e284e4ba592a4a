"""PipelineExecutor: runs one rank's part of a lowered schedule on its real stages.

The executor walks this rank's action list once per step (``_run_actions``, the action loop).
The comm actions of each gap (between two computations) are posted as one batch when reached; a
compute action first waits for the batch that holds the tensor it consumes (``transit``: the
data in transit), then runs the stage's ``StageWorker``. Tensors between two stages of the same
rank are handed over locally. In a combined schedule every training step of a ``StageModule``
runs on the streams as one ``CombinedStep`` (``_run_combined``: an OVERLAP action with both
halves, a lone F, B or I with one). After the last action the outstanding sends are completed,
DualPipe's mirrored gradients summed and, unless ``grad_reduction="none"``, data-parallel
gradients averaged and tied embeddings summed (``grad_sync``); a reduction that overlaps the
backward is told through ``grad_hooks`` when each stage's last backward is done (``grad_points``).

Everything is checked before the first action runs: the schedule is validated and lowered (a
lowered one must run to the end under the batched p2p model), the stages must be those the
placement gives this rank, the inputs must cover the microbatches. Forward-only evaluation runs
the forward actions (under ``torch.no_grad``) lowered on their own: it stores no activation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from megapipe.graphs.nodes import node_graphs
from megapipe.overlap.combined import CombinedStep
from megapipe.overlap.device_streams import make_streams
from megapipe.overlap.plan import WarnOnce
from megapipe.overlap.streams import Streams
from megapipe.overlap.wgrad import WeightGradQueue
from megapipe.parallel.groups import pipeline_position
from megapipe.pipeline.activation_meter import ActivationMeter
from megapipe.pipeline.checks import (
    check_grad_hooks,
    check_graph_options,
    check_inputs,
    check_overlap_options,
    check_stages,
)
from megapipe.pipeline.executor_options import ExecutorOptions
from megapipe.pipeline.grad_points import GradSyncHooks, StepGradEvents
from megapipe.pipeline.grad_sync import sync_step_grads
from megapipe.pipeline.p2p import PipelineP2P
from megapipe.pipeline.rank_actions import RankActions
from megapipe.pipeline.stage_module import is_stage_module
from megapipe.pipeline.stage_worker import StageWorker, runs_on_tape
from megapipe.pipeline.step_profile import ProfileOptions, open_step, take_trace
from megapipe.pipeline.step_result import StepResult, StepState
from megapipe.pipeline.transit import PairSends, StepTensors, stage_links
from megapipe.schedule.actions import plain_key
from megapipe.schedule.ir import Action, Kind, Schedule


class PipelineExecutor:
    """Runs ``schedule`` on this rank's ``stages`` ({stage id: module}) with ``options``
    (``ExecutorOptions``: the spec, the loss, the groups, the reduction and the overlap's and
    the measurements' options, each documented there).

    ``schedule`` is a compute-only schedule (lowered here) or an already lowered one. In
    combined schedules every training F/B/I of ``StageModule`` stages runs as a
    ``CombinedStep``, its comm nodes on one communication stream (made once, closed by
    ``close()``); a module with ``layer_plans()`` that is not a whole ``StageModule`` is refused.
    A pair's sends go out from inside it as each half's result is made (``rank_actions``:
    this rank's lowered actions, their gaps and early sends).
    """

    def __init__(
        self,
        schedule: Schedule,
        stages: Mapping[int, nn.Module],
        options: ExecutorOptions | None = None,
    ) -> None:
        # the options were checked when made (``ExecutorOptions``)
        o = self.options = options if options is not None else ExecutorOptions()
        self.schedule = schedule
        self.position = pipeline_position(schedule.pp, o.groups, o.pp_group)
        self.pp_rank = self.position.rank
        check_stages(schedule, self.pp_rank, stages)
        self.stages = dict(stages)
        # CUDA graphs of static nodes (graphs.nodes); off, with a line to log, without CUDA
        self.cuda_graphs, self.cuda_graph_note = node_graphs(
            o.cuda_graph_impl, o.cuda_graph_modules, self._device(), o.graph_api
        )
        self.workers = {
            s: StageWorker(s, m, o.forward_fn, use_tape=o.use_tape, graphs=self.cuda_graphs)
            for s, m in self.stages.items()
        }
        self.rank_actions = RankActions.of(schedule, self.pp_rank, o.spec is not None)
        has_overlap = self.rank_actions.has_overlap
        check_overlap_options(schedule.name, has_overlap, o.delay_wgrad_compute, o.moe_a2a_waves)
        check_graph_options(
            self.cuda_graphs, self.stages, self.rank_actions.lowered, tape=has_overlap or o.use_tape
        )
        self.record_trace = o.record_trace  # a measurement switch: may change between steps
        self._streams: Streams | None = None  # made on first use, in a combined schedule
        self._warn_once = WarnOnce()
        self._links = stage_links(schedule)  # each stage's neighbours in its pipeline
        self._p2p: PipelineP2P | None = None

    def _device(self) -> torch.device | None:
        first = next((p for m in self.stages.values() for p in m.parameters()), None)
        return first.device if first is not None else None

    @property
    def streams(self) -> Streams:
        """The compute and communication streams (a combined schedule's), made on first use."""
        if self._streams is None:
            self._streams = make_streams(self._device() or "cpu")
        return self._streams

    def close(self) -> None:
        """Stop the communication stream's worker (combined schedules); idempotent."""
        if self._streams is not None:
            self._streams.close()
            self._streams = None

    def __enter__(self) -> PipelineExecutor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def step(
        self,
        microbatches: Sequence[Any] | None = None,
        targets: Sequence[Any] | None = None,
        forward_only: bool = False,
        profile: ProfileOptions | None = None,
        grad_hooks: GradSyncHooks | None = None,
    ) -> StepResult:
        """Run one step over all microbatches: forward and backward, or forward only.

        ``microbatches[i]`` is the first stage's input of microbatch i and ``targets[i]`` the
        last stage's (needed only on ranks holding those stages). Gradients accumulate into
        ``.grad`` (or a bf16 model's fp32 ``main_grad``, ``precision.main_grad``; zero them between
        steps); after a training step they are synchronised. ``profile`` records every compute
        action and pipeline wait in ``StepResult.trace`` too (``step_profile``). A training
        step tells ``grad_hooks`` when each stage's gradients become final (``grad_points``).
        """
        check_inputs(
            self.schedule,
            self.pp_rank,
            self.stages,
            self.options.loss_fn is not None,
            microbatches,
            targets,
            forward_only,
        )
        check_grad_hooks(grad_hooks is not None, self.options.grad_reduction)
        for module in self.stages.values():
            if is_stage_module(module):
                module.set_aux_loss_scale(1.0 / self.schedule.num_microbatches)
        rank = self.rank_actions
        actions = rank.forward_only_actions if forward_only else rank.actions
        state = self._begin_step(microbatches, targets, forward_only, profile, grad_hooks)
        meter = (
            ActivationMeter(  # told of what the workers and the data in transit hold
                self._device(),
                [p for m in self.stages.values() for p in m.parameters()],
                holders=[state.tensors, *self.workers.values()],
            )
            if self.options.measure_activations
            else None
        )
        state.grads.start()
        try:
            with meter if meter is not None else contextlib.nullcontext():
                self._run_actions(actions, state)
        finally:
            for worker in self.workers.values():
                worker.clear()
        self._end_step(state, meter)
        return state.result

    def _begin_step(
        self,
        microbatches: Sequence[Any] | None,
        targets: Sequence[Any] | None,
        forward_only: bool,
        profile: ProfileOptions | None,
        grad_hooks: GradSyncHooks | None,
    ) -> StepState:
        """The step's state: its data in transit, gradient points, trace and profile."""
        streams = self.streams if self.rank_actions.has_overlap else None
        trace, recorder = open_step(
            self.record_trace, profile, forward_only, streams, self._device()
        )
        tensors = StepTensors(
            self.schedule,
            self.pp_rank,
            microbatches,
            self._channel(),
            self.options.spec,
            wait_span=recorder.wait_span,
            prev=self._links[0],
            next=self._links[1],
        )
        grads = StepGradEvents(self.rank_actions.grad_points, None if forward_only else grad_hooks)
        return StepState(tensors, targets, forward_only, grads, trace, profile=recorder)

    def _end_step(self, state: StepState, meter: ActivationMeter | None) -> None:
        """Fill the result's measurements; after a training step synchronise the gradients."""
        if state.trace is not None:
            take_trace(state.result, state.trace)
        if meter is not None:
            state.result.activation_bytes = meter.peak_bytes
            state.result.cuda_activation_bytes = meter.cuda_peak_bytes
        if not state.forward_only:
            sync_step_grads(
                self.schedule,
                self.pp_rank,
                self.stages,
                self.position,
                self.options.groups,
                self.options.grad_reduction,
            )
            state.grads.finish()
        if self.cuda_graphs is not None:
            state.result.graph_instances = self.cuda_graphs.captured
            state.result.graph_bytes = self.cuda_graphs.bytes

    def _run_actions(self, actions: Sequence[Action], state: StepState) -> None:
        index = 0
        while index < len(actions):
            if actions[index].is_compute:
                state.grads.before(index)
                with state.profile.action(actions[index]):
                    self._run_compute(actions, index, state)
                state.grads.after(index)
                index += 1
                continue
            end = index
            while end < len(actions) and not actions[end].is_compute:
                end += 1
            state.tensors.post_rest(actions[index:end])  # part may have gone early
            index = end
        state.tensors.finish_sends()

    def _channel(self) -> PipelineP2P | None:
        """The p2p over the pipeline group, made on first use (None without a spec)."""
        if self._p2p is None and self.options.spec is not None and self.schedule.pp > 1:
            self._p2p = PipelineP2P(
                self.position.group,
                self.position.ranks,
                self.schedule.stage_to_rank,
                self.options.spec,
                self.options.timeout,
                self._device(),
            )
        return self._p2p

    def _run_compute(self, actions: Sequence[Action], index: int, state: StepState) -> None:
        action = actions[index]
        if action.kind is Kind.W:
            s, i = plain_key(action)
            self.workers[s].backward_weight(i)
        elif (
            self.rank_actions.has_overlap
            and not state.forward_only
            and runs_on_tape(action, self.workers, self._warn_once)
        ):
            self._run_combined(action, state, *self.rank_actions.gaps[index])
        elif action.kind is Kind.OVERLAP:  # forward-only, or stages that cannot run node by node
            self._forward(action.forward, state)
            self._backward(action.backward, state)
        elif action.kind is Kind.F:
            self._forward(action, state)
        elif action.kind in (Kind.B, Kind.I):
            self._backward(action, state)
        else:
            raise ValueError(f"rank {self.pp_rank}: cannot run {action}")

    def _run_combined(
        self, action: Action, state: StepState, gap: list[Action], early: Sequence[Action]
    ) -> None:
        """One combined step: an OVERLAP's forward beside its backward, or a lone F, B or I
        (every all-to-all is then issued from the one comm stream). Each half's result is handed
        on (and the sends after the pair posted, ``PairSends``) as soon as it is made, before
        the step's leftover work."""
        f, b = (
            action.sub_actions
            if action.kind is Kind.OVERLAP
            else ((action, None) if action.kind is Kind.F else (None, action))
        )
        tensors = state.tensors
        half = None
        end = None
        if b is not None:
            b_stage, b_microbatch = plain_key(b)
            b_worker = self.workers[b_stage]
            wgrad = WeightGradQueue(b_worker.track) if self.options.delay_wgrad_compute else None
            half = b_worker.backward_half(
                b_microbatch,
                tensors.grad_output(b),
                keep_weight_grads=b.kind is Kind.I,
                wgrad=wgrad,
            )
            end = partial(b_worker.end_backward, b_microbatch, half=half)
        # the hand-overs are given at construction and point one way (step -> sends -> half):
        # no cycle, so all of it is freed when this call returns, not by the garbage collector
        sends = PairSends(tensors, gap, early, backward=b, end=end)
        f_stage, f_microbatch = plain_key(f) if f is not None else (None, None)
        f_worker = self.workers[f_stage] if f_stage is not None else None
        step = CombinedStep(
            self.streams,
            half,
            backward_done=sends.backward_done if b is not None else None,
            trace=state.trace,
            fwd_microbatch=f_microbatch,
            route_input_grads=f_worker is not None and f_worker.routes_input_grads,
            a2a_waves=self.options.moe_a2a_waves,
            track=f_worker.track if f_worker is not None else None,
        )
        if f is not None and f_worker is not None and f_microbatch is not None:
            stage_input = tensors.forward_input(f)
            try:
                output = f_worker.forward(f_microbatch, stage_input, runner=step)
            except BaseException:
                _drain(self.streams)
                raise
            self._hand_forward(f, output, state)
            sends.post_ready()
        step.finish()
        if f is not None:
            self._count_live(state)

    def _forward(self, action: Action, state: StepState) -> None:
        s, i = plain_key(action)
        stage_input = state.tensors.forward_input(action)
        output = self.workers[s].forward(i, stage_input, keep_graph=not state.forward_only)
        self._hand_forward(action, output, state)
        self._count_live(state)

    def _hand_forward(self, action: Action, output: torch.Tensor, state: StepState) -> None:
        s, i = plain_key(action)
        if self._links[1][s] is None:  # a last stage
            self._finish_last_stage(self.workers[s], i, output, state)
        else:
            state.tensors.hand_forward(action, output)

    def _count_live(self, state: StepState) -> None:
        live = sum(w.live_activations for w in self.workers.values())
        state.result.peak_live_activations = max(state.result.peak_live_activations, live)

    def _finish_last_stage(
        self, worker: StageWorker, microbatch: int, output: torch.Tensor, state: StepState
    ) -> None:
        if self.options.loss_fn is None:
            state.result.outputs[microbatch] = output.detach()
            if not state.forward_only:
                raise ValueError("training needs loss_fn on the last stage")
            return
        assert state.targets is not None
        if state.forward_only:
            with torch.no_grad():
                loss = self.options.loss_fn(output, state.targets[microbatch])
        else:
            loss = self.options.loss_fn(output, state.targets[microbatch])
            worker.attach_loss(microbatch, loss / self.schedule.num_microbatches)
        state.result.losses[microbatch] = loss.detach()

    def _backward(self, action: Action, state: StepState) -> None:
        s, i = plain_key(action)
        worker = self.workers[s]
        grad_output = state.tensors.grad_output(action)
        if action.kind is Kind.B:
            grad_input = worker.backward(i, grad_output)
        else:
            grad_input = worker.backward_input(i, grad_output)
        state.tensors.hand_backward(action, grad_input)


def _drain(streams: Streams) -> None:
    """After an error: let the comm stream finish what it runs before the tapes go away."""
    try:
        streams.comm.synchronize()
    except BaseException:  # the caller is already raising the first error
        pass
