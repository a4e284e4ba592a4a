"""The megatron-core releases the adapter's tests run against, and where their sources live.

0.16.1 is what ``pip install 'megapipe[megatron]'`` installs (``scripts/setup.sh`` does). 0.17+
ship only cp312/cp313 wheels (a small compiled dataset helper the adapter never uses), which pip
refuses on Python 3.11; their Python sources run on 3.11. ``release_dir(version)`` downloads
the wheel once (``pip download --no-deps --only-binary=:all: --python-version 3.12``), unzips
its ``megatron/`` package into a cache (``.venv/mcore-releases/<version>/``, or
``$MEGAPIPE_MCORE_CACHE``) and returns that directory, which a test process puts first on
``sys.path`` before it imports Megatron (``use_release``). Without a network the release is
skipped, saying why; any other failure is an error.

``python tests/support/mcore_releases.py`` fetches them all and builds the C++ extension a
release compiles at first use (``build_extensions``; ``scripts/setup.sh`` runs it).
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

RELEASES = ("0.16.1", "0.17.1", "0.18.2", "0.19.2")
ROOT = Path(__file__).resolve().parents[2]


def installed() -> str | None:
    """The megatron-core version pip installed in this environment (None: none)."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def cache_root() -> Path:
    return Path(os.environ.get("MEGAPIPE_MCORE_CACHE", ROOT / ".venv" / "mcore-releases"))


class ReleaseUnavailable(Exception):
    """The release cannot be fetched because the network is missing (the message says so)."""


def release_dir(version: str) -> Path | None:
    """The directory to put first on ``sys.path`` for ``version`` (None: the installed one).
    Raises ``ReleaseUnavailable`` without a network, ``RuntimeError`` on any other failure."""
    if version == installed():
        return None
    target = cache_root() / version
    if (target / "megatron" / "core" / "package_info.py").exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
               "--only-binary=:all:", "--python-version", "3.12", f"megatron-core=={version}",
               "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("megatron_core-*.whl"))
        if done.returncode != 0 or not wheels:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel"]
            if not _network():
                raise ReleaseUnavailable(
                    f"megatron-core {version} is not cached in {target} and the network is "
                    f"missing (pip download: {tail[0]})"
                )
            raise RuntimeError(f"pip download megatron-core=={version} failed: {tail[0]}")
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent))  # renamed into place when whole
        with zipfile.ZipFile(wheels[0]) as wheel:
            for name in wheel.namelist():
                if name.startswith("megatron/"):
                    wheel.extract(name, staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    return target


def _network() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


def use_release(version: str, directory: str | None) -> None:
    """In a test process: import Megatron from ``directory`` (None: the installed release) and
    check it is ``version``. Idempotent; must run before anything imports Megatron."""
    if directory is not None and directory not in sys.path:
        if "megatron.core" in sys.modules:
            raise RuntimeError(
                f"megatron.core was imported (from {sys.modules['megatron.core'].__file__}) "
                f"before release {version} was chosen"
            )
        sys.path.insert(0, directory)
    import megatron.core

    found = megatron.core.__version__.split("+")[0]
    if found != version:
        raise RuntimeError(f"expected megatron-core {version}, imported {found} from "
                           f"{megatron.core.__file__}")


# 0.17.1's checkpointing (selective recompute) compiles a small C++ extension with torch's
# ``load_inline`` the first time it runs (about 25 s of one core), into torch's extensions
# cache (``~/.cache/torch_extensions``, or ``$TORCH_EXTENSIONS_DIR``); later processes load it.
_EXTENSION_BUILDERS = {"0.17.1": "from megatron.core.tensor_parallel import random\n"
                                 "random._get_share_storage()\n"}


def build_extensions(version: str, directory: Path | None) -> None:
    """Build, once per machine, the extension ``version`` would compile in a test's first
    run, so the tests load it instead; done at installation, as pip builds a wheel's."""
    code = _EXTENSION_BUILDERS.get(version)
    if code is None:
        return
    path = f"import sys\nsys.path.insert(0, {str(directory)!r})\n" if directory else ""
    subprocess.run([sys.executable, "-W", "ignore", "-c", path + code], check=True, cwd=ROOT)


if __name__ == "__main__":
    for release in RELEASES:
        try:
            directory = release_dir(release)
        except ReleaseUnavailable as missing:
            print(f"{release}: {missing}", file=sys.stderr)
            continue
        print(release, directory or "(installed)")
        build_extensions(release, directory)
