"""The OVERLAP path, measured: the real call tree of one combined step (a profile hook on the
host thread, ``support.call_tree``), from the executor's OVERLAP branch to the streams and the
model's nodes, with pipeline sends (pp 2) and a real all-to-all group (ep 2 ranks)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_CALLS, MAX_FILES = 12, 6


def _measure_on_rank(_):
    """One step of 1F1B with the overlap, pp 2, on this rank; the call tree of its OVERLAPs."""
    import torch

    from megapipe.models import GPTConfig, build_stage
    from megapipe.models.gpt import gpt_loss
    from megapipe.parallel.groups import ParallelConfig, create_groups
    from megapipe.pipeline.executor import PipelineExecutor
    from megapipe.pipeline.p2p import TensorSpec
    from megapipe.schedule import build_schedule
    from support.call_tree import OverlapPath

    groups = create_groups(ParallelConfig(pp=2, dp=1, ep=1))
    config = GPTConfig(vocab_size=32, hidden_size=16, num_layers=4, num_heads=2, seq_length=8,
                       ffn_hidden_size=32, num_experts=2, moe_top_k=1, moe_ffn_hidden_size=16)
    schedule = build_schedule("1f1b", 2, 4, overlap=True)
    stages = {s: build_stage(config, schedule.model_part(s), 2)
              for s in schedule.stages_of_rank(groups.pp_rank)}
    ids = [torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(i))
           for i in range(4)]
    with PipelineExecutor(schedule, stages, groups=groups, loss_fn=gpt_loss,
                          spec=TensorSpec((2, 8, 16), torch.float32)) as pipeline:
        pipeline.step(ids, ids)  # plans and streams made
        with OverlapPath() as path:
            pipeline.step(ids, ids)
    return path.roots, path.depth, sorted(path.files), sorted(path.functions), sorted(path.edges)


_MEASURED: list = []


def _measured(rank_pools):
    """Per rank: (OVERLAPs recorded, depth, files, functions, edges); measured once."""
    if not _MEASURED:
        _MEASURED.extend(rank_pools(2).run(_measure_on_rank, [None]))
    return _MEASURED


def test_the_overlap_path_is_short_and_never_calls_back_into_the_executor(rank_pools):
    for roots, depth, files, _functions, edges in _measured(rank_pools):
        assert roots > 0
        assert depth <= MAX_CALLS, depth
        assert len(files) <= MAX_FILES, files
        callbacks = [(a, b) for a, b in edges
                     if b[0] == "pipeline/executor.py" and a[0] != "pipeline/executor.py"]
        assert callbacks == []
        assert "overlap/streams.py" in files and "pairing/order.py" in files


def test_the_readme_and_the_page_state_the_measured_path(rank_pools):
    """The README and docs/combined-step.md give the figures this measurement gives."""
    measured = _measured(rank_pools)
    depth = max(depth for _, depth, *_ in measured)
    files = sorted({f for _, _, files, *_ in measured for f in files})
    text = f"{depth} calls deep through {len(files)} files"
    assert f"**One OVERLAP action, end to end: {text}**" in (ROOT / "README.md").read_text()
    page = (ROOT / "docs" / "combined-step.md").read_text()
    assert f"## From an OVERLAP action to a node on a stream: {text}" in page
    listed = re.findall(r"^\| `([a-z0-9_/]+\.py)` \|", page, flags=re.M)
    assert sorted(listed) == files
