"""One idea per room: every module of ``megapipe/`` is at most 400 lines, every function at most 60.

A function is counted from its ``def`` line to its last line (the AST's ``lineno`` and
``end_lineno``; decorators and nested functions included, a nested function is also counted on
its own). A longer module or function is allowed only when ``EXEMPT`` names it (the module's
path, or ``path:Qualified.name``) with the reason. A compiled hot loop (a Triton kernel, a numba
loop) may stay long for good; an entry marked TEMPORARY is still to be split.
"""

import ast
from pathlib import Path

import megapipe

ROOT = Path(megapipe.__file__).parent
MODULE_LINES, FUNCTION_LINES = 400, 60
EXEMPT: dict[str, str] = {
    "schedule/timing/loops.py:sweep": "a compiled hot loop: numba compiles it, and compiled code "
    "cannot call plain Python helpers, so the round robin is one function (the module says so)",
}


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, lines) of every function in ``tree``, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + node.name
            yield name, node.end_lineno - node.lineno + 1
            yield from _functions(node, name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")
        else:
            yield from _functions(node, prefix)


def _oversized() -> dict[str, int]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        if len(text.splitlines()) > MODULE_LINES:
            found[rel] = len(text.splitlines())
        for name, lines in _functions(ast.parse(text)):
            if lines > FUNCTION_LINES:
                found[f"{rel}:{name}"] = lines
    return found


def test_no_module_or_function_is_over_its_size_without_a_named_reason():
    over = {name: lines for name, lines in _oversized().items() if name not in EXEMPT}
    assert over == {}, "\n".join(f"{name}: {lines} lines" for name, lines in over.items())


def test_every_exemption_is_still_needed_and_says_why():
    oversized = _oversized()
    stale = [name for name in EXEMPT if name not in oversized]
    assert stale == [], f"no longer over the limit, drop from EXEMPT: {stale}"
    assert all(reason.strip() for reason in EXEMPT.values())


def test_the_counter_counts_from_def_to_the_last_line():
    tree = ast.parse("class A:\n    def f(self):\n        def g():\n            pass\n"
                     "        return 1\n")
    assert dict(_functions(tree)) == {"A.f": 4, "A.f.g": 2}
