"""Run Megatron-Core (0.16 to 0.19) on CPU with gloo: monkeypatches for its CUDA hard-codes (test
code).

Megatron-Core assumes CUDA in a few dozen places that have nothing to do with the numbers:
``device=torch.cuda.current_device()`` in ~30 constructors, CUDA streams and events in the
all-to-all token dispatcher and in its combined 1F1B, ``record_stream`` and ``.cuda()`` on
tensors, the CUDA RNG tracker, ``device="cuda"`` zeros in its schedules and default causal
mask, ``torch.cuda.synchronize`` in p2p and NVTX ranges. ``apply()`` replaces each with its CPU
meaning (the current device is the CPU, a stream is the host thread, an event is already
complete, the RNG tracker keeps CPU generator states). It also works around two Megatron bugs
seen on machines without TransformerEngine: ``moe_utils.te_general_gemm`` is referenced but only
defined when TransformerEngine imports, and the dispatcher turns split sizes into numpy arrays
only for CUDA tensors (CPU tensors then break ``all_to_all_single`` at ep > 1). Two more for
features the tests use: Megatron's torch norm refuses ``sequence_parallel`` (built here as
Apex's fused norm builds it: a torch norm whose parameters are marked sequence-parallel), and
``CheckpointWithoutOutput`` (selective ``layernorm`` recompute) asks TransformerEngine's FP8
state even without FP8 (``fp8=False`` is taken as "given").

These patches live here, never in megapipe/: megapipe runs Megatron's models unchanged on GPUs.
``apply()`` is idempotent; it changes process-wide state, so call it only in processes that run
Megatron on CPU (the test pools, the CPU path of examples/megatron_core_gpt.py).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

_APPLIED = False


class _HostStream:
    """A CUDA stream on CPU: the host thread itself."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _DoneEvent:
        return _DoneEvent()

    def synchronize(self) -> None:
        pass

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _HostStream)

    def __hash__(self) -> int:
        return 0


class _DoneEvent:
    """A CUDA event on CPU: the work it marks ran on the host, so it is complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _CpuRngTracker:
    """Megatron's ``CudaRNGStatesTracker`` with CPU generator states (``add``/``fork``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        generator = torch.Generator().manual_seed(seed)
        self.seeds_.add(seed)
        self.states_[name] = generator.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        original = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(original)


class _CpuTorch:
    """``torch`` as Megatron's schedules see it: ``device="cuda"`` tensors land on the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, **kwargs)


def _maybe_move_tensor_to_cpu(
    tensor: Any, as_numpy: bool = False, record_stream: bool = False
) -> Any:
    """Megatron's helper, with the numpy conversion its GPU path does also done on CPU."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.cpu().numpy()
    return tensor


def _causal_mask(sq: int) -> torch.Tensor:
    """Megatron's default causal mask (True above the diagonal), made on the CPU."""
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def apply() -> None:
    """Patch Megatron-Core (and torch.cuda's host-side API) for CPU runs; idempotent."""
    global _APPLIED
    if _APPLIED:
        return
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.random as random
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.Stream = _HostStream
    torch.cuda.Event = _DoneEvent
    torch.cuda.current_stream = lambda *a, **k: _HostStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.nvtx.range_push = lambda *a, **k: None
    torch.cuda.nvtx.range_pop = lambda *a, **k: None
    torch.cuda.nvtx.range = lambda *a, **k: contextlib.nullcontext()
    torch.Tensor.record_stream = lambda self, stream: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # tied embeddings' init copy
    random.CudaRNGStatesTracker = _CpuRngTracker
    # no CUDA generator: the checkpoints' saved "CUDA" state is empty (the CPU state and the
    # tracker's states, which they also save and restore, are the ones dropout draws from)
    random._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    random._set_cuda_rng_state = lambda *args, **kwargs: None
    random.initialize_rng_tracker(force_reset=True)
    schedules.torch = _CpuTorch()
    fused_softmax.get_default_causal_mask = _causal_mask
    moe_utils.te_general_gemm = None  # Megatron reads it though only TE's import defines it
    moe_utils.maybe_move_tensor_to_cpu = _maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = _maybe_move_tensor_to_cpu
    _patch_torch_norm()
    _patch_checkpoint_without_output()
    _APPLIED = True


def _patch_torch_norm() -> None:
    from megatron.core.transformer import torch_norm

    original = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, eps, *args, **kwargs)
        config.sequence_parallel = False  # build the torch norm, then mark it as Apex does
        try:
            norm = original(cls, config, hidden_size, eps, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(new)


def _patch_checkpoint_without_output() -> None:
    from megatron.core.tensor_parallel import random

    cls = random.CheckpointWithoutOutput
    original = cls.__init__

    def init(self, fp8=False):
        original(self, fp8)
        if not fp8:
            self.fp8 = False

    cls.__init__ = init


class _CpuTensorTorch(_CpuTorch):
    """``torch`` as Megatron's optimizer and gradient clipping see it: ``device="cuda"``
    tensors, zeros included, land on the CPU."""

    @staticmethod
    def tensor(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.tensor(*args, **kwargs)


def _cpu_l2_norm(chunk_size: int, noop_flag: Any, tensor_lists: Any, per_tensor: bool,
                 *args: Any) -> tuple[torch.Tensor, None]:
    """Megatron's local ``multi_tensor_l2norm`` (the norm of the per-tensor norms), on CPU."""
    norms = [[torch.norm(t) for t in tensors] for tensors in tensor_lists]
    return torch.tensor([float(torch.norm(torch.tensor(norms)))], dtype=torch.float), None


_TENSOR_TYPE = torch.Tensor.type
_OPTIMIZER_APPLIED = False


def _megatron_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``Tensor.type()``: Megatron's optimizer accepts only ``torch.cuda.*Tensor`` names, so to
    code of Megatron's a CPU tensor names its CUDA type; every other caller sees the truth."""
    name = _TENSOR_TYPE(self, *args, **kwargs)
    if args or kwargs or self.is_cuda:
        return name
    import sys

    caller = sys._getframe(1).f_globals.get("__name__", "")
    if caller.startswith("megatron.") and name.startswith("torch.") and ".cuda." not in name:
        return "torch.cuda." + name[len("torch."):]
    return name


def apply_optimizer_patches() -> None:
    """Also run Megatron's optimizers (``DistributedOptimizer``, gradient clipping) on CPU:
    their ``device="cuda"`` buffers, their CUDA-only type checks and the local L2-norm
    fallback's CUDA result. Idempotent; after ``apply()``."""
    global _OPTIMIZER_APPLIED
    if _OPTIMIZER_APPLIED:
        return
    apply()
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as optimizer

    # Megatron's CPU stand-in patches it
    torch.Tensor.type = _megatron_type  # type: ignore[method-assign]
    clip_grads.torch = _CpuTensorTorch()
    clip_grads.l2_norm_impl = _cpu_l2_norm
    optimizer.torch = _CpuTensorTorch()
    _OPTIMIZER_APPLIED = True
