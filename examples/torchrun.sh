#!/usr/bin/env bash
# Launch megapipe pretraining with torchrun; extra arguments go to the pretrain script.
#
# One host (all GPUs, or 4 CPU processes without GPUs: the built-in demo):
#   bash examples/torchrun.sh
#   NPROC_PER_NODE=8 bash examples/torchrun.sh --expert-model-parallel-size 4 --train-iters 1000
#
# Several hosts (run the same command on every host; c10d rendezvous on the first host):
#   NNODES=2 MASTER_ADDR=node0.example.com bash examples/torchrun.sh --pipeline-model-parallel-size 4 ...
#
# Environment: NPROC_PER_NODE (default: GPU count, 4 on CPU), NNODES (default 1), MASTER_ADDR,
# MASTER_PORT (default 29500), RDZV_ID (default megapipe), MAX_RESTARTS (default 0; with
# --load equal to --save a restarted job resumes from its newest complete checkpoint),
# PYTHON (default: .venv/bin/python if present, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
GPUS="$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")"
NPROC_PER_NODE="${NPROC_PER_NODE:-$([ "$GPUS" -gt 0 ] && echo "$GPUS" || echo 4)}"
NNODES="${NNODES:-1}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

if [ "$NNODES" -eq 1 ]; then
  exec "$PYTHON" -m torch.distributed.run --standalone --nnodes=1 \
    --max-restarts="${MAX_RESTARTS:-0}" \
    --nproc-per-node="$NPROC_PER_NODE" examples/pretrain_moe_gpt.py "$@"
fi
: "${MASTER_ADDR:?set MASTER_ADDR to the address of the first host for a run on several hosts}"
exec "$PYTHON" -m torch.distributed.run --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" \
  --max-restarts="${MAX_RESTARTS:-0}" \
  --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:${MASTER_PORT:-29500}" \
  --rdzv-id="${RDZV_ID:-megapipe}" examples/pretrain_moe_gpt.py "$@"
