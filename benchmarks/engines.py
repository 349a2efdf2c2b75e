"""Generation throughput of the engines (gspo.rollout.engines): tokens/s at 16, 128 and 512 new tokens.

One batch of P prompts x G samples (temperature 1, with log-probs, as a rollout asks) on a model
built locally with random weights (nothing is downloaded): ``--size preset`` is the ``--preset``
(tiny-dense by default) with its context widened to fit the longest length; ``--size qwen3-0.6b``
is the same architecture at Qwen3-0.6B's shape (28 layers x 1024, 16 query / 8 key-value heads
of 128, MLP 3072, vocabulary 151,936, tied embeddings; 0.6B parameters), the size of a real RL
run's policy. Prompts come from the character tokenizer (ids below its small vocabulary); sampled
ids range over the whole vocabulary, which is what the head's cost depends on. Each engine is
built once (build time reported apart), warmed up by one short generation, then timed as the
median of ``--repeats`` generations per length. Tokens counted: response tokens up to and including
EOS (random weights rarely sample EOS, so nearly every row runs to the full length).

Usage (vLLM's CPU build lives in .venv-vllm: `make test-vllm` builds it):
    VLLM_CPU_OMP_THREADS_BIND=nobind .venv-vllm/bin/python benchmarks/engines.py
    python benchmarks/engines.py --engines hf            # transformers only, any venv
On a GPU: benchmarks/engines_gpu.sh (Qwen3-0.6B's shape in bfloat16, a few minutes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from gspo.models.presets import DTYPES, build_model
from gspo.rollout import engines
from gspo.rollout.generate import SamplingParams

PROMPTS = ["S 4 7 3:", "S 1 2:", "S 9 9 9 9:", "S 5:", "S 2 8 1 6 3:", "S 7 7:", "S 3 1 4 1 5 9:",
           "S 6 0:"]

SIZES: dict[str, dict] = {
    "preset": {},
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       intermediate_size=3072, tie_word_embeddings=True),
}
"""--size -> config overrides of the tiny-dense preset (the Qwen3 architecture)."""


def build(args, lengths: list[int], dtype: torch.dtype):
    """(model, tokenizer): the preset at the size's shape, ``--layers`` deep, with a context that
    fits the longest length; the size's vocabulary by resizing the embeddings (new rows random)."""
    overrides = {**SIZES[args.size], "max_position_embeddings": max(lengths) + 64}
    vocab = overrides.pop("vocab_size", None)
    if args.layers:
        overrides["num_hidden_layers"] = args.layers
    model, tok = build_model(args.preset, 0, overrides, dtype=dtype)
    if vocab:
        model.resize_token_embeddings(vocab, mean_resizing=False)
    return model, tok


def time_engine(name: str, engine: engines.Engine, prompts: list[list[int]], lengths: list[int],
                args, build_s: float) -> list[dict]:
    """One row per length: the median seconds of ``args.repeats`` generations and its tokens/s."""
    engine.generate(prompts, args.group_size, SamplingParams(max_new_tokens=4), seed=0)  # warm-up
    rows = []
    for n in lengths:
        params = SamplingParams(max_new_tokens=n, temperature=1.0)
        times, tokens = [], 0
        for r in range(args.repeats):
            sync(args.device)
            t0 = time.perf_counter()
            out = engine.generate(prompts, args.group_size, params, seed=r)
            sync(args.device)
            times.append(time.perf_counter() - t0)
            tokens = int(out.response_mask.sum())
        s = statistics.median(times)
        rows.append({"engine": name, "new_tokens": n, "rows": len(prompts) * args.group_size,
                     "tokens": tokens, "seconds": round(s, 3), "tokens_per_s": round(tokens / s, 1),
                     "build_s": round(build_s, 1)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="hf,vllm")
    parser.add_argument("--preset", default="tiny-dense")
    parser.add_argument("--size", default="preset", choices=sorted(SIZES))
    parser.add_argument("--layers", type=int, default=0, help="override the depth (0: the size's)")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                        help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--lengths", default="16,128,512")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lengths = [int(n) for n in args.lengths.split(",")]
    dtype = DTYPES[args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")]
    model, tok = build(args, lengths, dtype)
    model = model.to(args.device).eval()
    params_m = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"model: {args.preset} at size {args.size}, {params_m:.1f}M parameters, {dtype}, "
          f"{args.device}", flush=True)
    prompts = [tok(p)["input_ids"] for p in (PROMPTS * args.prompts)[:args.prompts]]
    options = {"vllm": {"gpu_memory_utilization": args.gpu_memory_utilization}}
    rows, skipped = [], []
    for name in args.engines.split(","):
        try:
            engines.check(name, model.config.model_type)
        except engines.EngineUnavailable as err:     # e.g. vllm not installed here
            skipped.append(f"{name}: {err}")
            print(f"skipped {name}: {err}", flush=True)
            continue
        t0 = time.perf_counter()
        engine = engines.build(name, model, tok, **options.get(name, {}))
        build_s = time.perf_counter() - t0
        rows += time_engine(name, engine, prompts, lengths, args, build_s)
        engine.close()
        del engine
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()                  # the next engine sees the memory free
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": {"preset": args.preset, "size": args.size, "layers": args.layers,
                                 "parameters_m": round(params_m, 1), "dtype": str(dtype),
                                 "device": args.device,
                                 "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda")
                                 else None},
                       "rows": rows, "skipped": skipped}, f, indent=1)
    print(f"\n| engine | new tokens | rows | tokens | s (median of {args.repeats}) | tokens/s | build s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['engine']} | {r['new_tokens']} | {r['rows']} | {r['tokens']} | {r['seconds']} "
              f"| {r['tokens_per_s']} | {r['build_s']} |")


if __name__ == "__main__":
    main()
