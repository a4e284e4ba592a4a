"""Megatron's data-parallel hooks, called at megapipe's points of the step.

A Megatron script that wraps its chunks in Megatron's ``DistributedDataParallel`` sets hooks on
the model config for the schedule to call (``megatron/training/training.py``):
``config.no_sync_func`` (each chunk's ``no_sync``: while it is entered, DDP's backward hooks
only accumulate), ``config.grad_sync_func`` (each chunk's ``start_grad_sync``: start its
bucketed reduction, set with ``overlap_grad_reduce`` and ``align_grad_reduce``),
``config.param_sync_func`` (each chunk's ``start_param_sync``: start the all-gather of its
updated parameters, set with ``overlap_param_gather`` and ``align_param_gather``) and
``config.finalize_model_grads_func`` (wait for the reductions; tied embeddings, expert and
layernorm gradients). Megatron's schedules (0.16 to 0.19 alike) call them as follows, and
``MegatronGradSync`` does the same at megapipe's points (``pipeline.grad_points``), in every
megapipe schedule, overlapped or not:

- the step starts with gradient synchronisation disabled (all ``no_sync`` entered; a list of
  them is entered together, as Megatron's interleaved schedule does);
- ``param_sync_func`` of the first two chunks (in the order of their first forward) at the
  start, then that of chunk i + 1 at chunk i's first forward (i >= 1). Megatron's interleaved
  schedule shifts the second kind by the pipeline rank to align ranks in time; the gathers and
  the numbers are the same;
- without ``grad_sync_func``: synchronisation enabled for the action holding a chunk's last
  backward, so DDP's hooks start each bucket as it fills, and disabled again after it;
- with ``grad_sync_func``: after a chunk's last backward of the step (its gradients final),
  synchronisation enabled and ``grad_sync_func[chunk](chunk.parameters())`` called, then
  disabled again. (Megatron's interleaved schedule delays this call by the pipeline rank to
  start the reductions of all pipeline ranks at the same time; megapipe's schedules are not
  lock-step, so each chunk starts as soon as it can.)
- at the end: synchronisation enabled, ``grad_sync_func`` of any chunk not yet started, then
  ``finalize_model_grads_func(model, None)``.

``check_data_parallel`` refuses, in one line, what this cannot run: DualPipe's mirrored stages
under ``overlap_grad_reduce`` (the two copies of a model part must be summed before the
reduction, which Megatron's DDP would start inside the backward), Megatron-FSDP (see
``check_data_parallel``) and ``overlap_param_gather`` with CUDA graphs (its waits are module
hooks, which a replay does not run).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from megapipe.megatron.mcore_support import chain_of, megatron_ddp
from megapipe.schedule.ir import Schedule


def _fsdp(chunk: nn.Module) -> nn.Module | None:
    """Megatron-FSDP's or torch FSDP2's wrapper (Megatron's classes) around ``chunk``, if any."""
    return next(
        (
            m
            for m in chain_of(chunk)
            if type(m).__module__.startswith("megatron.")
            and "FullyShardedDataParallel" in type(m).__name__
        ),
        None,
    )


def check_data_parallel(chunk: nn.Module, schedule: Schedule, graphs: bool = False) -> None:
    """What megapipe cannot run of the data parallelism a Megatron script set up (module
    docstring); one line naming the setting and why. ``graphs``: CUDA graphs are on."""
    fsdp = _fsdp(chunk)
    if fsdp is not None:
        raise NotImplementedError(
            f"{type(fsdp).__name__} is not supported: Megatron-FSDP turns the parameters into "
            "sharded DTensors and unshards them in hooks around module forward calls (with its "
            "default optim_grads_params sharding, around each whole TransformerLayer), while "
            "megapipe's adapter runs a layer as separate nodes through the layer's internals, "
            "so those hooks would not run where they must; use DistributedDataParallel with "
            "use_distributed_optimizer=True (ZeRO-1 sharding)"
        )
    ddp = megatron_ddp(chunk)
    if graphs and getattr(getattr(ddp, "ddp_config", None), "overlap_param_gather", False):
        raise NotImplementedError(
            "Megatron DDP's overlap_param_gather=True with CUDA graphs: its all-gather waits are "
            "module forward pre-hooks, which a graph replay does not run; use "
            "overlap_param_gather=False or cuda_graph_impl='none'"
        )
    overlap = getattr(getattr(ddp, "ddp_config", None), "overlap_grad_reduce", False)
    if overlap and schedule.bidirectional:
        raise NotImplementedError(
            f"Megatron DDP's overlap_grad_reduce=True cannot run {schedule.name!r}: its two "
            "copies of each model part must sum their gradients before the data-parallel "
            "reduction, which DDP starts inside the backward; use overlap_grad_reduce=False "
            "or a schedule without mirrored stages (dualpipev)"
        )


def _no_sync_context(no_sync_func: Any) -> Callable[[], Any]:
    """Megatron's combined ``no_sync``: a list of per-chunk ones entered together."""
    if no_sync_func is None:
        return contextlib.nullcontext
    if isinstance(no_sync_func, (list, tuple)):
        funcs = list(no_sync_func)

        def all_no_sync() -> contextlib.ExitStack:
            stack = contextlib.ExitStack()
            for func in funcs:
                stack.enter_context(func())
            return stack

        return all_no_sync
    return no_sync_func


def _per_chunk(func: Any, count: int) -> list[Any] | None:
    if func is None:
        return None
    return list(func) if isinstance(func, (list, tuple)) else [func] * count


class MegatronGradSync:
    """Megatron's config hooks at megapipe's points (``GradSyncHooks``; module docstring).

    ``model`` is the chunk list as the script passed it (chunk j = the j-th stage of this rank
    in increasing order, ``chunk_of``: {stage: j}); ``config`` the chunks' model config.
    """

    def __init__(self, config: Any, model: Sequence[nn.Module], chunk_of: dict[int, int]) -> None:
        self.config = config
        self.model = list(model)
        self.chunk_of = chunk_of
        count = len(self.model)
        self._no_sync = _no_sync_context(getattr(config, "no_sync_func", None))
        self._grad_sync = _per_chunk(getattr(config, "grad_sync_func", None), count)
        self._param_sync = _per_chunk(getattr(config, "param_sync_func", None), count)
        self._context: Any = None
        self._synced: set[int] = set()
        self._first_forwards: list[int] = []

    # ------------------------------------------------------------ Megatron's toggles
    def _disable(self) -> None:
        if self._context is None:
            self._context = self._no_sync()
            self._context.__enter__()

    def _enable(self) -> None:
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None

    def _sync_params(self, chunk: int) -> None:
        if self._param_sync is not None:
            self._param_sync[chunk](self.model[chunk].parameters())

    # ------------------------------------------------------------ GradSyncHooks
    def step_started(self, forward_stages: Sequence[int]) -> None:
        self._synced = set()
        self._first_forwards = [self.chunk_of[s] for s in forward_stages]
        self._disable()
        for chunk in self._first_forwards[:2]:
            self._sync_params(chunk)

    def before_first_forward(self, stage: int) -> None:
        at = self._first_forwards.index(self.chunk_of[stage])
        if at >= 1 and at + 1 < len(self._first_forwards):
            self._sync_params(self._first_forwards[at + 1])

    def before_last_backward(self, stage: int) -> None:
        if self._grad_sync is None:
            self._enable()

    def after_last_backward(self, stage: int) -> None:
        self._disable()

    def stage_grads_final(self, stage: int) -> None:
        chunk = self.chunk_of[stage]
        if self._grad_sync is not None:
            self._enable()
            self._grad_sync[chunk](self.model[chunk].parameters())
            self._synced.add(chunk)
            self._disable()

    def step_finished(self) -> None:
        self._enable()
        if self._grad_sync is not None:
            for chunk in range(len(self.model)):
                if chunk not in self._synced:
                    self._grad_sync[chunk](self.model[chunk].parameters())
        finalize = getattr(self.config, "finalize_model_grads_func", None)
        if finalize is not None:
            finalize(self.model, None)  # no token count: calculate_per_token_loss is refused
