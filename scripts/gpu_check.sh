#!/usr/bin/env bash
# The GPU check in one command, offline: set megapipe up with the Python that already has torch,
# then run benchmarks/gpu_check.py and leave every file in OUT_DIR.
#
#   bash scripts/gpu_check.sh [OUT_DIR] [gpu_check.py options, e.g. --dry-run --sections env]
#   bash scripts/gpu_check.sh [OUT_DIR] --setup-only   # only the set-up; prints the Python
#                                                      # and PYTHONPATH to use
#
# OUT_DIR defaults to out/gpu_check. It receives at most five files: gpu_check.json,
# gpu_check.md, gpu_check.log, streams_trace.json.gz and setup.log (this script's set-up).
#
# Set-up, no network needed (no pip index is reached):
#  1. the Python: $PYTHON, else python3 if it imports torch, else /opt/torch/.venv/bin/python3;
#  2. a venv ($GPU_CHECK_VENV, default .venv-gpu) made with --system-site-packages and
#     --without-pip; when that Python is itself a venv (its torch is not in the system site),
#     a .pth file adds its site-packages (pip and setuptools come from there too); then
#     pip install --no-index --no-deps --no-build-isolation -e .
#  3. if any of that fails: no venv, the Python itself with PYTHONPATH pointing at the checkout.
# GPU_CHECK_SETUP=venv or links forces one way (default auto: as above).
# BUDGET (default 420) is passed as --budget: seconds for all sections together.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

SETUP_ONLY=0
OUT="out/gpu_check"
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then
  OUT="$1"
  shift
fi
if [ "${1:-}" = "--setup-only" ]; then
  SETUP_ONLY=1
  shift
fi
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
SETUP_LOG="$OUT/setup.log"
: >"$SETUP_LOG"
say() { echo "[gpu_check.sh] $*" | tee -a "$SETUP_LOG" >&2; }

pick_python() {
  local candidate
  for candidate in "${PYTHON:-}" python3 /opt/torch/.venv/bin/python3; do
    [ -n "$candidate" ] || continue
    if [ "${candidate#*/}" != "$candidate" ]; then  # a path: made absolute (not resolved)
      candidate="$(cd "$(dirname "$candidate")" 2>/dev/null && pwd)/$(basename "$candidate")"
    else
      candidate="$(command -v "$candidate")" || continue
    fi
    if "$candidate" -c "import torch" >>"$SETUP_LOG" 2>&1; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

imports_megapipe() {  # $1: python; megapipe and its kernels must resolve to this checkout,
  # checked from the repository root, where the sections run
  (cd "$ROOT" && "$1" -c "
import os, sys, megapipe.kernels, megapipe.train
where = os.path.realpath(megapipe.kernels.__file__)
assert where.startswith(os.path.realpath(sys.argv[1]) + os.sep), where
" "$ROOT") >>"$SETUP_LOG" 2>&1
}

venv_setup() {  # $1: base python; prints the venv's python on success
  local base="$1" venv="${GPU_CHECK_VENV:-$ROOT/.venv-gpu}" vpy site
  if [ ! -x "$venv/bin/python" ]; then
    "$base" -m venv --system-site-packages --without-pip "$venv" >>"$SETUP_LOG" 2>&1 || return 1
  fi
  vpy="$venv/bin/python"
  if ! "$vpy" -c "import torch" >>"$SETUP_LOG" 2>&1; then
    site="$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || return 1
    # one "import site; site.addsitedir(...)" line per folder: their own .pth files count too
    "$base" -c 'import site, sysconfig
paths = site.getsitepackages() + [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
print("\n".join(f"import site; site.addsitedir({p!r})" for p in dict.fromkeys(paths)))' \
      >"$site/_gpu_check_base_site.pth" || return 1
    "$vpy" -c "import torch" >>"$SETUP_LOG" 2>&1 || return 1
  fi
  "$vpy" -m pip install --no-index --no-deps --no-build-isolation -e "$ROOT" >>"$SETUP_LOG" 2>&1 \
    || return 1
  imports_megapipe "$vpy" || return 1
  echo "$vpy"
}

links_setup() {  # $1: python; exports PYTHONPATH to the checkout itself
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  imports_megapipe "$1"
}

BASE="$(pick_python)" || { say "no Python with torch found (tried \$PYTHON, python3, /opt/torch/.venv/bin/python3)"; exit 2; }
say "Python with torch: $BASE ($("$BASE" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)' 2>&1))"
MODE="${GPU_CHECK_SETUP:-auto}"  # auto | venv | links (the last two force one way, for tests)
if [ "$MODE" = auto ] && imports_megapipe "$BASE"; then
  RUN_PY="$BASE"
  say "megapipe is already installed for it"
elif [ "$MODE" != links ] && RUN_PY="$(venv_setup "$BASE")"; then
  say "installed megapipe (editable, offline) into ${GPU_CHECK_VENV:-$ROOT/.venv-gpu}"
elif [ "$MODE" != venv ] && links_setup "$BASE"; then
  RUN_PY="$BASE"
  say "venv set-up failed (see setup.log); using PYTHONPATH=$PYTHONPATH"
else
  say "could not make megapipe importable (see $SETUP_LOG)"
  exit 2
fi
say "running with $RUN_PY"
if [ "$SETUP_ONLY" = 1 ]; then
  echo "python: $RUN_PY"
  echo "PYTHONPATH: ${PYTHONPATH:-}"
  echo "PYTHONSAFEPATH: ${PYTHONSAFEPATH:-}"
  exit 0
fi
export PYTHONUNBUFFERED=1
exec "$RUN_PY" benchmarks/gpu_check.py --out "$OUT" --budget "${BUDGET:-420}" "$@"
