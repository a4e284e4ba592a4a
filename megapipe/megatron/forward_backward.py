"""A Megatron-compatible front end: ``get_forward_backward_func`` over megapipe's executor.

A Megatron pretrain script swaps one import::

    # from megatron.core.pipeline_parallel import get_forward_backward_func
    from megapipe import get_forward_backward_func

    forward_backward_func = get_forward_backward_func(pp=4, vpp=2)
    losses = forward_backward_func(
        forward_step_func=forward_step, data_iterator=data_iterator, model=model,
        num_microbatches=8, seq_length=1024, micro_batch_size=1)

and keeps its ``forward_step_func(data_iterator, model) -> (output_tensor, loss_func)``, which
drives the forward: the engine sets the combined step as the chunk's ``node_runner`` around that
call (and restores it after), so a chunk that implements
``megapipe.pipeline.stage_module.StageModule`` (as ``GPTStage`` and the Megatron-Core adapter
do) overlaps; any other chunk runs F then B (warned once). Megatron's conventions hold:

- ``model`` is one chunk, or a list of chunks under virtual pipelining: chunk j of a rank is the
  j-th stage (in increasing stage order) the schedule places on it (stage ``r + j * pp`` for
  loop placement). ``data_iterator`` is one iterator or a list with one per chunk.
- Before each forward the executor calls ``chunk.set_input_tensor(t)``: ``t`` is the received
  activation on a chunk that is not the first stage (None on the first), and the chunk's
  forward must use it instead of its token input, exactly as Megatron's models do
  (``GPTStage.set_input_tensor`` implements it for the reference model).
- On the last stage ``loss_func(output_tensor)`` returns ``(loss, {name: value})`` or
  ``(loss, num_tokens, {name: value})``; the loss is divided by ``num_tokens`` (3-tuple form,
  unless ``calculate_per_token_loss``) and by ``num_microbatches`` before backward, and the
  function returns the list of per-microbatch dicts on ranks that hold a last stage (an empty
  list elsewhere). With ``forward_only`` and ``collect_non_loss_data`` it stores
  ``loss_func(output_tensor, non_loss_data=True)`` instead.
- The auxiliary losses of megapipe's MoE layers inside the chunks are the front end's to keep,
  as Megatron's tracker is Megatron's: after each call the layers' logs are taken (emptied,
  nothing summed: a Megatron loop never pops them, and a log nobody pops keeps two small
  tensors per layer per forward), and ``aux_losses()`` gives each such layer's mean over the
  call's forwards, summed only when asked.

The schedule follows ``pp``, ``vpp`` and ``schedule`` (default ``interleaved-1f1b`` when
vpp > 1, ``1f1b`` when pp > 1, no pipelining when pp = 1). Activations crossing stages have
the shape ``(micro_batch_size, seq_length, hidden_size)`` (``axes="bsh"``, megapipe's GPT) or
``(seq_length, micro_batch_size, hidden_size)`` (``axes="sbh"``, Megatron's). Gradients are
reduced over data parallelism inside the call when ``groups`` is given and ``reduce_grads``.

Megatron-Core ``GPTModel`` chunks (also inside Megatron's ``Float16Module`` and
``DistributedDataParallel``) are wrapped in ``McoreGPTStage`` (``mcore_adapter``), so they
overlap in combined schedules; ``forward_step_func`` then receives the wrapper, which called with
the chunk's arguments is the chunk (``.module`` is the chunk as given). For them the tensors' axes
default to ``"sbh"`` and the activation dtype to the config's ``pipeline_dtype``. With
``reduce_grads=False`` the data-parallel reduction is Megatron's: megapipe calls the hooks a
script set on the config (``config.no_sync_func``, ``grad_sync_func``, ``param_sync_func``,
``finalize_model_grads_func``) where Megatron's schedules do, so Megatron's
``DistributedDataParallel`` with ``overlap_grad_reduce``, the distributed optimizer and
``overlap_param_gather`` work in every megapipe schedule (``ddp_hooks``); with
``reduce_grads=True`` megapipe reduces (chunks must not be DDP-wrapped then).
``decoder_seq_length`` and ``first_val_step`` are accepted for signature compatibility and
unused (no encoder-decoder models, no validation-step special case).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from megapipe.megatron.ddp_hooks import MegatronGradSync, check_data_parallel
from megapipe.megatron.front_end_executor import build_executor
from megapipe.megatron.front_end_options import FrontEndOptions, overlap_modes
from megapipe.megatron.mcore_adapter import McoreGPTStage
from megapipe.megatron.mcore_support import check_ddp, finish_router_step
from megapipe.moe.aux_loss import AuxLossLog
from megapipe.moe.layer import take_aux_loss_logs
from megapipe.parallel.groups import ProcessGroups
from megapipe.pipeline.executor import PipelineExecutor, StepResult
from megapipe.pipeline.overlap_auto import OverlapAuto
from megapipe.schedule import Schedule

ForwardStepFunc = Callable[[Any, nn.Module], tuple[torch.Tensor, Callable[..., Any]]]


class _TakesInput(Protocol):
    """Megatron's convention a chunk follows: the received activation handed in before its
    forward (``set_input_tensor``)."""

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None: ...


@dataclass
class _CallState:
    """What one call collects while the executor runs: loss functions and results."""

    forward_step_func: ForwardStepFunc
    iterators: dict[int, Any]
    num_microbatches: int
    forward_only: bool
    collect_non_loss_data: bool
    calculate_per_token_loss: bool
    stage_of: dict[int, int]  # id(chunk) -> its stage
    loss_funcs: dict[int, Callable[..., Any]] = field(default_factory=dict)
    store: dict[int, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class _LossTarget:
    """The executor's target of a last-stage microbatch: which stage and microbatch it is, so
    the loss step finds that stage's ``loss_func``."""

    stage: int
    microbatch: int


