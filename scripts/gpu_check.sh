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
# Set-up, no network needed, nothing installed:
#  1. the Python: $PYTHON, else python3 if it imports torch, else /opt/torch/.venv/bin/python3;
#  2. PYTHONPATH=<this checkout> (ahead of any megapipe installed elsewhere), then a check, run
#     from outside the checkout, that megapipe resolves to it. Every section
#     (and every process a section starts) gets the same path from the runner.
# BUDGET (default 420): seconds for the whole check, this set-up included; the sections get
# what is left of it (--budget).
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
  local candidate versions
  for candidate in "${PYTHON:-}" python3 /opt/torch/.venv/bin/python3; do
    [ -n "$candidate" ] || continue
    if [ "${candidate#*/}" != "$candidate" ]; then  # a path: made absolute (not resolved)
      candidate="$(cd "$(dirname "$candidate")" 2>/dev/null && pwd)/$(basename "$candidate")"
    else
      candidate="$(command -v "$candidate")" || continue
    fi
    # one torch import per candidate (seconds each): it also gives the versions for the log
    if versions="$("$candidate" -c 'import sys, torch
print(sys.version.split()[0], "torch", torch.__version__)' 2>>"$SETUP_LOG")"; then
      printf '%s\t%s\n' "$candidate" "$versions"
      return 0
    fi
  done
  return 1
}

imports_megapipe() {  # $1: python; megapipe must resolve to this checkout, judged from
  # outside it: run from the repository root, `python -c` would find the checkout itself on its
  # path and take a Python that merely has torch for one with megapipe. find_spec locates the
  # package without importing it (or torch): no second torch import in the set-up
  (cd / && "$1" -c "
import importlib.util, os, sys
spec = importlib.util.find_spec('megapipe')
assert spec is not None, 'no megapipe on the path'
where = os.path.realpath(spec.origin)
assert where == os.path.join(os.path.realpath(sys.argv[1]), 'megapipe', '__init__.py'), where
" "$ROOT") >>"$SETUP_LOG" 2>&1
}

FOUND="$(pick_python)" || { say "no Python with torch found (tried \$PYTHON, python3, /opt/torch/.venv/bin/python3)"; exit 2; }
BASE="${FOUND%%$'\t'*}"
say "Python with torch: $BASE (${FOUND#*$'\t'})"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if ! imports_megapipe "$BASE"; then
  say "megapipe does not import from $ROOT with PYTHONPATH=$PYTHONPATH (see $SETUP_LOG)"
  exit 2
fi
RUN_PY="$BASE"
say "megapipe from the checkout: PYTHONPATH=$PYTHONPATH"
say "running with $RUN_PY"
if [ "$SETUP_ONLY" = 1 ]; then
  echo "python: $RUN_PY"
  echo "PYTHONPATH: ${PYTHONPATH:-}"
  exit 0
fi
export PYTHONUNBUFFERED=1
LEFT=$(( ${BUDGET:-420} - SECONDS ))  # SECONDS: this script's own time so far (the set-up)
say "set-up took ${SECONDS} s; the sections get ${LEFT} s of ${BUDGET:-420}"
exec "$RUN_PY" benchmarks/gpu_check.py --out "$OUT" --budget "$LEFT" "$@"
