"""The files a directory holds for the data commands: every regular file under it, recursively,
sorted, leaving out hidden ones (any part of the path below the directory starting with a dot)."""

from __future__ import annotations

from pathlib import Path


def files_under(directory: Path) -> list[Path]:
    return sorted(
        p
        for p in directory.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    )
