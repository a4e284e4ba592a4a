"""Compile megapipe's Triton kernels for a CUDA GPU on a machine that has none.

``compiling_for(arch)`` makes a stand-in CUDA driver Triton's active driver: a kernel launched
from the usual Python wrappers (``triton_norm.rms_norm(x, ...)`` with CPU tensors) is
specialized and compiled for ``GPUTarget("cuda", arch, 32)`` exactly as on that GPU (Triton's
own NVIDIA backend, LLVM's NVPTX and Triton's bundled ``ptxas``, down to a cubin), then the
launch is recorded instead of run: its kernel, grid, registers and stack bytes per thread (read
from the cubin by the bundled ``cuobjdump``). Nothing is executed, so outputs stay
uninitialized; what this checks is that every kernel compiles at the shapes it is launched
with, and what it costs in registers. Stack bytes are the local memory a thread spills to
(every device function is inlined); ``spills`` counts them in 4-byte words, as Triton's
``CompiledKernel.n_spills`` does from the driver's local size on a GPU.

Triton caches a kernel per device and per specialization: the stand-in's device number is the
architecture (90, 100), so it never shares a cache entry with a real GPU, and one process can
compile for several architectures. Kernel modules must have been imported without
``TRITON_INTERPRET=1`` (the interpreter compiles nothing).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime.driver import driver

# what a launch checks against (H100 SXM and B200: 227 KB of shared memory a block, 1024
# threads); compute units for the grids' occupancy
DEVICES = {
    90: {"max_shared_mem": 232448, "multiprocessor_count": 132},
    100: {"max_shared_mem": 232448, "multiprocessor_count": 148},
}


@dataclass(frozen=True)
class Launch:
    """One recorded launch: kernel name, grid, registers and stack bytes per thread, and
    whether it was compiled with FP fusion (``enable_fp_fusion``)."""

    kernel: str
    grid: tuple[int, int, int]
    registers: int
    stack_bytes: int
    fp_fusion: bool

    @property
    def spills(self) -> int:
        """Spilled 4-byte words per thread (Triton's ``n_spills``)."""
        return self.stack_bytes // 4


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) per thread of the one function in ``cubin``."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        out = subprocess.run(
            [tool, "--dump-resource-usage", file.name], check=True, capture_output=True, text=True
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{out}")
    return int(found.group(1)), int(found.group(2))


class _Module:
    """What ``load_binary`` hands Triton: the kernel's registers and stack, for the launcher."""

    def __init__(self, name: str, registers: int, stack_bytes: int) -> None:
        self.name, self.registers, self.stack_bytes = name, registers, stack_bytes


class _Utils:
    def __init__(self, arch: int) -> None:
        self.arch = arch

    def get_device_properties(self, device: int) -> dict[str, int]:
        return {**DEVICES[self.arch], "max_num_regs": 65536, "warpSize": 32}

    def load_binary(self, name: str, cubin: bytes, shared: int, device: int) -> tuple:
        registers, stack = resource_usage(cubin)
        module = _Module(name, registers, stack)
        return module, module, registers, stack // 4, 1024

    def unload_module(self, module: Any) -> None:
        pass


class _Launcher:
    """Triton keeps a kernel's launcher with the kernel (per device, so per arch) for the
    process: it records into the stand-in active at the launch."""

    def __init__(self, src: Any, metadata: Any) -> None:
        self.fp_fusion = bool(metadata.enable_fp_fusion)

    def __call__(
        self, gx: int, gy: int, gz: int, stream: Any, function: _Module, *args: Any
    ) -> None:
        active = driver.active
        if not isinstance(active, StandInDriver):
            raise RuntimeError("a stand-in kernel launched outside compiling_for")
        active.launches.append(
            Launch(
                function.name,
                (gx, gy, gz),
                function.registers,
                function.stack_bytes,
                self.fp_fusion,
            )
        )


class StandInDriver(DriverBase):
    """Triton's view of a CUDA device of compute capability ``arch`` that records launches
    (``launches``) instead of running them."""

    def __init__(self, arch: int) -> None:
        super().__init__()
        if arch not in DEVICES:
            raise ValueError(f"arch={arch} is not one of {sorted(DEVICES)}")
        self.arch = arch
        self.utils = _Utils(arch)
        self.launches: list[Launch] = []

        self.launcher_cls = _Launcher

    @classmethod
    def is_active(cls) -> bool:
        return False  # never picked by Triton itself

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError("the stand-in driver builds no launcher")

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.arch, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_benchmarker(self) -> Any:
        raise NotImplementedError("the stand-in driver runs nothing")

    def get_current_device(self) -> int:
        return self.arch

    def get_current_stream(self, device: int) -> int:
        return 0


@contextlib.contextmanager
def compiling_for(arch: int) -> Iterator[list[Launch]]:
    """Within the block, Triton launches compile for ``sm_<arch>`` and are recorded in the
    yielded list instead of run; Triton's driver is the one before again after it."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TRITON_INTERPRET=1 interprets kernels: nothing would compile")
    stand_in = StandInDriver(arch)
    previous = driver._active  # None until first used: ``reset_active`` would create it,
    driver.set_active(stand_in)  # which raises on a machine with no GPU
    try:
        yield stand_in.launches
    finally:
        driver._active = previous
