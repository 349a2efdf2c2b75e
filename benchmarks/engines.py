"""Generation throughput of the engines (gspo.engines): tokens/s at 16, 128 and 512 new tokens.

One batch of P prompts x G samples (temperature 1, with log-probs, as a rollout asks) on a preset
(tiny-dense by default, its context widened to fit 512 new tokens). Each engine is built once
(build time reported apart), warmed up by one short generation, then timed as the median of
``--repeats`` generations per length. Tokens counted: response tokens up to and including EOS.
The untrained preset rarely samples EOS, so nearly every row runs to the full length.

Usage (vLLM's CPU build lives in .venv-vllm: `make test-vllm` builds it):
    VLLM_CPU_OMP_THREADS_BIND=nobind .venv-vllm/bin/python benchmarks/engines.py
    python benchmarks/engines.py --engines hf            # transformers only, any venv
On a GPU: --device cuda (the vLLM engine then takes --gpu-memory-utilization).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from gspo import engines
from gspo.models import build_model
from gspo.rollout import SamplingParams

PROMPTS = ["S 4 7 3:", "S 1 2:", "S 9 9 9 9:", "S 5:", "S 2 8 1 6 3:", "S 7 7:", "S 3 1 4 1 5 9:",
           "S 6 0:"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="hf,vllm")
    parser.add_argument("--preset", default="tiny-dense")
    parser.add_argument("--lengths", default="16,128,512")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    lengths = [int(n) for n in args.lengths.split(",")]
    model, tok = build_model(args.preset, 0, {"max_position_embeddings": max(lengths) + 64})
    model = model.to(args.device).eval()
    prompts = [tok(p)["input_ids"] for p in (PROMPTS * args.prompts)[:args.prompts]]
    options = {"vllm": {"gpu_memory_utilization": args.gpu_memory_utilization}}
    rows = []
    for name in args.engines.split(","):
        t0 = time.perf_counter()
        engine = engines.build(name, model, tok, **options.get(name, {}))
        build_s = time.perf_counter() - t0
        engine.generate(prompts, args.group_size, SamplingParams(max_new_tokens=4), seed=0)  # warm-up
        for n in lengths:
            params = SamplingParams(max_new_tokens=n, temperature=1.0)
            times, tokens = [], 0
            for r in range(args.repeats):
                t0 = time.perf_counter()
                out = engine.generate(prompts, args.group_size, params, seed=r)
                times.append(time.perf_counter() - t0)
                tokens = int(out.response_mask.sum())
            s = statistics.median(times)
            rows.append({"engine": name, "new_tokens": n, "rows": len(prompts) * args.group_size,
                         "tokens": tokens, "seconds": round(s, 3), "tokens_per_s": round(tokens / s, 1),
                         "build_s": round(build_s, 1)})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n| engine | new tokens | rows | tokens | s (median of {args.repeats}) | tokens/s | build s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['engine']} | {r['new_tokens']} | {r['rows']} | {r['tokens']} | {r['seconds']} "
              f"| {r['tokens_per_s']} | {r['build_s']} |")


if __name__ == "__main__":
    main()
