"""Golden run: does a checkout train bit for bit like a stored reference?

Runs the default job (configs/default.yaml) for 10 RL steps after a 20-step cold start, for
tiny-dense with gspo, grpo and ppo, tiny-moe (configs/moe.yaml) with moe.routing_replay=old,
rollout.async at s = 1 with either ratio (decoupled: π_prox partly from the worker; behaviour:
π_old from the worker), and rollout.engine=vllm (with ``--vllm-python``, the interpreter of a
venv that has vLLM, by default ``.venv-vllm/bin/python`` of this checkout, else of the checkout
PYTHONPATH names first; no such interpreter: the run is reported skipped, and a failure if
``--only`` asked for it), and the multi-turn tool job (configs/tools.yaml: the tool loop, its
environment and the calculator tool), each with the ``gspo`` package found on PYTHONPATH (so any checkout
can be measured), then

* ``--record DIR``: stores each run's metrics.jsonl without its wall-clock keys (``time/*`` and
  the async ``*_s`` timings) and its final
  weights (model.safetensors, and the PPO critic) under DIR;
* ``--compare DIR``: runs the same and reports, per run, whether every metric row and every
  weight tensor is identical to DIR's (exit 0), else the first differing metric and the largest
  weight difference (exit 1).

Usage (a reference from another commit, then this checkout against it)::

    git worktree add /tmp/base <commit>
    PYTHONPATH=/tmp/base/src python benchmarks/golden.py --record /tmp/golden --configs /tmp/base/configs
    PYTHONPATH=src python benchmarks/golden.py --compare /tmp/golden

``--set KEY=VALUE`` (repeatable) adds an override to every run of this side: a deliberate change
of a default is compared with its old value set (``--set train.minibatch_by=rows``).
``--added KEY`` (repeatable, with ``--compare``): a metric this side logs and the reference does
not (a new counter): reported, and left out of the comparison in the rows the reference lacks it;
every other key and value must still match.
``--redefined KEY`` (repeatable, with ``--compare``): a metric whose definition this side changes
on purpose (``perf/tokens_computed`` counting what the forwards computed rather than a formula):
left out of the comparison on both sides, and reported when its values differ.

CPU only, one thread: a few minutes for the four runs. Each run's interpreter starts with torch's
global RNG seeded (a ``sitecustomize`` on PYTHONPATH): torch seeds it at random per process, and
code that draws from it (a new layer's init) would otherwise differ run to run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["sft.steps=20", "train.steps=10", "run.progress=false", "run.tensorboard=false",
          "model.device=cpu"]
RUNS = {  # name -> (config file, overrides)
    "dense-gspo": ("default.yaml", ["objective.name=gspo"]),
    "dense-grpo": ("default.yaml", ["objective.name=grpo"]),
    "dense-ppo": ("default.yaml", ["objective.name=ppo"]),
    "moe-gspo-replay-old": ("moe.yaml", ["objective.name=gspo", "moe.routing_replay=old"]),
    "async-gspo-decoupled": ("default.yaml", ["objective.name=gspo", "rollout.async=true",
                                              "rollout.max_staleness=1"]),
    "async-grpo-behaviour": ("default.yaml", ["objective.name=grpo", "rollout.async=true",
                                              "rollout.max_staleness=1",
                                              "rollout.async_ratio=behaviour"]),
    "vllm-gspo": ("default.yaml", ["objective.name=gspo", "rollout.engine=vllm"]),
    "tools-gspo": ("tools.yaml", ["objective.name=gspo"]),
}
VLLM_RUNS = {"vllm-gspo"}
"""Runs that need an interpreter with vLLM (``--vllm-python``)."""
WEIGHT_FILES = ("model.safetensors", "critic.safetensors")


def train(name: str, configs: Path, work: Path, extra: list[str] = (),
          python: str = sys.executable) -> Path:
    """One run of ``name`` in ``work/name`` with the gspo on PYTHONPATH; its final checkpoint.
    Each run trains its own cold start (a cache hit would leave the global RNG elsewhere, and
    PPO's critic head is drawn from it)."""
    config, overrides = RUNS[name]
    run_dir = work / name
    cmd = [python, "-m", "gspo", "train", str(configs / config), f"run.dir={run_dir}",
           f"sft.cache_dir={work / 'sft-cache' / name}", *COMMON, *overrides, *extra]
    site = work / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text("import torch\ntorch.manual_seed(0)\n")
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path,
           "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"golden: {name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text())["final_checkpoint"]


def wall_clock(key: str) -> bool:
    """A key that measures time: time/*, and the async worker's seconds (async/wait_s/trainer,
    async/worker_proximal_s, ...)."""
    return key.startswith("time/") or (key.startswith("async/") and
                                       (key.endswith("_s") or "_s/" in key))


def metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl rows without wall-clock keys."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not wall_clock(k)} for row in rows]


def vllm_python(flag: str | None) -> str | None:
    """The interpreter for the vLLM runs: ``flag``, else ``.venv-vllm/bin/python`` of this
    checkout or of the first PYTHONPATH entry's checkout (``<checkout>/src``); None if none."""
    if flag:
        return flag
    roots = [ROOT] + [Path(p).resolve().parent for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p]
    found = [r / ".venv-vllm" / "bin" / "python" for r in roots]
    return next((str(p) for p in found if p.exists()), None)


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's weight files, keyed 'file/name'."""
    out = {}
    for fname in WEIGHT_FILES:
        for path in Path(checkpoint).rglob(fname):
            for key, value in load_file(path).items():
                out[f"{path.relative_to(checkpoint)}/{key}"] = value
    return out


def same(a, b) -> bool:
    """Metric values equal, NaN equal to NaN."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def compare_metrics(ref: list[dict], new: list[dict], added: tuple[str, ...] = (),
                    redefined: tuple[str, ...] = ()) -> str | None:
    """None when identical (``added``: keys the new side logs and the reference lacks, left out
    once they are absent from the reference; ``redefined``: keys left out on both sides), else
    where the first difference is."""
    ref, new = drop(ref, redefined), drop(new, redefined)
    new = [{k: v for k, v in n.items() if k not in added or k in r} for r, n in zip(ref, new)] \
        + new[len(ref):]
    if len(ref) != len(new):
        return f"{len(new)} metric rows, reference {len(ref)}"
    for i, (r, n) in enumerate(zip(ref, new)):
        if set(r) != set(n):
            return f"row {i}: keys differ: {sorted(set(r) ^ set(n))}"
        for key in r:
            if not same(r[key], n[key]):
                return f"row {i} (step {r.get('step')}): {key} = {n[key]!r}, reference {r[key]!r}"
    return None


def drop(rows: list[dict], keys: tuple[str, ...]) -> list[dict]:
    """The rows without ``keys``."""
    return [{k: v for k, v in row.items() if k not in keys} for row in rows]


def redefined_note(ref: list[dict], new: list[dict], keys: tuple[str, ...]) -> str:
    """Which of the redefined ``keys`` took other values than the reference's ('' when none)."""
    moved = sorted({k for r, n in zip(ref, new) for k in keys
                    if k in r and k in n and not same(r[k], n[k])})
    return f" (redefined metrics {', '.join(moved)} differ, as intended)" if moved else ""


def compare_weights(ref: dict, new: dict) -> str | None:
    if set(ref) != set(new):
        return f"tensors differ: {sorted(set(ref) ^ set(new))[:5]}"
    worst = max(((ref[k].double() - new[k].double()).abs().max().item(), k) for k in ref)
    if worst[0] == 0 and all(torch.equal(ref[k], new[k]) for k in ref):
        return None
    return f"max |Δw| = {worst[0]:.3e} at {worst[1]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", metavar="DIR", help="store the reference here")
    mode.add_argument("--compare", metavar="DIR", help="compare against the reference here")
    parser.add_argument("--configs", default=str(ROOT / "configs"),
                        help="folder holding default.yaml and moe.yaml (default: this checkout's)")
    parser.add_argument("--only", help="comma-separated subset of: " + ", ".join(RUNS))
    parser.add_argument("--work", help="where the runs go (default: a temporary folder)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override for every run, e.g. a new key that keeps an older "
                             "behaviour (train.minibatch_by=rows against a reference from before it)")
    parser.add_argument("--added", action="append", default=[], metavar="KEY",
                        help="a metric this side adds (a new counter), left out of the comparison")
    parser.add_argument("--redefined", action="append", default=[], metavar="KEY",
                        help="a metric whose definition this side changes on purpose, left out of "
                             "the comparison on both sides")
    parser.add_argument("--vllm-python", help="interpreter with vLLM for the vllm runs (default: "
                                                  "a .venv-vllm beside this checkout's or "
                                                  "PYTHONPATH's src)")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(RUNS)
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"unknown run(s) {unknown}; choose from {', '.join(RUNS)}")
    vllm = vllm_python(args.vllm_python)
    store = Path(args.record or args.compare)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gspo-golden-"))
    failed = 0
    for name in names:
        if name in VLLM_RUNS and vllm is None:
            print(f"{name}: SKIPPED (no interpreter with vLLM; pass --vllm-python)")
            failed += bool(args.only)              # asked for by name: not compared is a failure
            continue
        python = vllm if name in VLLM_RUNS else sys.executable
        final = Path(train(name, Path(args.configs), work, args.set, python))
        rows, tensors = metrics(work / name), weights(final)
        if args.record:
            (store / name).mkdir(parents=True, exist_ok=True)
            (store / name / "metrics.json").write_text(json.dumps(rows))
            torch.save(tensors, store / name / "weights.pt")
            print(f"{name}: recorded {len(rows)} metric rows, {len(tensors)} tensors")
            continue
        ref_rows = json.loads((store / name / "metrics.json").read_text())
        ref_tensors = torch.load(store / name / "weights.pt", weights_only=True)
        added, redefined = tuple(args.added), tuple(args.redefined)
        problems = [p for p in (compare_metrics(ref_rows, rows, added, redefined),
                                compare_weights(ref_tensors, tensors)) if p]
        failed += bool(problems)
        logged = sorted({k for row in rows for k in row if k in added})
        note = f" (+ added metrics {', '.join(logged)})" if logged and not problems else ""
        note += redefined_note(ref_rows, rows, redefined) if not problems else ""
        print(f"{name}: " + ("identical (metrics and weights)" + note if not problems
                             else "DIFFERS: " + "; ".join(problems)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
