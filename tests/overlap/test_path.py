"""The OVERLAP path of docs/combined-step.md, checked against the code: every hop of its table is
a function of that file that makes that call, there are at most 8 hops through at most 5 files,
and one combined step really goes through every function of the table."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "combined-step.md"


def _path_table() -> list[tuple[int, str, str, str]]:
    """(hop, file, function, call) of the table under the path's heading."""
    text = DOC.read_text()
    section = text[text.index("## From an OVERLAP action to a node on a stream"):]
    section = section[:section.index("\n## ", 4)]
    rows = []
    for line in section.splitlines():
        cells = re.findall(r"\|\s*([^|]*?)\s*(?=\|)", line)
        if len(cells) == 4 and cells[0].isdigit():
            rows.append((int(cells[0]), *(c.strip("`") for c in cells[1:])))
    return rows


def _function(path: Path, qualified: str) -> ast.AST:
    tree = ast.parse(path.read_text())
    parts = qualified.split(".")
    scope: list[ast.AST] = list(tree.body)
    for part in parts:
        found = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                      and n.name == part), None)
        assert found is not None, f"{qualified} is not in {path}"
        scope = list(found.body)
    return found


def _calls(function: ast.AST) -> set[str]:
    """The called expressions of ``function`` as source text (``self._issue``, ``fn``)."""
    return {ast.unparse(node.func) for node in ast.walk(function) if isinstance(node, ast.Call)}


def test_every_hop_of_the_documented_path_is_a_call_in_the_code():
    rows = _path_table()
    assert [hop for hop, *_ in rows] == list(range(1, len(rows) + 1))
    assert len(rows) <= 8
    files = {file for _, file, _, _ in rows}
    assert len(files) <= 5, files
    for hop, file, qualified, call in rows:
        assert call in _calls(_function(ROOT / file, qualified)), (hop, qualified, call)


def test_the_readme_and_the_page_state_the_length_of_the_table():
    """The README's architecture section and the page's heading give the table's own counts."""
    rows = _path_table()
    calls, files = len(rows), len({file for _, file, _, _ in rows})
    readme = (ROOT / "README.md").read_text()
    assert f"**One OVERLAP action, end to end: {calls} calls through {files} files**" in readme
    assert f"## From an OVERLAP action to a node on a stream: {calls} calls, {files} files" in (
        DOC.read_text())


def test_a_combined_step_goes_through_every_function_of_the_path(monkeypatch):
    """Run one OVERLAP action on the executor and record the functions of the table it enters."""
    import megapipe.overlap.combined as combined
    import megapipe.overlap.streams as streams
    import megapipe.pipeline.executor as executor
    import megapipe.pipeline.stage_worker as stage_worker
    from megapipe.models import GPTConfig, build_stage
    from megapipe.models.gpt import gpt_loss
    from megapipe.schedule import build_schedule

    modules = {"megapipe/pipeline/executor.py": executor,
               "megapipe/pipeline/stage_worker.py": stage_worker,
               "megapipe/overlap/combined.py": combined, "megapipe/overlap/streams.py": streams}
    entered: set[str] = set()
    for _, file, qualified, _ in _path_table():
        owner = modules[file]
        *classes, name = qualified.split(".")
        for cls in classes:
            owner = getattr(owner, cls)
        original = getattr(owner, name)

        def spy(*args, __original=original, __name=qualified, **kwargs):
            entered.add(__name)
            return __original(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)
    config = GPTConfig(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, seq_length=8,
                       ffn_hidden_size=32, num_experts=2, moe_top_k=1, moe_ffn_hidden_size=16)
    schedule = build_schedule("1f1b", 1, 2, overlap=True)  # F0 (F1;B0) B1
    stage = build_stage(config, 0, 1)
    ids = [torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(i))
           for i in range(2)]
    with executor.PipelineExecutor(schedule, {0: stage}, loss_fn=gpt_loss) as pipeline:
        pipeline.step(ids, ids)
    assert entered == {qualified for _, _, qualified, _ in _path_table()}
