"""The architecture's one-way data flow, checked on the code's own imports.

Each folder of ``megapipe/`` may import only the folders listed before it in ``LAYERS`` (the
README's table, in the same order); besides, the engine (``pipeline/``) imports no model code
(``moe/``, ``models/``) and nothing of the training app. Lazy imports inside functions count.
Inside a folder too, no two files import each other, directly or round a loop of files: imports
inside functions and under ``TYPE_CHECKING`` count (a package imported as a whole counts as its
``__init__.py``; the parent packages Python loads first do not). Inside ``schedule/`` the data
model comes first and each folder imports only the parts before it (``SCHEDULE_PARTS``); inside
``train/`` likewise (``TRAIN_PARTS``).
"""

import ast
import re
from pathlib import Path

import megapipe

LAYERS = [
    "subcommand", "kernels", "schedule", "pairing", "sim", "parallel", "data", "precision",
    "overlap", "recompute", "graphs", "moe", "models", "hf", "pipeline", "megatron", "train",
    "cli",
]
# hf/ (Hugging Face's format of the GPT) sits on models/, below the app that starts from it
FORBIDDEN = {"pipeline": {"moe", "models", "train", "megatron", "hf"}}
ROOT = Path(megapipe.__file__).parent


def _layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "megapipe" or len(parts) < 2:
        return None
    return parts[1]


def _imports(path: Path, package: str) -> set[str]:
    """Every megapipe module ``path`` imports (absolute or relative, at any depth)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
    return {m for m in found if m.startswith("megapipe.")}


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts == ("__init__.py",):
            continue  # the package root re-exports the public API of every layer
        layer = rel.parts[0].removesuffix(".py")
        package = ".".join(("megapipe",) + rel.parts[:-1])
        yield rel, layer, package, path


def test_every_folder_is_a_known_layer():
    layers = {layer for _, layer, _, _ in _modules()}
    assert layers <= set(LAYERS), layers - set(LAYERS)


def test_each_folder_imports_only_the_folders_above_it():
    violations = []
    for rel, layer, package, path in _modules():
        for module in _imports(path, package):
            target = _layer_of(module)
            if target is None or target == layer:
                continue
            if LAYERS.index(target) > LAYERS.index(layer) or target in FORBIDDEN.get(layer, ()):
                violations.append(f"{rel} imports {module}")
    assert violations == []


def test_the_installed_package_list_names_every_folder():
    """pyproject's explicit package list must follow the folders (a fresh install breaks else)."""
    import tomllib

    config = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    folders = {"megapipe"} | {
        ".".join(("megapipe",) + p.parent.relative_to(ROOT).parts)
        for p in ROOT.rglob("*/__init__.py")
    }
    assert listed == folders


def _module_files() -> dict[str, Path]:
    """Every module of ``megapipe/``."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(("megapipe",) + parts[: -1 if parts[-1] == "__init__" else None])] = path
    return found


def _imported(source: str, package: str, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``source`` (a file of ``package``) imports anywhere."""
    targets = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names)
    while any(t not in modules and "." in t for t in targets):  # a.b.C -> a.b: its module
        targets = {t if t in modules else t.rpartition(".")[0] for t in targets}
    return targets & modules


def _import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ``megapipe/`` it imports."""
    files = _module_files()
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = _imported(path.read_text(), package, set(files)) - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The sets of modules that import one another round a loop: Tarjan's strongly connected
    components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_the_cycle_finder_finds_a_loop_of_three_and_nothing_else():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a", "d"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_the_import_scan_sees_imports_in_functions_and_under_type_checking():
    source = ("from typing import TYPE_CHECKING\nimport numpy\nif TYPE_CHECKING:\n"
              "    from .b import B\n\ndef f():\n    from ..c import d, D\n    import p.e.E\n")
    modules = {"p", "p.q", "p.q.a", "p.q.b", "p.c", "p.c.d", "p.e"}
    assert _imported(source, "p.q", modules) == {"p.q.b", "p.c", "p.c.d", "p.e"}


def test_no_import_cycle_between_files():
    assert _cycles(_import_graph()) == []


# schedule/ inside: its data model, then its folders, then the entry points; a part imports only
# itself and the parts before it (the README's folder table)
SCHEDULE_PARTS = [
    {"actions", "errors", "table", "ir"}, {"timing"}, {"families", "overlap_pass", "p2p"},
    {"checks"}, {"registry", "rank_views", ""},
]


# train/ inside: the optimizer, then the typed config, checkpoints, observation, and the job, step,
# loop and command at the top
TRAIN_PARTS = [
    {"optim"}, {"config"}, {"checkpoint"}, {"observe"},
    {"job", "job_data", "step", "loop", "main", "supervise", "failures", "exits", "determinism",
     "manual_gc", ""},
]


def _upward_imports(folder: str, parts: list[set[str]]) -> list[str]:
    """The imports inside ``megapipe.<folder>`` from a part to one listed after it."""
    prefix = f"megapipe.{folder}"

    def part(module: str) -> int:
        name = module.removeprefix(prefix).removeprefix(".").split(".")[0]
        found = [i for i, names in enumerate(parts) if name in names]
        assert found, f"{folder}/{name} belongs to no part"
        return found[0]

    inside = {m: t for m, t in _import_graph().items() if m.startswith(prefix)}
    return [f"{m} imports {t}" for m, targets in inside.items() for t in sorted(targets)
            if t.startswith(prefix) and part(t) > part(m)]


def test_schedule_folders_import_only_the_parts_below_them():
    assert _upward_imports("schedule", SCHEDULE_PARTS) == []


def test_train_folders_import_only_the_parts_below_them():
    assert _upward_imports("train", TRAIN_PARTS) == []


def test_the_readme_folder_table_names_every_folder():
    readme = (ROOT.parent / "README.md").read_text()
    listed = set(re.findall(r"^\| `(megapipe/[\w/]+)/`", readme, re.M))
    folders = {p.parent.relative_to(ROOT.parent).as_posix() for p in ROOT.rglob("*/__init__.py")}
    assert listed == folders
