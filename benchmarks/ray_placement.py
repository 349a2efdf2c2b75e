"""Generators on Ray (rollout.placement=ray): weight-sync time per MB, generation rate, step rate.

``sync``: a RayEngine (gspo.rollout.engines.ray_generators) with G hf generators on a local cluster; the
trainer's weights sent ``--repeat`` times, each sync timed (median, MB sent per generator, s/MB)
for the tiny preset and a Qwen3-0.6B-shaped model (random weights, ``--qwen-dtype``), bucketed
(``weights.BUCKET_BYTES``) and one broadcast per tensor; then the 0.6B model's generation rate on
one generator (P prompts x G samples x T tokens).

``steps``: ``gspo train`` on a config (default: the default job, cold start cached) for each
placement (colocated; ray; ray with rollout.async s=1), each in its own process; steps/s over
steps 2..N, the mean generate / sync seconds of a step.

    python benchmarks/ray_placement.py sync --generators 1 2
    python benchmarks/ray_placement.py steps --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def qwen3_06b(dtype):
    """A model shaped as Qwen3-0.6B (28 layers, hidden 1024, vocab 151936, tied), random weights."""
    from transformers import AutoModelForCausalLM, Qwen3Config
    config = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                         num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                         head_dim=128, tie_word_embeddings=True, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def time_syncs(engine, model, repeat: int) -> dict:
    import torch
    from gspo.rollout.engines import weights
    seconds = []
    for version in range(1, repeat + 1):
        with torch.no_grad():
            next(model.parameters()).add_(1e-3)       # a change, so each sync is a new version
        t0 = time.perf_counter()
        engine.update_weights(model.state_dict(), version)
        seconds.append(time.perf_counter() - t0)
    mb = sum(weights.bucket_bytes(b) for b in engine.layout) / 2**20
    median = statistics.median(seconds)
    return {"generators": len(engine.generators), "buckets": len(engine.layout),
            "mb_per_generator": round(mb, 2), "sync_s_median": round(median, 4),
            "s_per_mb": round(median / mb, 6), "mb_per_s": round(mb / median, 1)}


def sync(args) -> None:
    import torch
    from gspo.models.presets import build_char_tokenizer, build_model
    from gspo.rollout.engines import ray_cluster, ray_generators, weights
    torch.set_num_threads(1)
    tiny, tokenizer = build_model("tiny-dense", 0)
    models = {"tiny-dense": tiny}
    if not args.skip_qwen:
        models["qwen3-0.6b-shaped"] = qwen3_06b(getattr(torch, args.qwen_dtype))
    for name, model in models.items():
        for G in args.generators:
            for label, limit in (("bucketed", 64 << 20), ("per-tensor", 1)):
                weights.BUCKET_BYTES = limit
                t0 = time.perf_counter()
                engine = ray_generators.build("hf", model, build_char_tokenizer() if name != "tiny-dense"
                                      else tokenizer, ray_cluster.RaySpec(generators=G, cpus=1))
                start = time.perf_counter() - t0
                try:
                    row = {"model": name, "layout": label, "start_s": round(start, 1),
                           **time_syncs(engine, model, args.repeat)}
                    if name != "tiny-dense" and G == 1 and label == "bucketed":
                        row.update(generation(engine, args))
                finally:
                    engine.close()
                print(json.dumps(row), flush=True)
                if name != "tiny-dense":
                    break                   # per-tensor at 0.6B: only the bucketed layout
    weights.BUCKET_BYTES = 64 << 20


def generation(engine, args) -> dict:
    """Tokens per second of one generator sampling P x G x T (random prompts, no EOS stop)."""
    from gspo.rollout.generate import SamplingParams
    P, G, T = args.gen_shape
    prompts = [[5 + (i * 7 + j) % 90 for j in range(24)] for i in range(P)]
    t0 = time.perf_counter()
    out = engine.generate(prompts, G, SamplingParams(T), seed=0, with_logprobs=False)
    seconds = time.perf_counter() - t0
    tokens = float(out.response_mask.sum())
    return {"gen_shape": [P, G, T], "gen_s": round(seconds, 2), "gen_tokens": tokens,
            "gen_tokens_per_s": round(tokens / seconds, 1)}


def steps(args) -> None:
    placements = {"colocated": [], "ray": ["rollout.placement=ray"],
                  "ray-async-s1": ["rollout.placement=ray", "rollout.async=true",
                                   "rollout.max_staleness=1"]}
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    from gspo.observe.metrics import read_metrics
    for name, extra in placements.items():
        with tempfile.TemporaryDirectory() as folder:
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "gspo", "train", args.config,
                            f"run.dir={folder}/run", f"train.steps={args.steps}",
                            "run.eval_every=0", "run.save_every=0", "run.progress=false",
                            "run.trackers=[]", "run.threads=1", *extra, *args.set],
                           check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
            wall = time.perf_counter() - t0
            rows = [r for r in read_metrics(f"{folder}/run") if "time/step_s" in r][1:]
            mean = lambda key: statistics.mean(r.get(key, 0.0) for r in rows)  # noqa: E731
            print(json.dumps({
                "placement": name, "steps": len(rows) + 1, "wall_s": round(wall, 1),
                "steps_per_s": round(1 / mean("time/step_s"), 3),
                "step_s": round(mean("time/step_s"), 4),
                "generate_s": round(mean("time/generate_s"), 4),
                "sync_s": round(mean("ray/sync_s"), 4), "sync_mb": round(mean("ray/sync_mb"), 2),
                "load": os.getloadavg()[0]}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("sync")
    s.add_argument("--generators", type=int, nargs="+", default=[1, 2])
    s.add_argument("--repeat", type=int, default=5)
    s.add_argument("--qwen-dtype", default="bfloat16")
    s.add_argument("--skip-qwen", action="store_true")
    s.add_argument("--gen-shape", type=int, nargs=3, default=[4, 4, 16], metavar=("P", "G", "T"))
    t = sub.add_parser("steps")
    t.add_argument("--config", default="configs/default.yaml")
    t.add_argument("--steps", type=int, default=20)
    t.add_argument("--set", nargs="*", default=[])
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")   # nothing under ~/.ray; a run's own cluster uses its token
    sync(args) if args.what == "sync" else steps(args)


if __name__ == "__main__":
    main()
