"""The robustness suite: bad input, damaged checkpoints, other models, wrong paths.

Each case asserts the exit code, exactly one line on stderr that names the offending value, no
traceback, and that every checkpoint already saved is byte-for-byte still there. Pretrain cases
call ``megapipe.train.main.main`` in this process with the launch of the ranks replaced by a
recorder: a bad input must be refused before any process starts (the recorder fails the case if
it is reached), a good one must reach it with the right resume choice. One real checkpoint
(2 iterations of the tiny model, 4 ranks, ``--save-interval 1``) is written once for the module.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch import nn

import megapipe.train.main as pretrain
from megapipe.cli import main as cli_main
from megapipe.train.checkpoint.files import DESCRIPTOR_FILE, LATEST_FILE
from megapipe.train.config.parse import parse_pretrain_args
from megapipe.train.loop import train
from support.pretrain_flags import TINY as SHARED_TINY

TINY = SHARED_TINY + ["--eval-interval", "0", "--train-iters", "4"]


def _train(argv):
    return train(parse_pretrain_args(argv, env={}), write=lambda line: None)


@pytest.fixture(scope="module")
def saved(rank_pools, tmp_path_factory) -> Path:
    """A real save folder with iterations 1 and 2 (read-only for the cases: they copy it)."""
    root = tmp_path_factory.mktemp("saved") / "ckpt"
    rank_pools(4).run(_train, TINY + ["--train-iters", "2", "--save", str(root),
                                      "--save-interval", "1"])
    return root


@dataclass
class World:
    """The files one case works on: copies of the saved checkpoints, and scratch paths."""

    root: Path
    saved: Path
    launched: list = field(default_factory=list)

    def copy(self, name: str = "ckpt", only: int | None = None) -> Path:
        """A copy of the saved folder (``only``: just that iteration, the marker pointing to it)."""
        target = self.root / name
        if only is None:
            shutil.copytree(self.saved, target)
        else:
            shutil.copytree(self.saved / f"iter_{only:07d}", target / f"iter_{only:07d}")
            (target / LATEST_FILE).write_text(f"{only}\n")
        return target

    def snapshot(self) -> dict[str, str]:
        """Every file under the case's folder and its SHA-256 (what must not be lost)."""
        return {str(p.relative_to(self.root)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(self.root.rglob("*")) if p.is_file()}


def _shard(folder: Path, iteration: int) -> Path:
    return sorted((folder / f"iter_{iteration:07d}").glob("*.distcp"))[0]


def _edit_descriptor(folder: Path, change: Callable[[dict], object]) -> None:
    path = folder / "iter_0000002" / DESCRIPTOR_FILE
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _fifo(w: World) -> str:
    path = w.root / "fifo"
    os.mkfifo(path)
    return str(path)


def _hidden_only(w: World) -> str:
    (w.root / "d").mkdir()
    (w.root / "d" / ".secret").write_text("x" * 1000)
    return str(w.root / "d")


def _damaged_only_checkpoint(damage: Callable[[Path], None]) -> Callable[[World], list[str]]:
    def setup(w: World) -> list[str]:
        ckpt = w.copy(only=2)
        damage(ckpt)
        return ["--load", str(ckpt)]
    return setup


def _descriptor_case(change: Callable[[dict], object]) -> Callable[[World], list[str]]:
    def setup(w: World) -> list[str]:
        ckpt = w.copy(only=2)
        _edit_descriptor(ckpt, change)
        return ["--load", str(ckpt)]
    return setup


def _model_change(flag: str, value: str) -> Callable[[World], list[str]]:
    def setup(w: World) -> list[str]:
        return ["--load", str(w.copy()), "--save", str(w.root / "ckpt"), flag, value]
    return setup


def _tracker(text: str, folders: bool = True) -> Callable[[World], list[str]]:
    """Megatron's tracker file holding ``text``, beside the saved checkpoints or alone."""
    def setup(w: World) -> list[str]:
        ckpt = w.copy() if folders else w.root / "ckpt"
        ckpt.mkdir(exist_ok=True)
        (ckpt / LATEST_FILE).write_text(text + "\n")
        return ["--load", str(ckpt)]
    return setup


def _tokenizer_file(w: World) -> str:
    """A small Hugging Face tokenizer.json (a byte-level BPE without merges)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(
        pre_tokenizers.ByteLevel.alphabet())}, merges=[]))
    tokenizer.save(str(w.root / "tokenizer.json"))
    return str(w.root / "tokenizer.json")


def _prefix(w: World, idx: bool = True, bin_: bool = True) -> str:
    """An indexed dataset's prefix with its .idx (Megatron's magic bytes) and/or its .bin."""
    from megapipe.data.blend import INDEX_MAGIC

    prefix = w.root / "OUT" / "name_text_document"
    prefix.parent.mkdir(exist_ok=True)
    if idx:
        prefix.with_suffix(".idx").write_bytes(INDEX_MAGIC)
    if bin_:
        prefix.with_suffix(".bin").write_bytes(b"\0" * 8)
    return str(prefix)


def _hf_weights(model, path: Path) -> None:
    """TINY's model (its seeded initial weights) as Hugging Face tensors in ``path``."""
    from safetensors.torch import save_file

    from megapipe.hf.export_config import export_architecture
    from megapipe.hf.tensors import tensor_sources
    from megapipe.models.split import build_stage

    state = build_stage(model, 0, 1).state_dict()
    tensors = {}
    for item in tensor_sources(model, export_architecture(model)):
        name, _, expert = item.source.removeprefix("model/").partition("/expert")
        tensors[item.name] = item.make(state[name][int(expert)] if expert else state[name])
    save_file(tensors, str(path))


