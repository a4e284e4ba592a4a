"""Flags declared once: a new flag through its declaration alone, and the typed config."""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass, fields

import pytest

from megapipe.train.config.declare import (
    ArgsError,
    at_least,
    build_parser,
    flag,
    one_of,
    parse_flags,
)
from megapipe.train.config.flags import PretrainFlags
from megapipe.train.config.parse import parse_pretrain_args


def _each_module(name: str, modules: tuple[str, ...]) -> str | None:
    bad = [m for m in modules if m not in ("attn", "moe")]
    return f"{name}: {', '.join(bad)} is not a module (attn, moe)" if bad else None


@dataclass(frozen=True)
class WithNewFlags(PretrainFlags):
    """Two flags declared here and nowhere else: an int with a range, a list with its check."""

    rotary_percent_of_heads: int = flag(100, "a flag only this test knows", at_least(1),
                                        group="model")
    graph_modules: tuple[str, ...] = flag((), "modules to capture", _each_module, group="model")
    graph_impl: str = flag("none", "how to capture", one_of("none", "local", "full"), group="model")


def _parse(argv: list[str]) -> WithNewFlags:
    return parse_flags(WithNewFlags, argv, "megapipe pretrain")


def test_a_flag_declared_once_is_parsed_listed_and_checked():
    record = _parse(["--rotary-percent-of-heads", "50", "--graph-modules", "attn", "moe",
                     "--num-layers", "4"])
    assert (record.rotary_percent_of_heads, record.graph_modules, record.num_layers) == (
        50, ("attn", "moe"), 4)
    assert _parse([]).rotary_percent_of_heads == 100 and _parse([]).graph_modules == ()
    text = build_parser(WithNewFlags, "megapipe pretrain", "").format_help()
    assert "--rotary-percent-of-heads" in text and "a flag only this test knows" in text
    assert "--graph-modules [GRAPH_MODULES ...]" in text
    for argv, message in [
        (["--rotary-percent-of-heads", "0"], "--rotary-percent-of-heads=0 must be >= 1"),
        (["--graph-modules", "mlp"], "--graph-modules: mlp is not a module (attn, moe)"),
        (["--graph-impl", "cuda"], "--graph-impl='cuda' must be one of none, local, full"),
        (["--rotary-percent-of-heads", "x"], "argument --rotary-percent-of-heads: invalid int"),
    ]:
        with pytest.raises(ArgsError) as err:
            _parse(argv)
        assert str(err.value).startswith(message) and "\n" not in str(err.value), err.value


def test_a_renamed_flag_is_refused_naming_its_new_name():
    old = "--moe-a2a-chunks"  # RENAMED: it is refused
    for argv in ([old, "2"], [old]):
        with pytest.raises(ArgsError, match=rf"^argument {old}: renamed: use --moe-a2a-waves$"):
            parse_flags(PretrainFlags, argv, "megapipe pretrain")
    assert parse_flags(PretrainFlags, ["--moe-a2a-waves", "2"], "p").moe_a2a_waves == 2
    assert old not in build_parser(PretrainFlags, "p", "").format_help()


def test_every_pretrain_flag_is_in_help_under_its_megatron_name():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parse_flags(PretrainFlags, ["--help"], "megapipe pretrain")
    for f in fields(PretrainFlags):
        assert "--" + f.name.replace("_", "-") in out.getvalue(), f.name
    assert "--no-overlap-moe-expert-parallel-comm" in out.getvalue()


def test_the_typed_config_holds_the_derived_values():
    config = parse_pretrain_args(["--nproc", "8", "--overlap-grad-reduce",
                                  "--train-iters", "40", "--virtual-pipeline-model-parallel-size",
                                  "1", "--global-batch-size", "64"], env={})
    assert (config.parallel.dp, config.parallel.world_size) == (4, 8)
    assert (config.schedule.name, config.schedule.vpp, config.schedule.num_microbatches) == (
        "1f1b", 1, 4)
    assert config.data_parallel.bucket_size == 40_000_000
    assert config.optimizer.decay_end == 40
    assert config.overlap.high_priority_stream_groups == ()
    assert parse_pretrain_args(["--high-priority-stream-groups", "ep_dp", "pp"],
                               env={}).overlap.high_priority_stream_groups == ("expert_dp", "pp")


def test_the_groups_keep_their_order_in_the_record_and_in_help():
    """``PretrainFlags`` lists its group records last to first (a dataclass takes its bases'
    fields in that order): the model's flags first, each group's flags together, --help's
    groups in the order the docs list them."""
    order = ["model", "model architecture", "data and tokenizer", "precision", "training",
             "parallelism", "data parallelism", "activation recompute",
             "data, checkpoints, logging", "failures and preemption", "CUDA graphs", "profiling"]
    groups = [f.metadata["flag"].group for f in fields(PretrainFlags)]
    assert [g for i, g in enumerate(groups) if i == 0 or groups[i - 1] != g] == order
    assert fields(PretrainFlags)[0].name == "num_layers"
    text = build_parser(PretrainFlags, "megapipe pretrain", "").format_help()
    where = [text.index(f"\n{group}:\n") for group in order]
    assert where == sorted(where)
