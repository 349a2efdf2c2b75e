"""Seconds per weight sync, per MB of weights: the policy's weights handed to an engine in place.

For each engine (``--engines``: hf = a copy in ``--engine-dtype`` refreshed by load_state_dict;
vllm = the in-process engine's ``reload_weights``) it builds the engine from a model at the chosen
shape (``--size qwen3-0.6b``: Qwen3-0.6B's, random weights built here, nothing downloaded), then
times ``update_weights`` ``--repeats`` times (median) and reports seconds, MiB moved, ms per MiB,
and peak memory. Under ``torchrun`` (WORLD_SIZE > 1) every rank builds its engine through vLLM's
external launcher and ``--strategy fsdp`` shards the policy first, so the sync gathers each
tensor as the engine reads it (the training loop's path); rank 0 prints.

    .venv-vllm/bin/python benchmarks/weight_sync.py --size qwen3-0.6b --layers 4
    torchrun --nproc_per_node 2 benchmarks/weight_sync.py --strategy fsdp --engines vllm
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import engines as bench  # noqa: E402  (this folder's engines.py: SIZES, build)

from gspo.rollout import engines  # noqa: E402
from gspo.training import distributed  # noqa: E402


def peak_mib(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engines", default="hf,vllm")
    p.add_argument("--preset", default="tiny-dense")
    p.add_argument("--size", default="preset", choices=sorted(bench.SIZES))
    p.add_argument("--layers", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--engine-dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="the hf copy's dtype (an hf engine in the policy's dtype has nothing to sync)")
    p.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    ranks = distributed.init_from_env()
    model, tok = bench.build(a, [16], torch.float32)
    model = model.to(a.device)
    ranks.wrap(model, a.strategy)
    weights = ranks.weights(model)
    mib = sum(t.numel() * t.element_size()            # (a DTensor's numel is the whole tensor's)
              for t in model.state_dict().values()) / 2**20
    rows = []
    for name in a.engines.split(","):
        options = {"dtype": getattr(torch, a.engine_dtype), "weights": weights,
                   "gpu_memory_utilization": a.gpu_memory_utilization}
        t0 = time.perf_counter()
        engine = engines.build(name, model, tok, **engines.options_for(name, options))
        build_s = time.perf_counter() - t0
        times = []
        for _ in range(a.repeats):
            bench.sync(a.device)
            t0 = time.perf_counter()
            engine.update_weights(ranks.weights(model), None)
            bench.sync(a.device)
            times.append(time.perf_counter() - t0)
        s = statistics.median(times)
        row = {"engine": name, "size": a.size, "layers": a.layers or None, "world": ranks.world,
               "strategy": a.strategy, "device": a.device, "weights_mib": round(mib, 1),
               "build_s": round(build_s, 1), "sync_s": round(s, 4),
               "ms_per_mib": round(1000 * s / mib, 3), "peak_mib": round(peak_mib(a.device))}
        rows.append(row)
        if ranks.is_main:
            print(json.dumps(row), flush=True)
        if name == "vllm" and ranks.world == 1:
            engine.close()
    if a.json and ranks.is_main:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