def _hf_dir(weights: bool | None = True, index: str | None = None,
            flags: tuple[str, ...] = (), **edits) -> Callable[[World], list[str]]:
    """``--load-hf`` of a directory whose config.json describes TINY's model, edited; its
    weights: TINY's (True), an empty file (None) or none (False); ``index``: the text of a
    ``model.safetensors.index.json`` beside it; ``flags``: more model flags given (the others
    are config.json's)."""
    def setup(w: World) -> list[str]:
        from megapipe.hf.export_config import hf_config

        folder = w.root / "hf"
        folder.mkdir()
        model = parse_pretrain_args(TINY, env={}).model
        (folder / "config.json").write_text(json.dumps(dict(hf_config(model, torch.float32),
                                                            **edits)))
        if weights:
            _hf_weights(model, folder / "model.safetensors")
        elif weights is None:
            (folder / "model.safetensors").write_bytes(b"")
        if index is not None:
            (folder / "model.safetensors.index.json").write_text(index)
        return ["--load-hf", str(folder), *flags]
    return setup


def _truncate(ckpt: Path) -> None:
    shard = _shard(ckpt, 2)
    shard.write_bytes(shard.read_bytes()[:100])


def _same_size_noise(ckpt: Path) -> None:
    shard = _shard(ckpt, 2)
    shard.write_bytes(os.urandom(shard.stat().st_size))


