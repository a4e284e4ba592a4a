"""Every script outside the package compiles: the benchmarks (the GPU check's sections among
them, which run only where a device is lent), the examples and the scripts. A rename that leaves
one of them broken is caught here, not in a GPU session (``benchmarks/overlap.py`` once held an
identifier a rename had turned into ``one-wave``). And every name they import from megapipe or
from each other exists (``benchmarks/schedule_scale.py`` once imported ``loops`` from where it
had moved away)."""

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# where the scripts find each other: the benchmarks' folder, the tests' helpers (``support``)
SCRIPT_PATHS = [REPO / "benchmarks", REPO / "tests", REPO]
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


def _ours(module: str) -> bool:
    """megapipe, or a module of the benchmarks, the examples or the tests' helpers."""
    root = module.split(".")[0]
    return root == "megapipe" or any((folder / root).with_suffix(".py").is_file()
                                     or (folder / root / "__init__.py").is_file()
                                     for folder in SCRIPT_PATHS)


def _missing_imports(path: Path) -> list[str]:
    """Every ``import m`` / ``from m import n`` in ``path`` (also inside functions) of our own
    modules whose module or name does not exist."""
    missing = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            wanted = [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            wanted = [(node.module, [alias.name for alias in node.names])]
        else:
            continue
        for module, names in wanted:
            if not _ours(module):
                continue
            try:
                found = importlib.import_module(module)
            except ModuleNotFoundError as error:
                missing.append(f"{path.name}:{node.lineno}: {error}")
                continue
            missing += [f"{path.name}:{node.lineno}: {module} has no {name}" for name in names
                        if not hasattr(found, name)
                        and importlib.util.find_spec(f"{module}.{name}") is None]
    return missing


@pytest.fixture(scope="module")
def script_paths():
    before = list(sys.path)
    sys.path[:0] = [str(p) for p in SCRIPT_PATHS]
    yield
    sys.path[:] = before


def test_every_name_the_scripts_import_exists(script_paths):
    missing = [m for path in SCRIPTS for m in _missing_imports(path)]
    assert missing == [], "\n".join(missing)


def test_a_moved_module_is_found(script_paths, tmp_path):
    script = tmp_path / "moved.py"
    script.write_text("from megapipe.schedule import build_schedule, loops\n"
                      "def f():\n    from megapipe.schedule.kept_orders import PairOrders\n")
    assert _missing_imports(script) == [
        "moved.py:1: megapipe.schedule has no loops",
        "moved.py:3: No module named 'megapipe.schedule.kept_orders'"]
