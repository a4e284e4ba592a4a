"""One word, one meaning: the retired uses stay out of the code, tests, scripts and docs.

docs/architecture.md's glossary ("Words, one meaning each") says what each word means; each
entry here is a retired use (a pattern), where the word now lives, and an example the pattern
must catch. ``_scanned`` says what is read; a line holding one of an entry's ``allowed``
markers (the refusal of an old flag name, say) may keep it.
"""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

RETIRED = [
    # step: one training iteration; a schedule entry is an action
    (r"\b[FBIW] steps?\b", "an F/B/I/W action", "the zero-bubble W step", ()),
    (r"\blone (F, B and I )?steps?\b", "a lone action", "lone F, B and I steps", ()),
    (r"\b(backward|forward) steps?\b(?! func)", "a forward/backward action",
     "after its last backward step", ()),
    # run: a training run; the engine times actions; comm actions of a gap form a batch
    (r"\b(RunOrder|RUN_ORDER|run_in_order|run_actions|_rerunnable)\b|engine\.Run\b|"
     r"\brerun(\(|\.py\b)|timing\.rerun\b",
     "SweepSequence, time_in_order, time_actions, retime, ActionTimes", "timing.rerun", ()),
    (r"\b(check_runs|_simulate_runs|_check_lowered_run|RUNS)\b", "check_batches, BATCHES_FINISH",
     "check_runs(lowered)", ()),
    (r"\bruns? of (consecutive )?(comm|SEND/RECV|deferred weight|W)\b|\bcomm runs?\b",
     "a gap's batch, a drain of deferred weight gradients", "a maximal run of comm actions", ()),
    (r"set_defaults\(run=|\bargs\.run\(", "set_defaults(handler=...)", "set_defaults(run=f)", ()),
    # chunk: a model chunk; an all-to-all goes in waves
    (r"--moe-a2a-chunks|--a2a-chunks", "--moe-a2a-waves", "--moe-a2a-chunks 2",
     ("RENAMED", "is refused")),
    (r"\b(a2a_chunks|ChunkedPlan|ChunkedDispatch|chunked_plan|chunk_slots|choose_a2a_chunks|"
     r"CHUNKED_ROLES)\b|\.chunked\(|moe[./]chunks\b", "waves: WavePlan.in_waves, wave_slots",
     "plan.chunked(2)", ()),
    (r"\b(unchunked|chunked all-to-alls?|all-to-all chunks|expert-group chunks)\b",
     "all-to-alls in waves", "with chunked all-to-alls", ()),
    # layout: the parallel layout only
    (r"\b(DispatchLayout|GroupLayout|RankLayout|rank_layout|_Layout|early_layout|plan_layout)\b",
     "DispatchSplits, WaveSplits, RankGrid, rank_grid, early_posting, assign_buckets",
     "a DispatchLayout", ()),
    (r"\blayout=\"(bsh|sbh)\"", "axes=", 'layout="sbh"', ()),
    # order: unqualified, the pair order
    (r"\b(chunk_order|megatron_chunk_order|check_rank_order|check_channel_order|order_by_expert|"
     r"forward_order|_order_epoch)\b|\bdata order\b", "chunk_sequence, check_list_order, "
     "check_channel_matching, sort_by_expert, forward_stages, the sampling permutation",
     "order_by_expert(x)", ()),
    # node: a piece of a layer; a machine is a host
    (r"\bnode\(s\)|\bnodes on one machine\b|\btorchrun, (one|several) nodes?\b",
     "host(s)", "placement: 2 node(s):", ()),
    # combine: the MoE combine all-to-all; the pass that makes OVERLAP actions is the overlap pass
    (r"schedule[./]combine\b|\bcombine_pass\b|\bcombine pass\b", "schedule/overlap_pass/",
     "the combine pass", ()),
    # step: never a turn of a schedule's steady state, nor an action
    (r"\bpairs? per step\b|\bsteps ago\b|\bevery step of a schedule\b|\bin one step, and\b",
     "a turn (pairs per turn), an action", "two pairs per step", ()),
    # plan: a layer's node plan; the kernels' row indices, the export's list, the gradient buckets
    (r"\b(routing_plan\w*|tensor_plan|plan_buckets|PLAN_(BLOCK|GRAIN|PROGRAMS)|pair planner)\b|"
     r"\b[Rr]outing plans?\b", "routing_rows, tensor_sources, assign_buckets, the pair order",
     "routing_plan_op(indices)", ()),
    # the design notes live in the repository: docs/architecture.md, docs/combined-step.md
    (r"\bDESIGN\.md\b", "docs/architecture.md (the glossary), docs/combined-step.md",
     "(DESIGN.md, \"Combined step\")", ()),
]


def _scanned() -> list[Path]:
    """The code, the tests, the benchmarks, the scripts, the examples, the project file, the
    README and the docs (not the lead's ``status.md``); never this file, which names the
    retired uses to keep them out."""
    code = [p for folder in ("megapipe", "tests", "benchmarks", "scripts", "examples")
            for suffix in ("*.py", "*.sh", "*.md") for p in sorted((REPO / folder).rglob(suffix))]
    docs = [p for p in sorted((REPO / "docs").glob("*.md")) if p.name != "status.md"]
    files = code + [REPO / "pyproject.toml", REPO / "README.md"] + docs
    return [p for p in files if p != Path(__file__).resolve()]


def test_the_scan_covers_every_kind_of_file():
    scanned = set(_scanned())
    for path in ("megapipe/cli.py", "tests/conftest.py", "benchmarks/overlap.py",
                 "scripts/setup.sh", "pyproject.toml", "README.md", "docs/architecture.md"):
        assert REPO / path in scanned, path
    assert Path(__file__).resolve() not in scanned


@pytest.mark.parametrize("pattern,now,example,allowed", RETIRED, ids=lambda v: str(v)[:24])
def test_each_retired_pattern_catches_its_example(pattern, now, example, allowed):
    assert re.search(pattern, example), (pattern, example)


def test_no_retired_word_is_back():
    found = []
    for path in _scanned():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for pattern, now, _, allowed in RETIRED:
                if re.search(pattern, line) and not any(a in line for a in allowed):
                    found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}  -> {now}")
    assert found == [], "\n".join(found)
