"""The Megatron-Core adapter's parts that need no process group: release versions and their
differences, the config classification, the deferred-weight-gradient driver, the per-thread
dispatcher switch, DDP and reduction checks."""

from __future__ import annotations

import ast
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megapipe.megatron import mcore_accepted, mcore_config, mcore_feature_options
from megapipe.megatron.mcore_release import (
    SUPPORTED_RELEASES,
    McoreRelease,
    check_version,
    parse_version,
)
from megapipe.megatron.mcore_wgrad import after_backward, check_driven, delayed_modules
from megapipe.overlap.plan import LayerState
from megapipe.overlap.wgrad import WeightGradQueue


# ------------------------------------------------------------------------------ versions
@pytest.mark.parametrize("version", SUPPORTED_RELEASES + ("0.19.2+a1b2c3d", "0.16.1+local.7"))
def test_supported_releases_and_local_suffixes_are_accepted(version):
    assert check_version(version) == parse_version(version)


@pytest.mark.parametrize("version", ["0.15.0", "0.19.1", "0.20.0", "0.19.2rc1", "unknown"])
def test_any_other_version_is_one_clear_error(version):
    with pytest.raises(RuntimeError, match=rf"megatron-core {version} is not supported.*0\.16\.1, "
                                           r"0\.17\.1, 0\.18\.2, 0\.19\.2"):
        check_version(version)


# ------------------------------------------------------------------------------ differences
class _Norm(torch.nn.Module):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.fused = fused

    def forward(self, x):
        return (x * 2, x + 1) if self.fused else x * 2


def _layer(fused: bool, fp32_residual: bool):
    norm = _Norm(fused)
    return SimpleNamespace(
        _forward_pre_mlp_layernorm=norm,
        config=SimpleNamespace(fp32_residual_connection=fp32_residual),
    )


def test_the_pre_mlp_step_follows_each_release():
    """0.17 added the fused norm's (output, residual) and the fp32 residual cast to
    TransformerLayer._forward_mlp; 0.16 passes the norm's output on as it is."""
    hidden = torch.ones(2, 3, dtype=torch.bfloat16)
    out, residual = McoreRelease((0, 17, 1)).pre_mlp(_layer(True, True), hidden)
    assert torch.equal(out, hidden * 2) and torch.equal(residual, (hidden + 1).float())
    assert residual.dtype == torch.float32
    out, residual = McoreRelease((0, 19, 2)).pre_mlp(_layer(False, False), hidden)
    assert residual is hidden and residual.dtype == torch.bfloat16
    out, residual = McoreRelease((0, 16, 1)).pre_mlp(_layer(False, True), hidden)
    assert residual is hidden  # 0.16 casts no residual here


