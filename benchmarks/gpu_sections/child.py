"""One section in its own process: ``python -m gpu_sections.child NAME --result PATH ...``.

It builds the section's ``Context`` (device, sizes mode, folders, its own deadline), runs
``gpu_sections.sec_NAME.run(ctx, result)`` and leaves the result JSON at ``--result`` (written
as the section goes). An exception fails the section with its traceback (also in the log).
Outside a dry run a section that needs CUDA is skipped whole when there is none.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_sections.registry import SECTIONS
from gpu_sections.result import FAILED, SectionResult

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Context:
    """Where and how a section runs. ``device`` is the GPU, or the CPU in a dry run (the
    runner hides the GPU then) and without one."""

    name: str
    dry_run: bool
    out: Path
    scratch: Path
    deadline: float  # time.monotonic() by which the section should have stopped
    device: Any  # torch.device
    repo: Path = REPO

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def no_gpu(self) -> str:
        """Why the GPU-only parts are skipped."""
        if self.dry_run:
            return "dry run on CPU (needs CUDA)"
        return "no CUDA device (torch.cuda.is_available() is False)"

    def gpu_or_skip(self, result: SectionResult, part: str) -> bool:
        """True on a GPU; otherwise records ``part`` as skipped and returns False."""
        if not self.cuda:
            result.skip(part, self.no_gpu)
        return self.cuda

    def enough_time(self, result: SectionResult, part: str, needed_s: float) -> bool:
        """True when ``needed_s`` seconds are left; otherwise records ``part`` as skipped."""
        left = self.time_left()
        if left < needed_s:
            result.skip(part, f"the section's time limit: {left:.0f} s left, about "
                              f"{needed_s:.0f} s needed")
            return False
        return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=[s.name for s in SECTIONS])
    parser.add_argument("--result", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--scratch", required=True)
    parser.add_argument("--time-limit", type=float, required=True)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.time_limit
    result = SectionResult(args.name, args.result)
    spec = next(s for s in SECTIONS if s.name == args.name)
    try:
        import torch

        device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
        ctx = Context(args.name, args.dry_run, Path(args.out), Path(args.scratch), deadline, device)
        if spec.needs_cuda and not ctx.cuda and not args.dry_run:
            result.skip_section(f"{ctx.no_gpu}; run with --dry-run for the CPU smoke run")
            return 0
        print(f"[{args.name}] device {device}, {'dry run' if args.dry_run else 'full sizes'}, "
              f"{args.time_limit:.0f} s", flush=True)
        importlib.import_module(spec.module).run(ctx, result)
    except BaseException:  # noqa: BLE001 -- any failure is the section's result
        text = traceback.format_exc()
        print(text, file=sys.stderr, flush=True)
        result.fail(text[-3000:])
    return 1 if result.status == FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