# (id, setup(world) -> extra argv, words the one line must contain)
PRETRAIN_ERRORS: list[tuple[str, Callable[[World], list[str]], list[str]]] = [
    ("data-empty-dir", lambda w: (w.root / "e").mkdir() or ["--data-path", str(w.root / "e")],
     ["--data-path", "holds no files"]),
    ("data-4-byte-file", lambda w: (w.root / "f").write_text("abcd") and
     ["--data-path", str(w.root / "f")], ["holds 4 bytes", "--seq-length + 1 = 33"]),
    ("data-fifo", lambda w: ["--data-path", _fifo(w)], ["fifo", "neither a regular file"]),
    ("data-missing", lambda w: ["--data-path", str(w.root / "nope")], ["nope", "does not exist"]),
    ("data-hidden-only", lambda w: ["--data-path", _hidden_only(w)], ["holds no files"]),
    ("save-is-file", lambda w: (w.root / "f").write_text("x") and ["--save", str(w.root / "f")],
     ["--save", "is a file, not a directory"]),
    ("save-under-file", lambda w: (w.root / "f").write_text("x") and
     ["--save", str(w.root / "f" / "sub")], ["lies under", "which is a file"]),
    ("save-holds-checkpoints", lambda w: ["--save", str(w.copy())],
     ["already holds checkpoints (newest: iteration 2)", "--load"]),
    ("save-holds-checkpoints-other-load", lambda w: ["--save", str(w.copy()), "--load",
                                                     str(w.copy("other", only=1))],
     ["already holds checkpoints"]),
    ("load-is-file", lambda w: (w.root / "f").write_text("x") and ["--load", str(w.root / "f")],
     ["--load", "is a file, not a directory"]),
    ("load-missing", lambda w: ["--load", str(w.root / "gone")], ["gone", "does not exist"]),
    ("descriptor-missing-field", _descriptor_case(lambda d: d.pop("model")),
     [DESCRIPTOR_FILE, "lacks the field(s) model", "no complete checkpoint"]),
    ("descriptor-unknown-field", _descriptor_case(lambda d: d.update(colour="red")),
     [DESCRIPTOR_FILE, "unknown field(s) colour"]),
    ("descriptor-invalid-json", _damaged_only_checkpoint(
        lambda c: (c / "iter_0000002" / DESCRIPTOR_FILE).write_text("{oops")),
     [DESCRIPTOR_FILE, "is not valid JSON"]),
    ("descriptor-not-object", _damaged_only_checkpoint(
        lambda c: (c / "iter_0000002" / DESCRIPTOR_FILE).write_text("[]")),
     ["not a JSON object"]),
    ("descriptor-deleted", _damaged_only_checkpoint(
        lambda c: (c / "iter_0000002" / DESCRIPTOR_FILE).unlink()), [DESCRIPTOR_FILE, "missing"]),
    ("descriptor-old-format", _descriptor_case(lambda d: d.update(format=1)),
     ["has format 1; this megapipe reads format 2"]),
    ("descriptor-wrong-iteration", _descriptor_case(lambda d: d.update(iteration=7)),
     ["its descriptor says iteration 7"]),
    ("shard-truncated", _damaged_only_checkpoint(_truncate), [".distcp has 100 bytes"]),
    ("metadata-missing", _damaged_only_checkpoint(
        lambda c: (c / "iter_0000002" / ".metadata").unlink()), [".metadata is missing"]),
    ("shard-random-bytes", _damaged_only_checkpoint(_same_size_noise),
     [".distcp does not match its checksum"]),
    ("shard-missing", _damaged_only_checkpoint(lambda c: _shard(c, 2).unlink()),
     [".distcp is missing"]),
    ("seq-length-changed", _model_change("--seq-length", "64"),
     ["--seq-length=32", "--seq-length=64"]),
    ("seed-changed", _model_change("--seed", "7"), ["--seed=1234", "--seed=7"]),
    ("num-layers-changed", _model_change("--num-layers", "4"),
     ["--num-layers=2", "--num-layers=4"]),
    ("hidden-size-changed", _model_change("--hidden-size", "64"),
     ["--hidden-size=32", "--hidden-size=64"]),
    ("heads-changed", _model_change("--num-attention-heads", "4"),
     ["--num-attention-heads=2", "--num-attention-heads=4"]),
    ("ffn-changed", _model_change("--ffn-hidden-size", "128"), ["--ffn-hidden-size=64"]),
    ("experts-changed", _model_change("--num-experts", "8"),
     ["--num-experts=4", "--num-experts=8"]),
    ("expert-width-changed", _model_change("--moe-ffn-hidden-size", "64"),
     ["--moe-ffn-hidden-size=32", "--moe-ffn-hidden-size=64"]),
    ("moe-layer-freq-changed", _model_change("--moe-layer-freq", "2"),
     ["--moe-layer-freq=1", "--moe-layer-freq=2"]),
    ("rope-changed", _model_change("--position-embedding-type", "learned_absolute"),
     ["--position-embedding-type='rope'", "--position-embedding-type='learned_absolute'"]),
    ("query-groups-changed", lambda w: _model_change("--num-query-groups", "1")(w)
     + ["--group-query-attention"], ["--num-query-groups=2", "--num-query-groups=1"]),
    ("tracker-not-a-number", _tracker("latest!"),
     [LATEST_FILE, "holds 'latest!', not an iteration number"]),
    ("tracker-names-a-missing-iteration", _tracker("7"),
     [LATEST_FILE, "names iteration 7, whose folder iter_0000007 is not there",
      "iterations 2, 1"]),
    ("tracker-alone-names-an-iteration", _tracker("3", folders=False),
     [LATEST_FILE, "names iteration 3", "it holds none"]),
    ("query-groups-not-dividing", lambda w: ["--group-query-attention", "--num-query-groups",
                                            "3", "--num-attention-heads", "4"],
     ["--num-query-groups=3 must divide --num-attention-heads=4"]),
    ("layer-norm", lambda w: ["--normalization", "LayerNorm"],
     ["--normalization=LayerNorm", "LayerNorm (Megatron's default) is not implemented"]),
    ("gelu", lambda w: ["--no-swiglu"], ["--no-swiglu", "GeLU"]),
    ("biases", lambda w: ["--no-disable-bias-linear"], ["--no-disable-bias-linear", "biases"]),
    ("hf-tokenizer-on-raw-text", lambda w: ["--tokenizer-type", "HuggingFaceTokenizer",
                                           "--tokenizer-model", _tokenizer_file(w)],
     ["--tokenizer-type HuggingFaceTokenizer reads Megatron's indexed datasets"]),
    ("split-on-raw-text", lambda w: ["--split", "98,2,0"], ["--split 98,2,0 needs indexed"]),
    ("indexed-idx-missing", lambda w: ["--data-path", _prefix(w, idx=False)],
     ["name_text_document.idx does not exist"]),
    ("indexed-bin-missing", lambda w: ["--data-path", _prefix(w, bin_=False)],
     ["name_text_document.idx has no", "name_text_document.bin beside it"]),
    ("indexed-named-by-its-bin", lambda w: ["--data-path", _prefix(w) + ".bin"],
     ["name the prefix without .bin"]),
    ("indexed-weight-not-a-number", lambda w: ["--data-path", "0.7", _prefix(w), "x", _prefix(w)],
     ["weight 'x' is not a number"]),
    ("indexed-weights-odd", lambda w: ["--data-path", "0.7", _prefix(w), "0.3"],
     ["weights and prefixes must alternate", "got 3 values"]),
    ("indexed-weight-negative", lambda w: ["--data-path", "-1", _prefix(w)],
     ["weight -1 must be a finite number > 0"]),
    ("indexed-mixed-with-text", lambda w: (w.root / "t.txt").write_text("x" * 99) and
     ["--data-path", _prefix(w), str(w.root / "t.txt")], ["mixes raw text", "t.txt"]),
    ("indexed-without-tokenizer-type", lambda w: ["--data-path", _prefix(w)],
     ["indexed datasets needs --tokenizer-type"]),
    ("load-hf-missing", lambda w: ["--load-hf", str(w.root / "nohf")],
     ["--load-hf", "nohf is not a directory"]),
    ("load-hf-without-config", lambda w: (w.root / "hf").mkdir() or
     ["--load-hf", str(w.root / "hf")], ["--load-hf", "no config.json"]),
    ("load-hf-without-weights", _hf_dir(weights=False),
     ["--load-hf", "no model.safetensors or its index"]),
    ("load-hf-bad-index", _hf_dir(weights=False, index="{oops"),
     ["model.safetensors.index.json is not an index of weight files"]),
    ("load-hf-other-width", _hf_dir(hidden_size=64),
     ["its config.json has --hidden-size=64 but this run has --hidden-size=32"]),
    ("load-hf-other-top-k", _hf_dir(num_experts_per_tok=1, flags=("--moe-router-topk", "2")),
     ["--moe-router-topk=1", "--moe-router-topk=2"]),
    ("load-hf-renormalised-router", _hf_dir(norm_topk_prob=True,
                                            flags=("--moe-router-pre-softmax",)),
     ["--moe-router-pre-softmax=False but this run has --moe-router-pre-softmax=True"]),
    ("load-hf-empty-weights", _hf_dir(weights=None),
     ["--load-hf", "model.safetensors is not a safetensors file"]),
    ("load-hf-vocabulary-too-small", _hf_dir(vocab_size=128),
     ["the tokenizer has 256 tokens, more than its model's vocabulary of 128"]),
    ("load-hf-other-architecture", _hf_dir(model_type="deepseek_v3"),
     ['model_type="deepseek_v3"', "qwen3_moe (Qwen3MoeForCausalLM), mixtral"]),
    ("load-hf-sliding-window", _hf_dir(use_sliding_window=True, sliding_window=8),
     ["config.json use_sliding_window=true has no equivalent in megapipe's GPT"]),
    ("shared-expert-added", _model_change("--moe-shared-expert-intermediate-size", "16"),
     ["--moe-shared-expert-intermediate-size=None", "=16"]),
    ("keep-last-zero", lambda w: ["--save", str(w.root / "new"), "--keep-last", "0"],
     ["--keep-last=0 must be >= 1"]),
    ("keep-last-without-save", lambda w: ["--keep-last", "2"], ["--keep-last needs --save"]),
    ("exit-interval-zero", lambda w: ["--exit-interval", "0"], ["--exit-interval=0 must be >= 1"]),
    ("exit-duration-negative", lambda w: ["--exit-duration-in-mins", "-1"],
     ["--exit-duration-in-mins=-1.0 must be > 0"]),
    ("timeout-zero", lambda w: ["--distributed-timeout-minutes", "0"],
     ["--distributed-timeout-minutes=0.0 must be > 0"]),
    ("lr-nan", lambda w: ["--lr", "nan"], ["--lr=nan must be a finite number"]),
    ("link-gbps-zero", lambda w: ["--moe-emulated-link-gbps", "0"],
     ["--moe-emulated-link-gbps=0 must be > 0"]),
    ("int-flag-not-a-number", lambda w: ["--num-layers", "abc"],
     ["argument --num-layers: invalid int value: 'abc'"]),
    ("unknown-flag", lambda w: ["--bogus"], ["unrecognized arguments: --bogus"]),
    ("flag-without-value", lambda w: ["--seq-length"], ["argument --seq-length: expected one"]),
    ("nproc-zero", lambda w: ["--nproc", "0"], ["--nproc=0 must be >= 1"]),
]