# ------------------------------------------------------------------------------ config fields
def _release_fields(version: str) -> set[str] | None:
    """The TransformerConfig (and MLA) field names of a release, read from its sources."""
    from support.mcore_releases import ReleaseUnavailable, cache_root, installed

    if version == installed():
        import megatron.core

        root = Path(megatron.core.__file__).parent
    else:
        root = cache_root() / version / "megatron" / "core"
        if not root.exists():
            try:
                from support.mcore_releases import release_dir

                release_dir(version)
            except ReleaseUnavailable:
                return None
    names = set()
    for rel in ("transformer/transformer_config.py", "model_parallel_config.py"):
        tree = ast.parse((root / rel).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name in (
                "TransformerConfig", "MLATransformerConfig", "ModelParallelConfig"
            ):
                names |= {s.target.id for s in node.body
                          if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    return names


def test_every_classified_field_exists_in_a_supported_release():
    """No typo in the classification: every name it lists is a field of some release."""
    pytest.importorskip("megatron.core")
    known: set[str] = set()
    for version in SUPPORTED_RELEASES:
        fields = _release_fields(version)
        if fields is None:
            pytest.skip(f"megatron-core {version} is not cached and cannot be fetched")
        known |= fields
    listed = (set(mcore_accepted.MIRRORED) | set(mcore_accepted.SCHEDULE)
              | set(mcore_feature_options.OPTIONS_OF) | set(mcore_config.RULES)
              | set(mcore_config.REASONS))
    assert listed - known == set()
    switches = {f for f in mcore_feature_options.OPTIONS_OF.values() if f not in ("inference",)}
    assert switches - known == set()


def test_the_installed_default_config_is_mirrored_and_a_new_field_is_not():
    pytest.importorskip("megatron.core")
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2)
    assert mcore_config.config_problem(config) is None
    future = dataclasses.make_dataclass(
        "FutureConfig", [("attention_future_trick", bool, dataclasses.field(default=False))],
        bases=(TransformerConfig,), init=False,
    )
    config.__class__ = future
    config.attention_future_trick = True
    with pytest.raises(NotImplementedError,
                       match=r"^TransformerConfig\.attention_future_trick=True is not mirrored"):
        mcore_config.check_config(config)


# ------------------------------------------------------------------------------ backward_dw
def _node(state: LayerState, log: list, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    (x,) = after_backward(state, [("dw", lambda: log.append("dw"))], (x,))
    return (x * weight).sum()


def test_after_backward_runs_the_work_once_the_node_backward_ran():
    x, w = torch.ones(3, requires_grad=True), torch.full((3,), 2.0, requires_grad=True)
    log: list = []
    _node(LayerState(), log, x, w).backward()
    assert log == ["dw"] and torch.equal(x.grad, w.detach())


def test_after_backward_hands_the_work_to_the_queue_when_there_is_one():
    x, w = torch.ones(3, requires_grad=True), torch.full((3,), 2.0, requires_grad=True)
    log: list = []
    state = LayerState()
    loss = _node(state, log, x, w)
    state.wgrad_queue = queue = WeightGradQueue()
    loss.backward()
    assert log == [] and queue.names() == ["dw"]
    queue.run()
    assert log == ["dw"]


def test_after_backward_refuses_a_node_without_any_gradient_path():
    with pytest.raises(RuntimeError, match="no input of their node needs a gradient"):
        after_backward(LayerState(), [("dw", lambda: None)], (torch.ones(2),))


class _Deferring(torch.nn.Linear):
    """Follows TE's contract with deferral on."""

    def __init__(self) -> None:
        super().__init__(2, 2)
        self.wgrad_store = SimpleNamespace(delay_wgrad_compute=lambda: True)

    def backward_dw(self) -> None:
        pass


def test_every_deferring_layer_must_be_driven():
    model = torch.nn.Sequential(
        torch.nn.Sequential(_Deferring(), torch.nn.ReLU()), _Deferring(), torch.nn.Linear(2, 2)
    )
    assert delayed_modules(model) == ["0.0", "1"]
    check_driven(model, [model[0], model[1]])
    with pytest.raises(NotImplementedError, match=r"^delay_wgrad_compute: 1 defer"):
        check_driven(model, [model[0]])


# ------------------------------------------------------------------------------ recompute
def test_the_dispatcher_switch_gives_each_thread_its_own_dispatcher():
    from megapipe.megatron.mcore_recompute import DispatcherSwitch

    original = SimpleNamespace(splits=[1])
    switch = DispatcherSwitch(original)
    mine, theirs = switch.fresh(), switch.fresh()
    seen = {}

    def other_thread() -> None:
        with switch.using(theirs):
            switch.splits = [3]
            seen["other"] = switch.splits

    with switch.using(mine):
        switch.splits = [2]
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        assert switch.splits == [2]
    assert seen["other"] == [3] and theirs.splits == [3] and mine.splits == [2]
    assert switch.splits == [1] and original.splits == [1]  # outside: the layer's own


def test_megatron_recompute_picks_megatrons_layers():
    from megapipe.megatron.mcore_recompute import recompute_mtp, recomputed_layers

    full = SimpleNamespace(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=2)
    assert list(recomputed_layers(full, 3)) == [0, 1, 2] and recompute_mtp(full)
    block = SimpleNamespace(recompute_granularity="full", recompute_method="block",
                            recompute_num_layers=2)
    assert list(recomputed_layers(block, 3)) == [0, 1] and not recompute_mtp(block)
    none = SimpleNamespace(recompute_granularity="selective")
    assert list(recomputed_layers(none, 3)) == []


# ------------------------------------------------------------------------------ support
def test_other_modules_pass_through_unwrapped():
    from megapipe.megatron.mcore_adapter import as_stage_module
    from megapipe.megatron.mcore_support import find_gpt_model

    module = torch.nn.Linear(2, 2)
    assert as_stage_module(module) is module and find_gpt_model(module) is None


def test_megatron_ddp_is_refused_where_it_would_reduce_wrongly():
    from megapipe.megatron.mcore_support import check_ddp

    class DistributedDataParallel(torch.nn.Module):  # stands for Megatron's (same module path)
        __module__ = "megatron.core.distributed.distributed_data_parallel"

        def __init__(self, overlap_grad_reduce):
            super().__init__()
            self.module = torch.nn.Linear(2, 2)
            self.ddp_config = SimpleNamespace(overlap_grad_reduce=overlap_grad_reduce)

        def finish_grad_sync(self):
            pass

    check_ddp(torch.nn.Linear(2, 2), reduce_grads=True)  # no DDP: nothing to refuse
    check_ddp(DistributedDataParallel(False), reduce_grads=False)
    with pytest.raises(ValueError, match="reduce_grads=False"):
        check_ddp(DistributedDataParallel(False), reduce_grads=True)
    check_ddp(DistributedDataParallel(True), reduce_grads=False)  # its hooks run (ddp_hooks)


def test_activation_shape_follows_sequence_parallelism():
    from megapipe.megatron.mcore_support import activation_shape

    config = SimpleNamespace(context_parallel_size=1, sequence_parallel=True,
                             tensor_model_parallel_size=2, hidden_size=16)
    assert activation_shape(config, 8, 2) == (4, 2, 16)
    config.sequence_parallel = False
    assert activation_shape(config, 8, 2) == (8, 2, 16)