class MegatronForwardBackward:
    """The callable ``get_forward_backward_func`` returns (see the module docstring)."""

    def __init__(self, options: FrontEndOptions) -> None:
        self.options = options
        self.schedule_name = options.schedule_name
        self.last_result: StepResult | None = None  # the executor's StepResult of the last call
        self._aux_logs: list[AuxLossLog] = []  # what this rank's MoE layers logged last call
        self._executors: dict[tuple, tuple[PipelineExecutor, dict[int, nn.Module]]] = {}
        self._autos: dict[tuple, OverlapAuto] = {}  # overlap "auto": the plain one beside
        self.overlap_auto_lines: list[str] = []  # its decisions (rank 0 also prints them)
        self._call: _CallState | None = None

    # -------------------------------------------------------------- Megatron's call
    def __call__(
        self,
        *,
        forward_step_func: ForwardStepFunc,
        data_iterator: Iterator | Sequence[Iterator] | None,
        model: nn.Module | Sequence[nn.Module],
        num_microbatches: int,
        seq_length: int,
        micro_batch_size: int,
        decoder_seq_length: int | None = None,
        forward_only: bool = False,
        collect_non_loss_data: bool = False,
        first_val_step: bool | None = None,
    ) -> list[Any]:
        chunks = [model] if isinstance(model, nn.Module) else list(model)
        executor, stages = self._executor(chunks, num_microbatches, seq_length, micro_batch_size)
        if not forward_only:
            for chunk in chunks:
                check_ddp(chunk, self.options.reduce_grads)
                check_data_parallel(chunk, executor.schedule, executor.cuda_graphs is not None)
        self._call = _CallState(
            forward_step_func,
            _iterators(data_iterator, chunks, stages),
            num_microbatches,
            forward_only,
            collect_non_loss_data,
            self.options.calculate_per_token_loss,
            stage_of={id(module): stage for stage, module in stages.items()},
        )
        try:
            targets = _loss_targets(executor.schedule, stages, num_microbatches)
            hooks = None if forward_only else self._megatron_hooks(chunks, stages)
            auto = (
                None
                if forward_only
                else self._autos.get(
                    self._key(chunks, num_microbatches, seq_length, micro_batch_size)
                )
            )
            if auto is not None:  # this call's mode: the trial's, or the faster one's
                executor = auto.executor
                auto.start()
            self.last_result = executor.step(
                [None] * num_microbatches, targets, forward_only=forward_only, grad_hooks=hooks
            )
            decision = auto.finish() if auto is not None else None
            if decision is not None:
                self.overlap_auto_lines.append(decision)
                if not dist.is_initialized() or dist.get_rank() == 0:
                    print(decision, flush=True)
            self._aux_logs = take_aux_loss_logs(chunks)  # the layers' logs stay one call long
            if not forward_only and self.options.reduce_grads:
                finish_router_step(chunks)  # Megatron's expert-bias update, per-step resets
            return [self._call.store[i] for i in sorted(self._call.store)]
        finally:
            self._call = None

    def aux_losses(self) -> list[torch.Tensor]:
        """The mean auxiliary loss of each of this rank's megapipe MoE layers over the last
        call's forwards (module docstring), summed when asked."""
        # every log taken holds values (take_aux_loss_logs leaves the empty ones out)
        return [torch.stack(log.values()).mean() for log in self._aux_logs]

    # -------------------------------------------------------------- executor per shape
    def _executor(
        self, chunks: list[nn.Module], num_microbatches: int, seq_length: int, micro_batch_size: int
    ) -> tuple[PipelineExecutor, dict[int, nn.Module]]:
        """This call shape's executor and stages (``front_end_executor``), built once."""
        key = self._key(chunks, num_microbatches, seq_length, micro_batch_size)
        if key not in self._executors:
            executor, stages, auto = build_executor(
                self.options,
                chunks,
                num_microbatches,
                seq_length,
                micro_batch_size,
                loss_fn=self._loss,
                forward_fn=self._forward,
            )
            self._executors[key] = (executor, stages)
            if auto is not None:
                self._autos[key] = auto
        return self._executors[key]

    @staticmethod
    def _key(
        chunks: list[nn.Module], num_microbatches: int, seq_length: int, micro_batch_size: int
    ) -> tuple:
        return (tuple(id(c) for c in chunks), num_microbatches, seq_length, micro_batch_size)

    def _megatron_hooks(
        self, chunks: list[nn.Module], stages: dict[int, nn.Module]
    ) -> MegatronGradSync | None:
        """With ``reduce_grads=False``, Megatron-Core chunks get the data-parallel hooks their
        config holds, called where Megatron's schedules call them (``ddp_hooks``)."""
        megatron = [s for s in stages.values() if isinstance(s, McoreGPTStage)]
        if self.options.reduce_grads or not megatron:
            return None
        chunk_of = {stage: j for j, stage in enumerate(stages)}  # the order of ``chunks``
        return MegatronGradSync(megatron[0].config, chunks, chunk_of)

    def close(self) -> None:
        """Stop the executors' communication streams (combined schedules)."""
        for executor, _ in self._executors.values():
            executor.close()
        for auto in self._autos.values():
            auto.close()

    # -------------------------------------------------------------- executor hooks
    def _forward(self, chunk: nn.Module, stage_input: Any) -> torch.Tensor:
        call = self._call
        assert call is not None
        taker = cast(_TakesInput, chunk)  # checked at placement (front_end_executor)
        taker.set_input_tensor(stage_input if isinstance(stage_input, torch.Tensor) else None)
        stage = call.stage_of[id(chunk)]
        try:
            output, loss_func = call.forward_step_func(call.iterators[stage], chunk)
        finally:
            taker.set_input_tensor(None)  # hold no activation beyond this forward
        call.loss_funcs[stage] = loss_func
        return output

    def _loss(self, output: torch.Tensor, target: _LossTarget) -> torch.Tensor:
        call = self._call
        assert call is not None
        loss_func = call.loss_funcs.pop(target.stage)
        if call.forward_only and call.collect_non_loss_data:
            call.store[target.microbatch] = loss_func(output, non_loss_data=True)
            return torch.zeros(())
        outputs = loss_func(output)
        if len(outputs) == 3:
            loss, num_tokens, reduced = outputs
            if not call.calculate_per_token_loss:
                loss = loss / num_tokens
        elif len(outputs) == 2:
            loss, reduced = outputs
        else:
            raise ValueError(
                f"loss_func returned {len(outputs)} values; Megatron's forms are "
                "(loss, {name: value}) and (loss, num_tokens, {name: value})"
            )
        call.store[target.microbatch] = reduced
        return loss


