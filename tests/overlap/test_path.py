"""The OVERLAP path, measured: the real call tree of one step (a profile hook on the host thread,
``support.call_tree``), from the executor's action loop to the streams and the model's nodes,
with pipeline sends (pp 2), in the four settings of the node trace (``pretrain`` turns it on
with the overlap) and deferred weight gradients (``--delay-wgrad-compute``) on and off. What
the overlap adds to a step: the files the combined schedule's step enters and the same
schedule's plain step does not."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_CALLS, MAX_ADDED_FILES = 12, 6
SETTINGS = [(trace, delay) for trace in (False, True) for delay in (False, True)]


def _measure_on_rank(_):
    """Per setting, one step of 1F1B at pp 2 on this rank, with the overlap and without: the
    call tree of each step's action loop."""
    import torch

    from megapipe.models import GPTConfig, build_stage
    from megapipe.models.gpt import gpt_loss
    from megapipe.parallel.groups import ParallelConfig, create_groups
    from megapipe.pipeline.executor import PipelineExecutor
    from megapipe.pipeline.executor_options import ExecutorOptions
    from megapipe.pipeline.p2p import TensorSpec
    from megapipe.schedule import build_schedule
    from support.call_tree import ActionPath

    groups = create_groups(ParallelConfig(pp=2, dp=1, ep=1))
    config = GPTConfig(vocab_size=32, hidden_size=16, num_layers=4, num_heads=2, seq_length=8,
                       ffn_hidden_size=32, num_experts=2, moe_top_k=1, moe_ffn_hidden_size=16)
    ids = [torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(i))
           for i in range(4)]

    def measure(overlap: bool, trace: bool, delay: bool) -> ActionPath:
        schedule = build_schedule("1f1b", 2, 4, overlap=overlap)
        stages = {s: build_stage(config, schedule.model_part(s), 2)
                  for s in schedule.stages_of_rank(groups.pp_rank)}
        options = ExecutorOptions(groups=groups, loss_fn=gpt_loss,
                                  spec=TensorSpec((2, 8, 16), torch.float32), record_trace=trace,
                                  delay_wgrad_compute=delay)
        with PipelineExecutor(schedule, stages, options) as pipeline:
            pipeline.step(ids, ids)  # plans and streams made
            with ActionPath() as path:
                pipeline.step(ids, ids)
        return path

    plain = measure(False, False, False).files
    measured = {}
    for trace, delay in SETTINGS:
        path = measure(True, trace, delay)
        measured[(trace, delay)] = (path.roots, path.depth, path.chain, sorted(path.files),
                                    sorted(path.files - plain), sorted(path.edges))
    return measured


_MEASURED: list = []


def _measured(rank_pools):
    """Per rank, per setting: (loops recorded, depth, deepest chain, files, files the overlap
    adds, edges); measured once."""
    if not _MEASURED:
        _MEASURED.extend(rank_pools(2).run(_measure_on_rank, [None]))
    return _MEASURED


@pytest.mark.parametrize("trace,delay", SETTINGS, ids=lambda v: "on" if v else "off")
def test_the_overlap_path_is_short_and_never_calls_back_into_the_executor(rank_pools, trace,
                                                                          delay):
    for per_setting in _measured(rank_pools):
        roots, depth, chain, files, added, edges = per_setting[(trace, delay)]
        assert roots == 1
        assert depth <= MAX_CALLS, chain
        assert len(added) <= MAX_ADDED_FILES, added
        assert "overlap/streams.py" in added and "pairing/order.py" in added
        callbacks = [(a, b) for a, b in edges
                     if b[0] == "pipeline/executor.py" and a[0] != "pipeline/executor.py"]
        assert callbacks == []
        # overlap/ calls back into pipeline/ through its one declared hand-over only
        into_pipeline = {b for a, b in edges
                         if a[0].startswith("overlap/") and b[0].startswith("pipeline/")}
        assert into_pipeline <= {("pipeline/transit.py", "PairSends.backward_done")}, \
            into_pipeline


def test_the_readme_and_the_page_state_the_measured_path(rank_pools):
    """The README and docs/combined-step.md give the figures this measurement gives (the
    deepest setting; the page lists the files the overlap adds in any setting)."""
    measured = [m for per_rank in _measured(rank_pools) for m in per_rank.values()]
    depth = max(depth for _, depth, *_ in measured)
    added = sorted({f for *_, added, _ in measured for f in added})
    text = f"at most {depth} calls deep from the action loop; the overlap adds {len(added)} files"
    assert f"**One OVERLAP action, end to end: {text}**" in (ROOT / "README.md").read_text()
    page = (ROOT / "docs" / "combined-step.md").read_text()
    assert f"## From an OVERLAP action to a node on a stream: {text}" in page
    listed = re.findall(r"^\| `([a-z0-9_/]+\.py)` \|", page, flags=re.M)
    assert sorted(listed) == added
