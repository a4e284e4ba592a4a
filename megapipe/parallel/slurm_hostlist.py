"""Slurm's hostlist syntax (``n[1-3,5],m7``), expanded into host names."""

from __future__ import annotations

import re


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested brackets in Slurm hostlist {text!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in Slurm hostlist {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced '[' in Slurm hostlist {text!r}")
    parts.append(text[start:])
    return parts


def _expand_range_set(body: str, hostlist: str) -> list[str]:
    """'1-3,05' -> ['1', '2', '3', '05']; a zero-padded bound keeps its width."""
    out = []
    for item in body.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if match is None:
            raise ValueError(f"bad range {item!r} in Slurm hostlist {hostlist!r}")
        lo_text, hi_text = match.group(1), match.group(2)
        if hi_text is None:
            out.append(lo_text)
            continue
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise ValueError(f"descending range {item!r} in Slurm hostlist {hostlist!r}")
        width = len(lo_text) if lo_text.startswith("0") else 0
        out.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return out


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand Slurm hostlist syntax: ``"n[1-3,5],m7"`` -> ``["n1", "n2", "n3", "n5", "m7"]``.

    Supports zero padding (``n[01-03]``) and several bracket groups in one name
    (``r[1-2]n[1-2]`` -> r1n1, r1n2, r2n1, r2n2).
    """
    hostlist = hostlist.strip()
    if not hostlist:
        raise ValueError("empty Slurm hostlist")
    hosts: list[str] = []
    for part in _split_top_level(hostlist):
        part = part.strip()
        if not part:
            raise ValueError(f"empty host name in Slurm hostlist {hostlist!r}")
        names = [""]
        for literal, body in re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", part):
            suffixes = _expand_range_set(body, hostlist) if body else [""]
            names = [n + literal + s for n in names for s in suffixes]
        hosts.extend(names)
    return hosts