@pytest.fixture
def world(saved, tmp_path, monkeypatch) -> World:
    w = World(tmp_path, saved)

    def launch(start, forward_sigterm, say):  # stands in for starting the ranks
        w.launched.append(start)
        return 0

    monkeypatch.setattr(pretrain, "run_local", launch)
    plans = []
    real_plan = pretrain.choose_resume
    monkeypatch.setattr(pretrain, "choose_resume", lambda args: plans.append(real_plan(args))
                        or plans[-1])
    w.plans = plans
    return w


def _one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("name,setup,words", PRETRAIN_ERRORS, ids=[c[0] for c in PRETRAIN_ERRORS])
def test_bad_pretrain_input_is_one_line_before_any_process(world, capsys, name, setup, words):
    argv = TINY + setup(world)
    before = world.snapshot()
    code = pretrain.main(argv)
    line = _one_line(capsys.readouterr().err)
    assert code == 2 and not world.launched, line
    assert line.startswith("megapipe pretrain: error: "), line
    for word in words:
        assert word in line, (word, line)
    assert world.snapshot() == before  # nothing saved was lost or changed


def test_damaged_newest_checkpoint_falls_back_with_one_warning(world, capsys):
    ckpt = world.copy()
    _truncate(ckpt)
    before = world.snapshot()
    assert pretrain.main(TINY + ["--load", str(ckpt), "--save", str(ckpt)]) == 0
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("megapipe pretrain: warning: skipping damaged checkpoint")
    assert "iter_0000002" in line and "resuming from iteration 1" in line
    assert world.launched and world.plans[-1].checkpoint.iteration == 1
    assert world.snapshot() == before


