#!/usr/bin/env bash
# tokens/s of the hf and vllm engines on one GPU, at Qwen3-0.6B's shape (random weights built
# locally: nothing is downloaded), 8 prompts x 8 samples at 16, 128 and 512 new tokens, bfloat16,
# median of 3 (benchmarks/engines.py). Budget: under 10 minutes (the run is cut at 9); expected a
# few minutes on an H100/H200-class GPU (most of it the imports and vLLM's build).
#
# Needs: a venv with CUDA torch, transformers, gspo (pip install -e .) and vLLM
# (pip install 'gspo[vllm]'); without vLLM the hf rows are still measured and vllm is reported
# as skipped. PYTHON picks the interpreter (default: python). Results: $OUT/engines_gpu.json and
# $OUT/engines_gpu.log (OUT defaults to the current folder).
#
# Memory: hf keeps every step's logits to return log-probs, about 5e9 of them at 512 new tokens
# with this vocabulary (64 rows), so its 512-token generation peaks near 80 GB; on a GPU with less,
# add --prompts 4. vLLM takes --gpu-memory-utilization (0.3 here) of the GPU.
#
# A dry check on a CPU (no GPU needed), same code path at a tiny size:
#   DEVICE=cpu benchmarks/engines_gpu.sh --layers 1 --lengths 4,8 --repeats 1 --prompts 2 --group-size 2
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
OUT=${OUT:-.}
DEVICE=${DEVICE:-cuda}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind}   # CPU dry check only
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
if [ "$DEVICE" != cpu ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.version.cuda)"
fi
"$PYTHON" -c "import importlib.util as u; print('vllm installed:', u.find_spec('vllm') is not None)"
timeout 540 "$PYTHON" benchmarks/engines.py --device "$DEVICE" --size qwen3-0.6b \
    --lengths 16,128,512 --repeats 3 --json "$OUT/engines_gpu.json" "$@" 2>&1 | tee "$OUT/engines_gpu.log"
