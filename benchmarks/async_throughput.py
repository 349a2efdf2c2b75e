"""RL steps per second of a job, synchronous against ``rollout.async=true``, side by side.

Runs ``gspo train`` on one config as interleaved pairs (synchronous, then asynchronous, then
the next pair), each in its own process with one thread per side (``OMP_NUM_THREADS=1``,
``run.threads=1``), and reports per pair: steps/s over steps 2..N (the first step pays for
start-up and, asynchronously, for a batch without overlap), the ratio, and how many cores were
busy while it ran (the machine's busy CPU seconds from /proc/stat / wall seconds: the worker
process is a fork server's child, which getrusage of our children does not see; elsewhere
getrusage). The machine is shared and noisy: read
the ratios of a pair, not the absolute seconds, and the load average printed beside them.

    python benchmarks/async_throughput.py                     # default job, 3 pairs of 30 steps
    python benchmarks/async_throughput.py --pairs 6 --steps 30 --config configs/default.yaml \
        --set rollout.max_staleness=1
    python benchmarks/async_throughput.py --async-set rollout.async_ratio=behaviour
                                              # the behaviour ratio (the default is decoupled)

The cold start is cached (runs/.sft-cache), so a first run trains it once before timing.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from gspo.observe.metrics import read_metrics  # noqa: E402


def busy_seconds() -> float | None:
    """CPU seconds the whole machine has spent busy (Linux /proc/stat), else None."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + fields[4]                                  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def run_once(config: str, steps: int, asynchronous: bool, extra: list[str], folder: Path) -> dict:
    """One ``gspo train`` run; its steps/s, mean step breakdown and the cores it got."""
    run_dir = folder / ("async" if asynchronous else "sync")
    args = [sys.executable, "-m", "gspo", "train", config, f"train.steps={steps}",
            "run.eval_every=0", "run.save_every=0", "run.threads=1", "eval.n=8",
            f"rollout.async={'true' if asynchronous else 'false'}", f"run.dir={run_dir}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    before, busy_before = resource.getrusage(resource.RUSAGE_CHILDREN), busy_seconds()
    start = time.perf_counter()
    subprocess.run(args, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after, busy_after = resource.getrusage(resource.RUSAGE_CHILDREN), busy_seconds()
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if busy_before is not None:   # the worker process is the fork server's child, not ours
        cpu = busy_after - busy_before
    rows = [r for r in read_metrics(run_dir) if "time/step_s" in r][1:]    # steps 2..N
    times = [r["time/step_s"] for r in rows]
    keys = sorted({k for r in rows for k in r if k.startswith(("time/", "async/")) and k.endswith("_s")})
    mean = {k: statistics.fmean(r.get(k, 0.0) for r in rows) for k in keys}
    return {"steps_per_s": len(times) / sum(times), "cores": cpu / wall, "mean": mean}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override for both variants (repeatable)")
    parser.add_argument("--async-set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override for the asynchronous variant only (repeatable)")
    parser.add_argument("--json", help="write every pair's figures here")
    args = parser.parse_args(argv)
    pairs = []
    with tempfile.TemporaryDirectory(prefix="gspo-async-bench-") as tmp:
        for i in range(args.pairs):
            load = os.getloadavg()[0]
            sync = run_once(args.config, args.steps, False, args.set, Path(tmp) / str(i))
            asyn = run_once(args.config, args.steps, True, args.set + args.async_set,
                            Path(tmp) / str(i))
            pairs.append({"load": load, "sync": sync, "async": asyn,
                          "ratio": asyn["steps_per_s"] / sync["steps_per_s"]})
            print(f"pair {i + 1}: load {load:.1f}  sync {sync['steps_per_s']:.3f} steps/s "
                  f"({sync['cores']:.2f} cores)  async {asyn['steps_per_s']:.3f} steps/s "
                  f"({asyn['cores']:.2f} cores)  async/sync {pairs[-1]['ratio']:.2f}x", flush=True)
    print(f"median async/sync over {len(pairs)} pairs: "
          f"{statistics.median(p['ratio'] for p in pairs):.2f}x")
    for side in ("sync", "async"):
        keys = sorted({k for p in pairs for k in p[side]["mean"]})
        print(f"{side} mean step (s): " + "  ".join(
            f"{k}={statistics.fmean(p[side]['mean'].get(k, 0.0) for p in pairs):.3f}" for k in keys))
    if args.json:
        Path(args.json).write_text(json.dumps(pairs, indent=1))


if __name__ == "__main__":
    main()
