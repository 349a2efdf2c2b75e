#!/usr/bin/env bash
# Trainer-only throughput on one GPU in prime-rl's format (benchmarks/trainer_throughput.py):
# Qwen3-0.6B's shape (random weights built locally: nothing is downloaded), 16,384 tokens a step,
# bfloat16, flash-attention when flash-attn is importable (else sdpa, said in the table), fake
# data. Four tables: one 16K sequence (prime-rl's setting), then 16K tokens of ragged samples
# (mean 512) packed into one row, the same packed with activation checkpointing, and the same
# samples as padded rows (gspo's RL passes today). Budget: under 10 minutes (each run is cut at
# 150 s); expected about 2 minutes on an H100.
#
# Needs: a venv with CUDA torch, transformers and gspo (pip install -e .); flash-attn optional.
# PYTHON picks the interpreter (default: python). Output: $OUT/throughput_gpu.log (OUT defaults
# to the current folder).
#
# A dry check on a CPU (no GPU needed), same code path at a tiny size:
#   DEVICE=cpu benchmarks/throughput_gpu.sh --shape small --seq-len 512 --steps 1 --warmup 1 --dtype float32
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
OUT=${OUT:-.}
DEVICE=${DEVICE:-cuda}
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
LOG="$OUT/throughput_gpu.log"
: > "$LOG"
if [ "$DEVICE" != cpu ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
fi
"$PYTHON" -c "import torch, transformers; from transformers.utils import is_flash_attn_2_available as fa; print('torch', torch.__version__, torch.version.cuda, 'transformers', transformers.__version__, 'flash-attn', fa())" 2>&1 | tee -a "$LOG"
bench() {
    echo "## $1" | tee -a "$LOG"
    shift
    timeout 150 "$PYTHON" benchmarks/trainer_throughput.py --device "$DEVICE" --shape qwen3-0.6b \
        --seq-len 16384 --dtype bfloat16 --attn auto "$@" 2>&1 | tee -a "$LOG"
}
bench "one 16K sequence, packed" --layout packed --sample-len 16384 "$@"
bench "ragged samples (mean 512), packed" --layout packed --sample-len 512 "$@"
bench "ragged samples (mean 512), packed, activation checkpointing" --layout packed --sample-len 512 --ac "$@"
bench "ragged samples (mean 512), padded rows" --layout padded --sample-len 512 "$@"
