"""Calibration before the stability suite: where does the regime GRPO is said to crash in begin?

A grid of short GRPO runs (1 seed, a few RL steps a cell, M = 8 minibatches per batch) over the
MoE preset x learning rate x sampler precision, each a `gspo train` of configs/moe.yaml, with the
sampler's log-probs logged (train.log_rollout_logprobs) and no correction. Per cell: the mean
routing change per RL step (moe/routing_change_rate), the share of policy tokens whose
sampler/trainer probability ratio is beyond 2 either way (mismatch/ratio_above_2_frac +
ratio_below_half_frac), the share of routers that differ between the sampler copy and the trainer
(moe/sampler_trainer_disagreement), the mismatch KL, the gradient norm, and the held-out accuracy at the end.

The gate, written down before the grid runs (docs/results/stability.md): a cell reaches the
regime when its routing change is at least 5% per update AND its ratio-beyond-2 share is at
least 1e-3. The stress suite (configs/compare/stress.yaml) runs at the first cell, in grid order
(cheapest preset, lowest learning rate, mildest precision first), that passes it.

Usage (one process at a time; --jobs 2 runs two cells side by side, a thread each):
    python benchmarks/stress_calibration.py --out runs/calibration [--steps 8] [--jobs 2]
        [--presets tiny-moe,deep-moe,wide-moe] [--lrs 1e-4,3e-4,1e-3]
        [--precisions model,bfloat16,int8,fp8,int4] [--config configs/long.yaml] [--set K=V ...]
Writes OUT/calibration.json and OUT/calibration.md (the table, the gate, the chosen cell).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GATE = {"moe/routing_change_rate": 0.05, "ratio_beyond_2": 1e-3}
"""The regime's gate: both at least these run means (decided before the grid ran)."""
PRECISION = {  # sampler precision -> overrides
    "model": [],
    "bfloat16": ["rollout.dtype=bfloat16"],
    "int8": ["rollout.quantize=int8"],
    "fp8": ["rollout.quantize=fp8"],
    "int4": ["rollout.quantize=int4"],
}


def cell_overrides(preset: str, lr: str, precision: str, steps: int, out: Path) -> list[str]:
    name = f"{preset}-lr{lr}-{precision}"
    return [f"run.dir={out / name}", "run.overwrite=true", f"model.preset={preset}",
            "objective.name=grpo", f"train.lr={lr}", "train.minibatches=8", f"train.steps={steps}",
            "train.log_rollout_logprobs=true", "train.rollout_correction.mode=none",
            f"run.eval_every={steps}", "run.save_every=0", "run.progress=false",
            "run.tensorboard=false", "eval.k=1", "task.n_test=100", f"sft.cache_dir={out / 'sft-cache'}",
            *PRECISION[precision]]


def run_cell(preset: str, lr: str, precision: str, steps: int, out: Path, threads: int,
             config: str = "configs/moe.yaml", extra: tuple[str, ...] = ()) -> dict:
    name = f"{preset}-lr{lr}-{precision}"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "gspo", "train", str(ROOT / config),
           *cell_overrides(preset, lr, precision, steps, out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    row = {"cell": name, "preset": preset, "lr": float(lr), "precision": precision}
    if proc.returncode != 0:
        return {**row, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines() if line]
    mean = lambda key: statistics.fmean(r[key] for r in rows if isinstance(r.get(key), (int, float))) \
        if any(isinstance(r.get(key), (int, float)) for r in rows) else None
    above, below = mean("mismatch/ratio_above_2_frac"), mean("mismatch/ratio_below_half_frac")
    evals = [r["eval/accuracy"] for r in rows if isinstance(r.get("eval/accuracy"), (int, float))]
    row.update({"routing_change": mean("moe/routing_change_rate"),
                "sampler_disagreement": mean("moe/sampler_trainer_disagreement"),
                "ratio_beyond_2": None if above is None else above + (below or 0.0),
                "ratio_above_2": above,         # the stress suite's gate key (one side)
                "mismatch_kl": mean("mismatch/kl"), "grad_norm": mean("optim/grad_norm"),
                "accuracy_start": evals[0] if evals else None, "accuracy_end": evals[-1] if evals else None})
    row["gate"] = passes_gate(row)
    return row


def passes_gate(row: dict) -> bool:
    """Routing change and ratio-beyond-2 share both at least the gate's."""
    return (row.get("routing_change") or 0.0) >= GATE["moe/routing_change_rate"] and \
        (row.get("ratio_beyond_2") or 0.0) >= GATE["ratio_beyond_2"]


def table(rows: list[dict]) -> list[str]:
    f = lambda x, spec: "–" if x is None else format(x, spec)
    lines = ["| cell | routing change | sampler/trainer routing | ratio beyond 2 (above 2 alone) "
             "| mismatch KL | grad norm | acc start -> end | gate |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['cell']} | error: {r['error'][:80]} | | | | | | |")
            continue
        lines.append(f"| {r['cell']} | {f(r['routing_change'], '.4f')} | {f(r['sampler_disagreement'], '.4f')} | "
                     f"{f(r['ratio_beyond_2'], '.2e')} ({f(r.get('ratio_above_2'), '.2e')}) | "
                     f"{f(r['mismatch_kl'], '.2e')} | {f(r['grad_norm'], '.2f')} | "
                     f"{f(r['accuracy_start'], '.3f')} -> {f(r['accuracy_end'], '.3f')} | "
                     f"{'**passes**' if r['gate'] else 'short'} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/calibration")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--presets", default="tiny-moe,deep-moe,wide-moe")
    parser.add_argument("--lrs", default="1e-4,3e-4,1e-3")
    parser.add_argument("--precisions", default="model,bfloat16,int8,fp8")
    parser.add_argument("--config", default="configs/moe.yaml",
                        help="the job every cell trains (e.g. configs/long.yaml: long answers)")
    parser.add_argument("--set", nargs="*", default=[], help="overrides for every cell")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cells = [(p, lr, q) for p in args.presets.split(",") for lr in args.lrs.split(",")
             for q in args.precisions.split(",")]
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda c: run_cell(*c, args.steps, out, threads, args.config,
                                                tuple(args.set)), cells))
    chosen = next((r for r in rows if r.get("gate")), None)
    (out / "calibration.json").write_text(json.dumps({"gate": GATE, "steps": args.steps, "cells": rows,
                                                      "chosen": chosen and chosen["cell"]}, indent=1))
    lines = [f"# Stress calibration ({args.steps} GRPO steps a cell, M = 8, 1 seed, "
             f"{args.config} {' '.join(args.set)})".rstrip(), "",
             f"Gate: routing change >= {GATE['moe/routing_change_rate']} per update and ratio-beyond-2 "
             f"share >= {GATE['ratio_beyond_2']:g}.", "", *table(rows), "",
             f"Chosen: {chosen['cell'] if chosen else 'none: the gate was not met on this grid'}."]
    (out / "calibration.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
