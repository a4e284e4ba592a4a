"""What a run reads and writes, and when it stops: the data path, checkpoints, validation and
logs (``--help`` group "data, checkpoints, logging"), failures and preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

from megapipe.train.config.declare import COUNT, POSITIVE, above, finite, flag
from megapipe.train.config.flag_checks import indexed_or_text

IO, FAILURES = "data, checkpoints, logging", "failures and preemption"  # their --help groups


@dataclass(frozen=True)
class InputOutputFlags:
    """The data read, the checkpoints saved and loaded, validation, the log."""

    data_path: tuple[str, ...] = flag(
        (),
        "text files or directories (read byte level; default: the Python standard "
        "library's sources), or Megatron's indexed dataset prefixes, optionally weighted "
        "(0.7 A 0.3 B)",
        indexed_or_text,
        group=IO,
        nargs="+",
    )
    save: str | None = flag(None, "checkpoint directory", group=IO)
    load: str | None = flag(None, "resume directory", group=IO)
    load_hf: str | None = flag(
        None,
        "start from the weights of a Hugging Face Qwen3-MoE, Mixtral or OLMoE directory "
        "(as transformers or export-hf writes it): the model flags not given are its "
        "config.json's, those given must agree, the vocabulary is its; once --load holds a "
        "checkpoint, that is resumed instead",
        group=IO,
        metavar="DIR",
    )
    save_interval: int | None = flag(
        None,
        "iterations between saves (a final save always happens with --save)",
        POSITIVE,
        group=IO,
    )
    eval_interval: int = flag(50, "validation every N iterations (0: never)", COUNT, group=IO)
    eval_iters: int = flag(2, "validation batches", COUNT, group=IO)
    log_interval: int = flag(10, "iterations per log line", POSITIVE, group=IO)
    tensorboard_dir: str | None = flag(None, "also write scalars for TensorBoard", group=IO)
    log_activation_memory: bool = flag(
        False,
        "measure the bytes saved for backward or held by the pipeline each step (act mem "
        "column; changes no bit, costs host time per saved tensor)",
        group=IO,
    )


@dataclass(frozen=True)
class FailureFlags:
    """Saving and exiting early; how long a rank waits for another."""

    keep_last: int | None = flag(
        None,
        "keep only the N newest complete checkpoints in --save (default: all)",
        POSITIVE,
        group=FAILURES,
    )
    exit_signal_handler: bool = flag(
        False, "on SIGTERM finish the current step, save a checkpoint, exit 0", group=FAILURES
    )
    exit_interval: int | None = flag(
        None, "save and exit 0 after every N-th iteration", POSITIVE, group=FAILURES
    )
    exit_duration_in_mins: float | None = flag(
        None,
        "save and exit 0 after the first iteration ending past this many minutes",
        above(0),
        finite,
        group=FAILURES,
    )
    distributed_timeout_minutes: float = flag(
        10.0,
        "how long any rank waits for another (pipeline receive, all-to-all, gradient "
        "reduction) before it stops naming what it waited on",
        above(0),
        finite,
        group=FAILURES,
    )