def test_a_marker_naming_an_older_checkpoint_is_a_warning(world, capsys):
    """A crash between the rename of a new checkpoint and the tracker's update."""
    ckpt = world.copy()
    (ckpt / LATEST_FILE).write_text("1\n")
    assert pretrain.main(TINY + ["--load", str(ckpt)]) == 0
    line = _one_line(capsys.readouterr().err)
    assert "names iteration 1, the newest complete checkpoint is iteration 2" in line
    assert world.plans[-1].checkpoint.iteration == 2


def test_load_equal_to_a_save_folder_not_made_yet_starts_from_scratch(world, capsys):
    """torchrun --max-restarts with --load == --save: the first attempt has nothing to load."""
    folder = str(world.root / "fresh")
    assert pretrain.main(TINY + ["--load", folder, "--save", folder]) == 0
    assert capsys.readouterr().err == ""
    assert world.plans[-1].checkpoint is None and "starting from scratch" in world.plans[-1].note


def test_a_layout_change_is_accepted(world, capsys):
    ckpt = world.copy()
    flags = ["--pipeline-model-parallel-size", "4", "--virtual-pipeline-model-parallel-size", "1",
             "--expert-model-parallel-size", "1", "--pipeline-schedule", "zb1p"]
    assert pretrain.main(TINY + ["--load", str(ckpt), "--save", str(ckpt)] + flags) == 0
    assert capsys.readouterr().err == "" and world.plans[-1].checkpoint.iteration == 2


