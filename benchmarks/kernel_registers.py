"""Registers and spills of every megapipe Triton kernel at the shapes users run, compiled for a
GPU on this CPU (``megapipe.kernels.standin_driver``: Triton's NVIDIA backend and its bundled
ptxas, no GPU needed).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/kernel_registers.py [--arch 90 100]

One line per kernel launch: the kernel, the shape it was launched at, its grid, registers per
thread, and stack bytes per thread (spilled registers: every function is inlined), with a last
line naming any launch that spills. A register-bound kernel runs fewer warps per SM and one that
spills reads local memory, so a kernel should neither spill nor sit at 255 registers. The
default shapes: 4096 tokens; hidden 1024, 4096 and 7168; 64, 128 and 256 experts; top-6 and
top-8; softmax (its top-k renormalised or not) and sigmoid; bf16. A first run compiles 63
kernels an architecture (minutes); Triton's cache makes a second quick.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megapipe.kernels.standin_driver import Launch, compiling_for

TOKENS = 4096
HIDDEN = (1024, 4096, 7168)
EXPERTS = (64, 128, 256)
TOP_K = (6, 8)


@dataclass(frozen=True)
class Row:
    """One launch of the table: the operator and shape it was launched for, and the launch."""

    shape: str
    launch: Launch


def _empty(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype)  # never read: only compiled for


# name: (sigmoid, renormalize); "renormalised": softmax, its top-k divided by their sum
ROUTER_MODES = {"softmax": (False, False), "sigmoid": (True, False),
                "renormalised": (False, True)}


def router_launches(tokens: int, experts: int, top_k: int, sigmoid: bool,
                    renormalize: bool = False, dtype: torch.dtype = torch.bfloat16,
                    ) -> list[Callable[[], object]]:
    """The router's forward and backward (with every loss term) at one shape."""
    from megapipe.kernels import triton_router as TR

    logits = _empty(tokens, experts, dtype=dtype)
    counts = _empty(experts, dtype=torch.int64)
    grad = _empty(tokens, top_k, dtype=dtype)
    return [lambda: TR.router(logits, top_k, sigmoid, renormalize),
            lambda: TR.router_backward(grad, logits, counts, None, top_k, sigmoid, 0.01, 0.001,
                                       renormalize)]


def rows_launches(tokens: int, experts: int, top_k: int) -> list[Callable[[], object]]:
    """The routing rows, dropless and with a capacity."""
    from megapipe.kernels import triton_router as TR

    indices = _empty(tokens, top_k, dtype=torch.int64)
    capacity = tokens * top_k // experts
    return [lambda: TR.routing_rows(indices, experts, -1),
            lambda: TR.routing_rows(indices, experts, capacity)]


def hidden_launches(tokens: int, hidden: int, top_k: int) -> list[Callable[[], object]]:
    """RMSNorm forward and backward, SwiGLU forward and backward (4 x hidden wide), the
    permute and its two sums, at one hidden size."""
    from megapipe.kernels import triton_norm as TN, triton_permute as TP

    x, w = _empty(tokens, hidden), _empty(hidden)
    rstd = _empty(tokens, dtype=torch.float32)
    gate = _empty(tokens, 4 * hidden)
    rows = tokens * top_k
    row_choice = _empty(rows, dtype=torch.int64)
    choice_rows = _empty(tokens, top_k, dtype=torch.int64)
    probs = _empty(tokens, top_k)
    permuted = _empty(rows, hidden)
    return [
        lambda: TN.rms_norm(x, w, 1e-5),
        lambda: TN.rms_norm_backward(x, x, w, rstd, x),
        lambda: TN.swiglu(gate, gate, [tokens]),
        lambda: TN.swiglu_backward(gate, gate, gate, [tokens]),
        lambda: TP.permute(x, row_choice, top_k),
        lambda: TP.sum_choices(permuted, probs, choice_rows),
        lambda: TP.unpermute_backward(x, permuted, probs, row_choice, choice_rows),
    ]


def cases(tokens: int = TOKENS, hidden: tuple[int, ...] = HIDDEN,
          experts: tuple[int, ...] = EXPERTS, top_k: tuple[int, ...] = TOP_K,
          ) -> list[tuple[str, Callable[[], object]]]:
    """(shape label, launch) for every kernel at every shape asked for."""
    out: list[tuple[str, Callable[[], object]]] = []
    for h in hidden:
        out += [(f"t={tokens} h={h} k={max(top_k)}", call)
                for call in hidden_launches(tokens, h, max(top_k))]
    for e in experts:
        for k in top_k:
            for mode, (sigmoid, renormalize) in ROUTER_MODES.items():
                label = f"t={tokens} E={e} k={k} {mode} bf16"
                out += [(label, call)
                        for call in router_launches(tokens, e, k, sigmoid, renormalize)]
        out += [(f"t={tokens} E={e} k={max(top_k)}", call)
                for call in rows_launches(tokens, e, max(top_k))]
    return out


def compile_all(arch: int, shapes: list[tuple[str, Callable[[], object]]]) -> list[Row]:
    """Each launch compiled for ``sm_<arch>`` and recorded (one kernel per call)."""
    rows: list[Row] = []
    with compiling_for(arch) as launches:
        for label, call in shapes:
            before = len(launches)
            call()
            if len(launches) != before + 1:
                raise RuntimeError(f"{label}: {len(launches) - before} launches, not one")
            rows.append(Row(label, launches[-1]))
    return rows


def table(arch: int, rows: list[Row]) -> str:
    lines = [f"sm_{arch}: kernel | shape | grid | registers | stack bytes (spills)"]
    for row in rows:
        launch = row.launch
        lines.append(f"{launch.kernel:27s} {row.shape:35s} {str(launch.grid[:2]):12s} "
                     f"{launch.registers:4d} {launch.stack_bytes:6d} ({launch.spills})")
    spilling = [f"{r.launch.kernel} {r.shape}" for r in rows if r.launch.stack_bytes]
    lines.append(f"spilling: {', '.join(spilling) if spilling else 'none'}; most registers "
                 f"{max(r.launch.registers for r in rows)}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90], choices=[90, 100])
    parser.add_argument("--tokens", type=int, default=TOKENS)
    args = parser.parse_args()
    for arch in args.arch:
        print(table(arch, compile_all(arch, cases(args.tokens))))


if __name__ == "__main__":
    main()
