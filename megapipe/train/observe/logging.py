"""Rank 0's training log: one line per ``--log-interval``, optional TensorBoard, NaN guard.

A line reads::

    iter 20/150 | loss 2.8131 | aux 0.0101 | lr 2.97e-03 | grad norm 0.812 | 5,120 tok/s |
    step 0.40 s | a2a hidden 92 ms, exposed 310 ms | act mem n/a

Values are averages over the iterations since the last line (tokens/s over their total time).
``a2a hidden / exposed``: what the overlap bought: per step and rank, the milliseconds of
all-to-all that ran beside compute and those that ran with no compute beside them, when the
executor measures them (a combined schedule; ``n/a`` otherwise). ``hidden_total`` sums the
hidden seconds for the run's last line. A NaN or infinite loss raises ``NonFiniteLossError``
naming the iteration, on every rank that sees it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

VALUE_KEYS = (
    "loss",
    "aux_loss",
    "lr",
    "grad_norm",
    "step_time",
    "tokens",
    "a2a_hidden",
    "a2a_exposed",
    "act_mem",
)


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite."""


def check_finite_loss(loss: float, iteration: int) -> None:
    """Raise NonFiniteLossError naming ``iteration`` if ``loss`` is NaN or inf."""
    if not math.isfinite(loss):
        raise NonFiniteLossError(
            f"loss is {loss} at iteration {iteration}; stopping (lower --lr, raise "
            "--lr-warmup-iters, or set --clip-grad)"
        )


def _open_tensorboard(directory: str | None) -> Any:
    if directory is None:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=directory)


@dataclass
class TrainingLogger:
    """Accumulates per-iteration values and prints a line every ``log_interval`` iterations."""

    train_iters: int
    log_interval: int
    enabled: bool = True
    tensorboard_dir: str | None = None
    write: Callable[[str], None] = print
    _sums: dict[str, float] = field(default_factory=dict)
    _counts: dict[str, int] = field(default_factory=dict)
    _writer: Any = None
    tensorboard_missing: bool = False
    hidden_total: float = 0.0  # seconds of all-to-all hidden, summed over the run
    exposed_total: float = 0.0

    def __post_init__(self) -> None:
        if self.enabled and self.tensorboard_dir is not None:
            self._writer = _open_tensorboard(self.tensorboard_dir)
            if self._writer is None:
                self.tensorboard_missing = True
                self.write(
                    f"note: --tensorboard-dir {self.tensorboard_dir} ignored: "
                    "torch.utils.tensorboard needs the 'tensorboard' package"
                )

    def record(self, iteration: int, **values: float | None) -> str | None:
        """Add iteration ``iteration``'s values (1-based); returns the line if one was printed."""
        check_finite_loss(float(values.get("loss", 0.0) or 0.0), iteration)
        for key, value in values.items():
            if key not in VALUE_KEYS:
                raise KeyError(f"unknown log value {key!r}; known: {', '.join(VALUE_KEYS)}")
            if value is None:
                continue
            if key == "a2a_hidden":
                self.hidden_total += float(value)
            elif key == "a2a_exposed":
                self.exposed_total += float(value)
            self._sums[key] = self._sums.get(key, 0.0) + float(value)
            self._counts[key] = self._counts.get(key, 0) + 1
        if self._writer is not None:
            for key, value in values.items():
                if value is not None:
                    self._writer.add_scalar(f"train/{key}", float(value), iteration)
        if iteration % self.log_interval != 0 and iteration != self.train_iters:
            return None
        line = self._format(iteration)
        self._sums.clear()
        self._counts.clear()
        if self.enabled:
            self.write(line)
        return line

    def _mean(self, key: str) -> float | None:
        if not self._counts.get(key):
            return None
        return self._sums[key] / self._counts[key]

    def _format(self, iteration: int) -> str:
        parts = [f"iter {iteration}/{self.train_iters}"]
        for key, label, fmt in (
            ("loss", "loss", "{:.4f}"),
            ("aux_loss", "aux", "{:.4f}"),
            ("lr", "lr", "{:.2e}"),
            ("grad_norm", "grad norm", "{:.3f}"),
        ):
            mean = self._mean(key)
            parts.append(f"{label} {'n/a' if mean is None else fmt.format(mean)}")
        time_total = self._sums.get("step_time", 0.0)
        tokens = self._sums.get("tokens", 0.0)
        parts.append(f"{tokens / time_total:,.0f} tok/s" if time_total > 0 else "n/a tok/s")
        step = self._mean("step_time")
        parts.append(f"step {step:.3f} s" if step is not None else "step n/a")
        hidden, exposed = self._mean("a2a_hidden"), self._mean("a2a_exposed")
        parts.append(
            "a2a n/a"
            if hidden is None or exposed is None
            else f"a2a hidden {hidden * 1e3:,.0f} ms, exposed {exposed * 1e3:,.0f} ms"
        )
        act_mem = self._mean("act_mem")  # the largest rank's activation peak, mean over steps
        parts.append(f"act mem {'n/a' if act_mem is None else f'{act_mem / 2**20:.2f} MiB'}")
        return " | ".join(parts)

    def evaluation(self, iteration: int, loss: float, bits_per_byte: float | None = None) -> str:
        """Print (and return) the validation line after an evaluation at ``iteration``: the
        mean loss per token, its perplexity, and the bits per byte of text (None: not known
        for this tokenizer)."""
        line = (
            f"validation at iter {iteration} | loss {loss:.4f} per token | ppl "
            f"{math.exp(min(loss, 50.0)):.2f} | "
            + (
                "bits per byte n/a"
                if bits_per_byte is None
                else f"{bits_per_byte:.4f} bits per byte"
            )
        )
        if self._writer is not None:
            self._writer.add_scalar("valid/loss", loss, iteration)
            if bits_per_byte is not None:
                self._writer.add_scalar("valid/bits_per_byte", bits_per_byte, iteration)
        if self.enabled:
            self.write(line)
        return line

    def overlap_summary(self) -> str | None:
        """What the overlap bought over the run (None when nothing was measured)."""
        total = self.hidden_total + self.exposed_total
        if total <= 0:
            return None
        return (
            f"the overlap hid {self.hidden_total:,.2f} s of {total:,.2f} s of all-to-all "
            f"per rank ({self.hidden_total / total:.0%})"
        )

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
