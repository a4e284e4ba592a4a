"""The architecture's one-way data flow, checked on the code's own imports.

Each folder of ``megapipe/`` may import only the folders listed before it in ``LAYERS`` (the
README's table, in the same order); besides, the engine (``pipeline/``) imports no model code
(``moe/``, ``models/``) and nothing of the training app. Lazy imports inside functions count.
"""

import ast
from pathlib import Path

import megapipe

LAYERS = [
    "kernels", "schedule", "pairing", "sim", "parallel", "overlap", "moe", "models", "pipeline",
    "megatron", "train", "cli",
]
FORBIDDEN = {"pipeline": {"moe", "models", "train", "megatron"}}
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
    } | {"megapipe.kernels"}
    assert listed == folders
