#!/usr/bin/env bash
# Create .venv and install megapipe with its test extras (pytest; ruff and mypy, pinned: the
# tests run them) and the pinned megatron-core.
# TORCH_SPEC pins torch (default: the CPU build torch==2.13.0). For a CUDA build, e.g.:
#   TORCH_SPEC="torch==2.13.0" PIP_INDEX_URL=https://download.pytorch.org/whl/cu128 bash scripts/setup.sh
# or TORCH_SPEC=skip to keep a torch that is already in the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip setuptools
if [ "$TORCH_SPEC" != "skip" ]; then
  $PIP install -q "$TORCH_SPEC"
fi
$PIP install -q -e ".[test,triton]"
# numba compiles the schedule layer's two hot loops for schedules of 200k+ steps; without it
# they run in Python (same results, slower) and tests/schedule/test_loops.py skips.
if ! $PIP install -q -e ".[fast]"; then
  echo "setup.sh: numba could not be installed; the schedule layer's loops run in Python" >&2
fi
# Real data (megapipe.data): Hugging Face's tokenizers (train-tokenizer, HuggingFaceTokenizer)
# and safetensors; without them those commands say what is missing and their tests skip.
if ! $PIP install -q -e ".[data]"; then
  echo "setup.sh: tokenizers/safetensors could not be installed; tests/data/ will skip" >&2
fi
# Hugging Face interop (megapipe export-hf, megapipe.hf.load_hf): safetensors, tokenizers and transformers
# (the tests load the export with transformers); where they cannot be installed those tests skip.
if ! $PIP install -q -e ".[hf]"; then
  echo "setup.sh: transformers/safetensors could not be installed; tests/hf will skip" >&2
fi
# The Megatron-Core adapter's tests need megatron-core (pure Python plus a small dataset helper;
# never TransformerEngine or Apex): the extra installs what pip can install here (0.16.1 on
# Python 3.11). Where it cannot be installed those tests skip and say why.
if ! $PIP install -q -e ".[megatron]"; then
  echo "setup.sh: megatron-core could not be installed; tests/megatron/test_mcore_adapter.py will skip" >&2
fi
# The adapter's tests also run against the other supported releases (0.17.1, 0.18.2, 0.19.2:
# cp312/cp313 wheels only, whose Python sources run on 3.11): fetched once into
# .venv/mcore-releases/ (the tests fetch them too, and skip a release only without a network).
# It also builds the C++ extension 0.17.1 compiles with torch at first use (about 25 s), once per
# machine, as pip builds a wheel's, instead of inside the first test that reaches it.
.venv/bin/python tests/support/mcore_releases.py || \
  echo "setup.sh: could not fetch every megatron-core release or build its extension; the tests say which they skip" >&2
# Byte-compiled once here: where PYTHONDONTWRITEBYTECODE is set, every process (a run's ranks,
# the tests' process pools and subprocesses) would otherwise compile megapipe and the fetched
# Megatron-Core releases from source again (0.2 to 0.5 s each).
.venv/bin/python -m compileall -q megapipe benchmarks examples tests .venv/mcore-releases \
  > /dev/null || echo "setup.sh: byte-compiling failed; everything still runs from source" >&2
