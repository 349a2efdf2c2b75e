#!/usr/bin/env bash
# Scale-out figures on a GPU machine at Qwen3-0.6B's shape (random weights built locally: nothing
# is downloaded): seconds per weight sync and per MiB, and peak memory, for the in-process
# engines (hf bf16 copy, vllm), then under torchrun (2 ranks, fsdp: each tensor gathered as the
# engine reads it) when the machine has 2 GPUs or more, the Ray placement's sync (generators on
# a local cluster) when ray is installed, then tokens/s of the engines at 128 new
# tokens (benchmarks/engines.py). Budget: under 10 minutes (each part is cut short); expected
# 3-6 minutes on an H100/H200-class GPU, most of it imports and vLLM's builds; on one GPU the
# torchrun part is skipped and the timeouts sum to 570 s.
#
# Needs: a venv with CUDA torch, transformers, gspo (pip install -e .) and vLLM (pip install
# 'gspo[vllm]'). PYTHON picks the interpreter (default: python). Results: $OUT/scaleout_*.json
# and $OUT/scaleout_gpu.log (OUT defaults to the current folder).
#
# A dry check on a CPU: DEVICE=cpu benchmarks/scaleout_gpu.sh --layers 1
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
OUT=${OUT:-.}
DEVICE=${DEVICE:-cuda}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind}
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
LOG="$OUT/scaleout_gpu.log"
GPUS=0
if [ "$DEVICE" != cpu ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$LOG"
    GPUS=$(nvidia-smi --list-gpus | wc -l)
fi
echo "== in-process sync (1 process)" | tee -a "$LOG"
timeout 240 "$PYTHON" benchmarks/weight_sync.py --device "$DEVICE" --size qwen3-0.6b \
    --engines hf,vllm --json "$OUT/scaleout_sync.json" "$@" 2>&1 | grep -E '^\{|Error' | tee -a "$LOG"
if [ "$GPUS" -ge 2 ]; then
    echo "== torchrun, 2 ranks, fsdp, an engine per rank" | tee -a "$LOG"
    timeout 180 "$PYTHON" -m torch.distributed.run --nproc_per_node 2 benchmarks/weight_sync.py \
        --device cuda --size qwen3-0.6b --engines vllm --strategy fsdp \
        --json "$OUT/scaleout_sync_fsdp.json" "$@" 2>&1 | grep -E '^\{|Error' | tee -a "$LOG"
else
    echo "== torchrun: skipped (needs 2 GPUs, found $GPUS)" | tee -a "$LOG"
fi
if "$PYTHON" -c "import ray" 2>/dev/null; then
    # generators on a local Ray cluster of this machine (gloo over loopback, 1 CPU each): the
    # sync of a Qwen3-0.6B-shaped bf16 model to 1 and 2 generators, and one generator's rate
    echo "== Ray placement (benchmarks/ray_placement.py sync)" | tee -a "$LOG"
    RAY_AUTH_MODE=disabled timeout 180 "$PYTHON" benchmarks/ray_placement.py sync \
        --generators 1 2 --repeat 3 2>&1 | grep -E '^\{|Error' | tee "$OUT/scaleout_ray.jsonl" | tee -a "$LOG"
else
    echo "== Ray placement: skipped (pip install 'gspo[ray]')" | tee -a "$LOG"
fi
echo "== tokens/s at 128 new tokens" | tee -a "$LOG"
timeout 150 "$PYTHON" benchmarks/engines.py --device "$DEVICE" --size qwen3-0.6b --lengths 128 \
    --repeats 2 --json "$OUT/scaleout_tokens.json" "$@" 2>&1 | grep -E '^\{|Error' | tee -a "$LOG"