def _iterators(
    data_iterator: Any, chunks: list[nn.Module], stages: dict[int, nn.Module]
) -> dict[int, Any]:
    """Each stage's data iterator: one for all, or one per chunk in stage order."""
    if not isinstance(data_iterator, (list, tuple)):
        return {s: data_iterator for s in stages}
    if len(data_iterator) != len(chunks):
        raise ValueError(
            f"data_iterator is a list of {len(data_iterator)} but model has "
            f"{len(chunks)} chunks; give one iterator per chunk (or a single one)"
        )
    return {s: data_iterator[j] for j, s in enumerate(sorted(stages))}


def _loss_targets(
    schedule: Schedule, stages: dict[int, nn.Module], num_microbatches: int
) -> list[_LossTarget | None]:
    """The executor's target of each microbatch: the last stage on this rank that holds it."""
    targets: list[_LossTarget | None] = [None] * num_microbatches
    for stage in stages:
        if schedule.is_last_stage(stage):
            for i in range(num_microbatches):
                if stage in schedule.stages_for(i):
                    targets[i] = _LossTarget(stage, i)
    return targets


def get_forward_backward_func(
    pp: int = 1,
    vpp: int = 1,
    schedule: str | None = None,
    *,
    groups: ProcessGroups | None = None,
    hidden_size: int | None = None,
    axes: str | None = None,
    dtype: torch.dtype | None = None,
    timeout: float = 300.0,
    overlap: bool = False,
    calculate_per_token_loss: bool = False,
    reduce_grads: bool = True,
    overlap_moe_expert_parallel_comm: bool | str = False,
    delay_wgrad_compute: bool = False,
    record_trace: bool = False,
    microbatch_group_size_per_vp_stage: int | None = None,
    max_extra_in_flight: int | None = None,
    cuda_graph_impl: str = "none",
    cuda_graph_modules: Sequence[str] = (),
    overlap_auto_interval: int = 500,
    overlap_auto_clock: Callable[[], float] = time.perf_counter,
) -> MegatronForwardBackward:
    """A function with Megatron's ``forward_backward_func`` signature, run by megapipe.

    ``pp``/``vpp``/``schedule`` pick the schedule (module docstring), ``groups`` (from
    ``megapipe.parallel.create_groups``) the process groups; ``overlap_moe_expert_parallel_comm``
    (Megatron's flag; ``overlap=True`` is the same) picks the combined variant of the schedule,
    or with ``"auto"`` the faster of plain and combined, timed on this machine. Each keyword is
    a field of ``FrontEndOptions``: its docstring says what each does and what is refused.
    """
    overlap_on, auto = overlap_modes(overlap, overlap_moe_expert_parallel_comm)
    return MegatronForwardBackward(
        FrontEndOptions(
            pp=pp,
            vpp=vpp,
            schedule=schedule,
            groups=groups,
            hidden_size=hidden_size,
            axes=axes,
            dtype=dtype,
            timeout=timeout,
            overlap=overlap_on,
            overlap_auto=auto,
            overlap_auto_interval=overlap_auto_interval,
            overlap_auto_clock=overlap_auto_clock,
            calculate_per_token_loss=calculate_per_token_loss,
            reduce_grads=reduce_grads,
            delay_wgrad_compute=delay_wgrad_compute,
            record_trace=record_trace,
            microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage,
            max_extra_in_flight=max_extra_in_flight,
            cuda_graph_impl=cuda_graph_impl,
            cuda_graph_modules=tuple(cuda_graph_modules),
        )
    )
