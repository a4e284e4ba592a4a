"""Every script outside the package compiles: the benchmarks (the GPU check's sections among
them, which run only where a device is lent), the examples and the scripts. A rename that leaves
one of them broken is caught here, not in a GPU session (``benchmarks/overlap.py`` once held an
identifier a rename had turned into ``one-wave``)."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p for folder in ("benchmarks", "examples", "scripts")
                 for p in (REPO / folder).rglob("*.py"))


def test_there_are_scripts_to_check():
    assert len(SCRIPTS) > 20 and REPO / "benchmarks" / "overlap.py" in SCRIPTS


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_the_script_compiles(path):
    compile(path.read_text(), str(path), "exec")


def test_a_broken_name_does_not_compile():
    with pytest.raises(SyntaxError):
        compile("one-wave = 1\n", "example.py", "exec")