def test_load_hf_starts_a_run_without_a_checkpoint_and_a_checkpoint_wins(world, capsys):
    """``--load-hf`` is the start when ``--load`` holds nothing (the choice names it), and a
    checkpoint in ``--load`` is resumed instead, with one warning."""
    flags = _hf_dir()(world)
    assert pretrain.main(TINY + flags + ["--load", str(world.root / "empty"),
                                         "--save", str(world.root / "empty")]) == 0
    assert capsys.readouterr().err == ""
    plan = world.plans[-1]
    assert plan.checkpoint is None and plan.hf_dir == flags[1]
    assert plan.note == f"starting from the weights of --load-hf {flags[1]}"
    ckpt = world.copy()
    assert pretrain.main(TINY + flags + ["--load", str(ckpt)]) == 0
    line = _one_line(capsys.readouterr().err)
    assert f"--load-hf {flags[1]} is not read: --load {ckpt} holds a checkpoint (iteration 2)" \
        in line
    assert world.plans[-1].checkpoint.iteration == 2 and world.plans[-1].hf_dir is None


def test_resume_after_fallback_trains_from_the_older_checkpoint(rank_pools, world):
    ckpt = world.copy()
    _same_size_noise(ckpt)
    result = rank_pools(4).run(_train, TINY + ["--load", str(ckpt), "--train-iters", "3"])[0]
    assert result.first_iteration == 1 and len(result.losses) == 2
    assert any("skipping damaged checkpoint" in line for line in result.lines)


@pytest.mark.parametrize("argv,words", [
    (["schedule", "1f1b", "--pp", "2", "-m", "4", "--csv", "{root}"], ["is a directory"]),
    (["schedule", "1f1b", "--pp", "2", "-m", "4", "--trace", "{root}/no/t.json"],
     ["does not exist"]),
    (["schedule", "nope", "--pp", "2", "-m", "4"], ["unknown schedule 'nope'"]),
    (["schedule", "1f1b", "--pp", "2", "-m", "0"], ["--num-microbatches=0 must be >= 1"]),
], ids=["csv-is-directory", "trace-folder-missing", "unknown-schedule", "zero-microbatches"])
def test_bad_schedule_command_is_one_line_before_any_output(tmp_path, capsys, argv, words):
    code = cli_main([a.replace("{root}", str(tmp_path)) for a in argv])
    captured = capsys.readouterr()
    line = _one_line(captured.err)
    assert code == 2 and captured.out == "", captured.out  # nothing printed before the error
    assert line.startswith("megapipe: error: ") and all(w in line for w in words), line


def test_empty_csv_is_refused_naming_the_file(tmp_path):
    from megapipe.schedule.errors import ScheduleError
    from megapipe.schedule.ir import read_csv

    path = tmp_path / "empty.csv"
    path.write_text("")
    with pytest.raises(ScheduleError) as err:
        read_csv(str(path))
    assert str(path) in str(err.value) and "holds no actions" in str(err.value)
    assert "\n" not in str(err.value)


def test_executor_spec_of_the_wrong_type_is_refused_up_front():
    from megapipe.pipeline.executor import PipelineExecutor
    from megapipe.pipeline.executor_options import ExecutorOptions
    from megapipe.schedule import build_schedule

    with pytest.raises(TypeError) as err:
        PipelineExecutor(build_schedule("1f1b", 1, 2), {0: nn.Linear(2, 2)},
                         ExecutorOptions(spec=(2, 12, 32)))
    assert "spec=(2, 12, 32) must be a TensorSpec" in str(err.value)
    assert "\n" not in str(err.value)


def test_the_installed_command_says_one_line_and_exits_2(world, tmp_path):
    """A real process: the console script, a damaged checkpoint, no traceback."""
    ckpt = world.copy(only=2)
    (ckpt / "iter_0000002" / ".metadata").write_bytes(b"\x00" * 7)
    before = world.snapshot()
    done = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "megapipe"), "pretrain", *TINY,
         "--load", str(ckpt)], capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )
    line = _one_line(done.stderr)
    assert done.returncode == 2 and ".metadata has 7 bytes" in line, line
    assert world.snapshot() == before
