"""Layouts side by side on one job: 1 process or K torchrun ranks, hf or vllm sampling.

For each (layout, engine, seed) it runs ``gspo train`` on the job (configs/default.yaml unless
``--config``) with the same overrides and reads back from the run folder: held-out greedy accuracy
at every evaluation, the training reward of the first / last 10 steps, seconds per RL step
(median ``time/step_s``), seconds per weight sync (median ``time/weight_sync_s``: handing the
policy's weights to the engine before each generation; none for hf sampling on the policy
itself) and the weights' size, so a sync's cost per MB can be read off. It prints a Markdown
table and the means ± sample std over seeds of the final accuracy, and writes every figure to
``--out`` (JSON).

Usage (vllm needs the interpreter of a venv that has it, e.g. .venv-vllm)::

    .venv-vllm/bin/python benchmarks/torchrun_engines.py --seeds 0 1 2 --ranks 1 2 \\
        --engines hf vllm --set train.steps=100 run.eval_every=25 --out /tmp/layouts.json

The machine is shared and noisy: read the times as ratios within one invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from safetensors import safe_open


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(ranks: int) -> list[str]:
    if ranks == 1:
        return [sys.executable, "-m", "gspo"]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
            "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "gspo"]


def rows_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").open()]


def median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else None


def weights_mb(run: Path) -> float:
    """Size of the final checkpoint's weights (what a sync moves), MiB."""
    final = sorted((run / "checkpoints").glob("step_*"))[-1]
    total = 0
    for path in final.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                t = f.get_slice(name)
                n = 1
                for d in t.get_shape():
                    n *= d
                total += n * {"F32": 4, "BF16": 2, "F16": 2}.get(t.get_dtype(), 4)
    return total / 2**20


def one_run(config: str, ranks: int, engine: str, seed: int, overrides: list[str],
            root: Path) -> dict:
    run = root / f"r{ranks}-{engine}-s{seed}"
    args = ["train", config, f"run.dir={run}", f"seed={seed}", f"rollout.engine={engine}",
            "run.overwrite=true", "run.progress=false", "run.trackers=[]", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")}
    t0 = time.time()
    out = subprocess.run([*launch(ranks), *args], env=env, capture_output=True, text=True)
    wall = time.time() - t0
    if out.returncode:
        raise SystemExit(f"{run.name} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    rows = rows_of(run)
    steps = [r for r in rows if "reward/mean" in r]
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    return {"ranks": ranks, "engine": engine, "seed": seed, "wall_s": round(wall, 1),
            "accuracy": evals, "final_accuracy": evals[-1][1],
            "reward_first10": statistics.mean(r["reward/mean"] for r in steps[:10]),
            "reward_last10": statistics.mean(r["reward/mean"] for r in steps[-10:]),
            "step_s": median(steps, "time/step_s"), "generate_s": median(steps, "time/generate_s"),
            "weight_sync_s": median(steps, "time/weight_sync_s"), "weights_mb": weights_mb(run)}


def table(results: list[dict]) -> str:
    lines = ["| ranks | engine | seed | held-out accuracy at each evaluation | train reward first → last 10 "
             "| s/step | generate s/step | sync s | sync ms/MB | wall s |", "|" + "---|" * 10]
    for r in results:
        sync = r["weight_sync_s"]
        per_mb = f"{1000 * sync / r['weights_mb']:.2f}" if sync else "—"
        lines.append(
            f"| {r['ranks']} | {r['engine']} | {r['seed']} | "
            f"{' / '.join(f'{a:.3f}' for _, a in r['accuracy'])} | "
            f"{r['reward_first10']:.3f} → {r['reward_last10']:.3f} | {r['step_s']:.3f} | "
            f"{r['generate_s']:.3f} | {f'{sync:.4f}' if sync else '—'} | {per_mb} | {r['wall_s']} |")
    return "\n".join(lines)


def summary(results: list[dict]) -> str:
    out = []
    for key in dict.fromkeys((r["ranks"], r["engine"]) for r in results):
        final = [r["final_accuracy"] for r in results if (r["ranks"], r["engine"]) == key]
        gain = [r["final_accuracy"] - r["accuracy"][0][1] for r in results
                if (r["ranks"], r["engine"]) == key]
        spread = statistics.stdev(final) if len(final) > 1 else float("nan")
        out.append(f"{key[0]} rank(s), {key[1]}: final accuracy {statistics.mean(final):.3f} ± "
                   f"{spread:.3f}, gain {statistics.mean(gain):+.3f} over {len(final)} seed(s)")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--engines", nargs="+", default=["hf", "vllm"])
    p.add_argument("--set", nargs="*", default=[], help="overrides for every run")
    p.add_argument("--root", default="/tmp/gspo-layouts", help="where the runs are written")
    p.add_argument("--out", help="JSON of every figure")
    a = p.parse_args(argv)
    results = [one_run(a.config, ranks, engine, seed, a.set, Path(a.root))
               for seed in a.seeds for ranks in a.ranks for engine in a.engines]
    print(table(results))
    print()
    print(summary(results))
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
