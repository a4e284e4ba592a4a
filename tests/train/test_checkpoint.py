"""Checkpoint keys (layout-free), the whole-or-nothing folder, verification, selection, pruning."""

import json

import pytest
import torch
from torch import nn

from megapipe.moe.experts import GroupedExperts
from megapipe.train.checkpoint.files import (
    DESCRIPTOR_FILE,
    FORMAT,
    LATEST_FILE,
    CheckpointError,
    file_digest,
    iteration_dir,
    prepare_temporary,
    prune,
    publish,
    select_checkpoint,
    temporary_dir,
)
from megapipe.train.checkpoint.state import checkpoint_entries, ensure_optimizer_state
from megapipe.train.optim.adamw import build_optimizer


class _Part(nn.Module):
    """A dense weight named with a global layer index, and the experts of one EP rank."""

    def __init__(self, first_expert: int) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({"3": nn.Linear(2, 2)})
        self.experts = GroupedExperts(2, 3, num_local_experts=2, first_expert=first_expert)


def test_keys_name_global_experts_and_follow_their_parameter_into_the_optimizer():
    part = _Part(first_expert=2)  # EP rank 1 of 2: experts 2 and 3
    opt = build_optimizer([part], lr=0.1, weight_decay=0.0)
    ensure_optimizer_state(opt)
    entries = checkpoint_entries({5: part}, opt)
    assert "model/layers.3.weight" in entries and "optim/layers.3.weight/exp_avg" in entries
    for e in (2, 3):
        assert f"model/experts.w_gate/expert{e}" in entries
        assert f"optim/experts.w_gate/expert{e}/exp_avg_sq" in entries
    assert "model/experts.w_gate/expert0" not in entries
    assert "optim/experts.w_gate/step" in entries  # the scalar step once per parameter
    # views share storage: loading into an entry loads into the parameter
    entries["model/experts.w_up/expert3"][0].fill_(7.0)
    assert torch.equal(part.experts.w_up[1], torch.full((2, 3), 7.0))
    assert not any("stage" in key for key in entries)  # no layout in the keys


def test_a_tensor_held_twice_on_a_rank_is_one_key_with_both_copies():
    a, b = _Part(0), _Part(0)  # DualPipe's mirrored stages hold the same model part
    opt = build_optimizer([a, b], lr=0.1, weight_decay=0.0)
    entries = checkpoint_entries({0: a, 3: b}, opt)
    assert len(entries["model/layers.3.bias"]) == 2


def _fake_checkpoint(save, iteration, body=b"shard"):
    tmp = prepare_temporary(save, iteration)
    (tmp / ".metadata").write_bytes(b"meta")
    (tmp / "__0_0.distcp").write_bytes(body)
    files = {name: file_digest(tmp / name) for name in (".metadata", "__0_0.distcp")}
    descriptor = {"format": FORMAT, "iteration": iteration, "model": {}, "parallel": {},
                  "info": {}, "files": files}
    return publish(save, iteration, descriptor)


def test_publish_renames_a_sealed_folder_then_moves_the_marker(tmp_path):
    path = _fake_checkpoint(tmp_path, 5)
    assert path == iteration_dir(tmp_path, 5) and not temporary_dir(tmp_path, 5).exists()
    assert (tmp_path / LATEST_FILE).read_text() == "5\n"
    assert select_checkpoint(tmp_path).chosen.iteration == 5


@pytest.mark.parametrize("damage,problem", [
    (lambda d: (d / "__0_0.distcp").write_bytes(b"shar"), "has 4 bytes, the manifest says 5"),
    (lambda d: (d / "__0_0.distcp").write_bytes(b"SHARD"), "does not match its checksum"),
    (lambda d: (d / ".metadata").unlink(), ".metadata is missing"),
    (lambda d: (d / DESCRIPTOR_FILE).write_text("{"), "is not valid JSON"),
    (lambda d: (d / DESCRIPTOR_FILE).write_text("[1]"), "holds a list, not a JSON object"),
    (lambda d: (d / DESCRIPTOR_FILE).write_text('{"format": 2}'), "lacks the field(s) iteration"),
])
def test_a_damaged_newest_checkpoint_falls_back_naming_it(tmp_path, damage, problem):
    _fake_checkpoint(tmp_path, 2)
    newest = _fake_checkpoint(tmp_path, 4)
    damage(newest)
    selection = select_checkpoint(tmp_path)
    assert selection.chosen.iteration == 2
    [(path, why)] = selection.damaged
    assert path == newest and problem in why
    [warning] = selection.warnings()
    assert "iter_0000004" in warning and "resuming from iteration 2" in warning


def test_marker_is_a_hint_the_folders_decide(tmp_path):
    _fake_checkpoint(tmp_path, 2)
    _fake_checkpoint(tmp_path, 4)
    (tmp_path / LATEST_FILE).write_text("2\n")  # a crash between the rename and the marker
    selection = select_checkpoint(tmp_path)
    assert selection.chosen.iteration == 4
    assert "names iteration 2" in selection.warnings()[0]
    (tmp_path / LATEST_FILE).write_text("garbage")
    assert "holds 'garbage', not an iteration" in select_checkpoint(tmp_path).warnings()[0]


def test_a_half_written_save_is_never_chosen(tmp_path):
    _fake_checkpoint(tmp_path, 2)
    tmp = prepare_temporary(tmp_path, 4)  # a save that crashed before publishing
    (tmp / "__0_0.distcp").write_bytes(b"partial")
    assert select_checkpoint(tmp_path).chosen.iteration == 2
    assert select_checkpoint(tmp_path).damaged == []


def test_prune_keeps_the_newest_complete_and_every_damaged_one(tmp_path):
    for it in (1, 2, 3, 4, 5):
        _fake_checkpoint(tmp_path, it)
    (iteration_dir(tmp_path, 2) / DESCRIPTOR_FILE).write_text("{")
    # iteration 5 is newer than the save (a damaged one the run fell back from): not counted
    (iteration_dir(tmp_path, 5) / "__0_0.distcp").write_bytes(b"x")
    deleted = prune(tmp_path, keep_last=2, newest=4)
    assert [p.name for p in deleted] == ["iter_0000001"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "iter_0000002", "iter_0000003", "iter_0000004", "iter_0000005"]


def test_a_folder_of_the_same_iteration_is_kept_aside_not_overwritten(tmp_path):
    old = _fake_checkpoint(tmp_path, 3, body=b"first")
    (old / "__0_0.distcp").write_bytes(b"rotten")  # damaged: the run fell back before it
    _fake_checkpoint(tmp_path, 3, body=b"second")
    assert (tmp_path / "iter_0000003.replaced-1" / "__0_0.distcp").read_bytes() == b"rotten"
    assert select_checkpoint(tmp_path).chosen.iteration == 3


def test_descriptor_of_another_format_is_refused_by_name(tmp_path):
    path = _fake_checkpoint(tmp_path, 1)
    data = json.loads((path / DESCRIPTOR_FILE).read_text())
    data["format"] = 1
    (path / DESCRIPTOR_FILE).write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="has format 1; this megapipe reads format 2"):
        from megapipe.train.checkpoint.files import check_complete
        check_complete(path)
