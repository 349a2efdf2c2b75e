"""The stability guard on runs that really collapse: does it fire before the collapse, and does
roll-back recover?

The collapse is the cheap one the stress calibration found (docs/results/stability.md): GRPO on
tiny-moe at lr 1e-3 with M = 8 minibatches per batch loses its held-out accuracy within a few
steps, whatever the sampler. Run from the start at that rate (warm-up 10 steps), a run falls
without gaining first, so the crash rule of `gspo compare` (a gain of 0.10, then a fall) does not
call it a crash; here GRPO first trains at lr 1e-4 (where it gains), and from step ``--jump``
on at ``--factor`` times that, 1e-3 by default (``faults.lr_factor``, the guard's own fault
injection). Each run is a `gspo train` of configs/moe.yaml with a held-out evaluation (the
whole 200-prompt test split, greedy) after every RL step. Three modes, each on every seed:

* ``observe``: the guard's rules (``RULES``) with action ``warn``: it records when each would
  have fired and changes nothing. Its first trigger is set against the collapse step, computed
  by the crash rule of `gspo compare` (``gspo.tools.compare_stats.crash_stats``, its defaults).
* ``rollback``: the same rules with action ``rollback``, a checkpoint every step,
  ``guard.rollback_lr_scale`` 0.5, ``guard.max_rollbacks`` 3 (one trigger more pauses the run):
  does the run end without a crash, and how many roll-backs did it take?
* ``control``: ``observe`` without the jump (lr 1e-4 throughout), where GRPO does not collapse:
  what the rules fire on a healthy run (their false alarms).

The guard checks a step's training metrics after its update and before that step's evaluation;
a roll-back discards the update, so its held-out accuracy is never measured. The rules and their
thresholds were written down before the measured runs, after three pilots on seed 0 (lr 1e-3
from the start, warm-up 10 and 20: no gain of 0.10 first; the jump at step 13: a crash at 13).
Besides the crash rule, the milder "collapsed" of `gspo compare`'s table (compare_stats.collapsed:
a gain of at least 0.05, then ending below cold start + half of it), with the step it fell for
good. A run *recovered* when neither finds a fall and its last held-out accuracy is at least its
cold start's.

Usage (one run at a time; each is a subprocess with one torch thread):
    python benchmarks/guard_on_collapse.py --out runs/guard [--seeds 0,1,2,3,4] [--steps 40]
        [--jump 13] [--factor 10] [--modes observe,rollback,control]
Writes OUT/guard.json and OUT/guard.md (per run and per rule).

On another job: ``--config`` (default configs/moe.yaml), ``--set`` (overrides after the script's
own), ``--lr``, ``--jump 0`` (no jump: the collapse is the job's own, and ``control`` is then the
same run as ``observe``, so leave it out), ``--eval-every``, ``--rules`` (a YAML list instead of
RULES, whose thresholds are the short-answer job's) and ``--rule`` (one rule more, as YAML, e.g.
``"{kind: metric, metric: mismatch/ratio_above_2_frac, threshold: 0.001}"``).
A ``--no-run`` tabulation needs the same options as the run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import yaml  # noqa: E402

from gspo.observe.stability_rules import kind as stability_kind, read_events  # noqa: E402
from gspo.tools.compare import paired_final  # noqa: E402
from gspo.tools.compare_stats import accuracy_crash, collapsed, crash_stats, eval_series  # noqa: E402

COLLAPSE_MIN_GAIN = 0.05
"""`gspo compare`'s default collapse_min_gain: the table's milder "collapsed" (compare_stats.collapsed)."""

RULES = [
    {"kind": "approx_kl", "threshold": 0.05},
    # trust.md's example: KL(π_old -> π_θ) over a step's minibatches
    {"kind": "clip_frac", "threshold": 0.2},
    # GRPO at ε = 0.2 clips 3-8% of tokens here; trust.md's example (0.5) is looser still
    {"kind": "grad_norm", "threshold": 10.0},
    # 5x the healthy calibration cells' mean gradient norm (1.95 at lr 1e-4)
    {"kind": "entropy", "threshold": 0.4},
    # the cold start's entropy is ~0.65; the crash rule's entropy band ends at m / 1.5 ~ 0.43
    {"kind": "reward_drop", "threshold": 0.05, "ema": 0.9, "warmup": 3},
    # training reward 0.05 below its moving average: about 2 sd of a step's mean reward at ~0.1
    # (the pilot's 0.1 never fired)
    {"kind": "metric", "metric": "moe/routing_change_rate", "threshold": 0.05},
    # the stress gate's routing change: 5% of (token, layer) expert choices moved per update
]
"""The guard's rules (every kind's default metric but the last); the mode sets their action."""

LR = 1e-4
"""GRPO's learning rate before the jump (it gains there: the calibration's lr-1e-4 cells)."""
ACTION = {"observe": "warn", "rollback": "rollback", "control": "warn"}
JUMPS = {"observe": True, "rollback": True, "control": False}
"""Whether the mode's learning rate jumps by --factor at step --jump (none does when --jump is 0)."""
EXTRA = {"observe": [], "control": [],
         "rollback": ["run.save_every=1", "run.keep_checkpoints=2", "guard.max_rollbacks=3",
                      "guard.rollback_lr_scale=0.5"]}
"""Overrides of a mode besides its rules' action."""


def judges_batch(rule: dict) -> bool:
    """Whether the guard blames the sampled batch for this rule (a roll-back then goes one
    checkpoint further back: gspo.training.stability.rollback_before)."""
    return rule.get("judges", stability_kind(rule["kind"]).judges) == "batch"


def rule_name(rule: dict) -> str:
    return rule["kind"] if rule["kind"] != "metric" else f"metric:{rule['metric']}"


def guard_rules(action: str) -> str:
    """RULES as a `guard.rules=[...]` override, each with ``action``."""
    items = ", ".join("{" + ", ".join(f"{k}: {v}" for k, v in {**r, "action": action}.items()) + "}"
                      for r in RULES)
    return f"guard.rules=[{items}]"


def jumps(mode: str, args: argparse.Namespace) -> bool:
    return args.jump > 0 and JUMPS[mode]


def lr_after(mode: str, args: argparse.Namespace) -> float:
    return args.lr * args.factor if jumps(mode, args) else args.lr


def run_overrides(mode: str, seed: int, args: argparse.Namespace, out: Path) -> list[str]:
    jump = ([f"faults.lr_factor={args.factor}", f"faults.lr_from_step={args.jump}"]
            if jumps(mode, args) else [])
    return [f"run.dir={out / mode / f'seed{seed}'}", "run.overwrite=true", f"seed={seed}",
            "objective.name=grpo", f"train.lr={args.lr}", *jump, "train.minibatches=8",
            f"train.steps={args.steps}", f"run.eval_every={args.eval_every}", "run.save_every=0",
            "run.progress=false", "run.trackers=[]", "run.threads=1", "eval.k=1", "eval.keep_best=false",
            f"sft.cache_dir={out / 'sft-cache'}", guard_rules(ACTION[mode]), *EXTRA[mode], *args.set]


def first_triggers(events: list[dict]) -> dict[str, int | None]:
    """Per rule, the first step it fired at (events of rolled-back steps included)."""
    first = {rule_name(r): None for r in RULES}
    for e in events:
        if e["event"] == "trigger" and e["rule"] in first and first[e["rule"]] is None:
            first[e["rule"]] = e["step"]
    return first


def fall_step(series: list[tuple[int, float]]) -> int | None:
    """Where a run that `collapsed` (the milder rule) fell for good: the first evaluation of the
    final stretch below cold start + half its best gain (accuracy_crash with that line)."""
    if not collapsed(series, COLLAPSE_MIN_GAIN):
        return None
    gain = max(a for _, a in series) - series[0][1]
    return accuracy_crash(series, COLLAPSE_MIN_GAIN, -gain / 2)


def analyse(mode: str, seed: int, run_dir: Path, lr_after: float) -> dict:
    """One run's collapse (the crash rule, and the milder "collapsed"), the guard's triggers and
    roll-backs."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    events = read_events(run_dir)
    series = eval_series(rows)
    crash = crash_stats(rows, {})
    first = first_triggers(events)
    fired = [s for s in first.values() if s is not None]
    first_any = min(fired) if fired else None
    rollbacks = [e for e in events if e["event"] == "rollback"]
    cold, final = series[0][1], series[-1][1]
    fell = fall_step(series)
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    best_step, best = max(series, key=lambda p: (p[1], -p[0]))
    return {"mode": mode, "seed": seed, "lr": lr_after, "eval_n": cfg["eval"]["n"] or cfg["task"]["n_test"], "paused": any(e["event"] == "pause" for e in events),
            "cold": cold, "best": best, "best_step": best_step, "final": final,
            "final_step": series[-1][0], "crash": crash,
            "first_trigger": first_any,
            "first_rule": None if first_any is None else next(n for n, s in first.items() if s == first_any),
            "lead": None if first_any is None or crash["step"] is None else crash["step"] - first_any,
            "collapsed": fell is not None, "fall_step": fell,
            "fall_lead": None if first_any is None or fell is None else fell - first_any,
            "rules": first, "triggers": sum(e["event"] == "trigger" for e in events),
            "rollbacks": max((e["rollbacks"] for e in rollbacks), default=0),   # the last one
            "rollback_steps": [[e["step"], e["to_step"]] for e in rollbacks],
            "lr_scale": rollbacks[-1]["lr_scale"] if rollbacks else 1.0,
            "recovered": not crash["crashed"] and fell is None and final >= cold,
            "accuracy": [a for _, a in series]}


def run(mode: str, seed: int, args: argparse.Namespace, out: Path) -> dict:
    """Train one run (a subprocess) and analyse it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "gspo", "train", str(ROOT / args.config),
           *run_overrides(mode, seed, args, out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode not in (0, 3):                 # 3: the guard paused the run (used up roll-backs)
        return {"mode": mode, "seed": seed, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    return analyse(mode, seed, out / mode / f"seed{seed}", lr_after(mode, args))


def fmt(x, spec: str = "") -> str:
    return "–" if x is None else format(x, spec)


def tables(rows: list[dict]) -> list[str]:
    names = [rule_name(r) for r in RULES]
    short = {n: "routing" if n == "metric:moe/routing_change_rate" else n.removeprefix("metric:")
             for n in names}
    lines = ["| mode | seed | cold -> best (step) -> final | crash (by) | fall | first trigger (rule) "
             "| lead to crash / fall | " + " | ".join(short[n] for n in names) +
             " | roll-backs (step -> to) | recovered |",
             "|---" * (9 + len(names)) + "|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mode']} | {r['seed']} | error: {r['error'][:80]} |")
            continue
        c = r["crash"]
        backs = ", ".join(f"{a}->{b}" for a, b in r["rollback_steps"])
        backs = f"{r['rollbacks']} ({backs}; lr x {r['lr_scale']:g})" if r["rollbacks"] else "0"
        lines.append(
            f"| {r['mode']} | {r['seed']} | {r['cold']:.3f} -> {r['best']:.3f} ({r['best_step']}) -> "
            f"{r['final']:.3f}{' (step ' + str(r['final_step']) + ')' if r['paused'] else ''} | {fmt(c['step'])}{' (' + c['by'] + ')' if c['by'] else ''} | "
            f"{fmt(r['fall_step'])} | "
            f"{fmt(r['first_trigger'])}{' (' + short[r['first_rule']] + ')' if r['first_rule'] else ''} | "
            f"{fmt(r['lead'])} / {fmt(r['fall_lead'])} | " + " | ".join(fmt(r["rules"][n]) for n in names) +
            f" | {backs}{', then paused' if r['paused'] else ''} | {'yes' if r['recovered'] else 'no'} |")
    return lines


def mean_sd(xs: list[float], spec: str = ".3f") -> str:
    if not xs:
        return "–"
    return format(statistics.fmean(xs), spec) + (f" ± {statistics.stdev(xs):{spec}}" if len(xs) > 1 else "")


def summary(rows: list[dict], args: argparse.Namespace) -> list[str]:
    lines = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        rs = [r for r in rows if r["mode"] == mode and "error" not in r]
        if not rs:
            continue
        crashed = [r for r in rs if r["crash"]["crashed"]]
        fell = [r for r in rs if r["collapsed"]]
        leads = [r["lead"] for r in rs if r["lead"] is not None]
        fall_leads = [r["fall_lead"] for r in rs if r["fall_lead"] is not None]
        lines.append(
            f"* **{mode}** ({len(rs)} seeds, lr {args.lr:g}{', then ' + format(rs[0]['lr'], 'g') if jumps(mode, args) else ''}): "
            f"crashed {len(crashed)}/{len(rs)}"
            f"{' (steps ' + ', '.join(str(r['crash']['step']) for r in crashed) + ')' if crashed else ''}, "
            f"collapsed {len(fell)}/{len(rs)}"
            f"{' (fell at ' + ', '.join(str(r['fall_step']) for r in fell) + ')' if fell else ''}; "
            f"the guard fired in {sum(r['first_trigger'] is not None for r in rs)}/{len(rs)} runs "
            f"(first at {', '.join(fmt(r['first_trigger']) for r in rs)}); "
            + (f"lead to the crash {', '.join(map(str, leads))} steps; " if leads else "")
            + (f"lead to the fall {', '.join(map(str, fall_leads))} steps; " if fall_leads else "")
            + f"best {mean_sd([r['best'] for r in rs])}, final {mean_sd([r['final'] for r in rs])} "
            f"(cold start {mean_sd([r['cold'] for r in rs])}); "
            f"roll-backs {sum(r['rollbacks'] for r in rs)}, paused {sum(r['paused'] for r in rs)}, "
            f"recovered {sum(r['recovered'] for r in rs)}/{len(rs)}.")
    return lines


PAIRS = [("rollback", "observe"), ("control", "rollback"), ("control", "observe")]
"""Paired final differences reported (a − b over the seeds both ran)."""


def paired(rows: list[dict]) -> list[str]:
    """a − b of the last held-out accuracy per seed, with `gspo compare`'s bars (paired_final)."""
    lines = []
    for a, b in PAIRS:
        runs = {m: {"runs": [{**r, "final_accuracy": r["final"]} for r in rows
                             if r["mode"] == m and "error" not in r]} for m in (a, b)}
        if not runs[a]["runs"] or not runs[b]["runs"]:
            continue
        d = paired_final(runs[a], runs[b])
        by = {r["seed"]: r["final"] for r in runs[b]["runs"]}
        per_seed = ", ".join(f"{r['final'] - by[r['seed']]:+.3f}" for r in runs[a]["runs"] if r["seed"] in by)
        lines.append(f"* {a} − {b}, final accuracy: {d['diff']:+.3f} (sd over seeds {d['std']:.3f}, "
                     f"two standard errors of one evaluation's difference {d['two_se']:.3f}, {d['n']} seeds: "
                     f"{per_seed})")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/guard")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--jump", type=int, default=13, help="first RL step at the higher lr")
    parser.add_argument("--factor", type=float, default=10.0, help="the jump: lr 1e-4 x this")
    parser.add_argument("--modes", default="observe,rollback,control")
    parser.add_argument("--config", default="configs/moe.yaml", help="the job, relative to the repository")
    parser.add_argument("--set", nargs="*", default=[], help="overrides after the script's own")
    parser.add_argument("--lr", type=float, default=LR, help="GRPO's learning rate (before any jump)")
    parser.add_argument("--eval-every", type=int, default=1)
    parser.add_argument("--rule", action="append", default=[], help="a rule added to RULES (YAML)")
    parser.add_argument("--rules", help="a YAML list of rules instead of RULES (thresholds set for "
                        "another job; --rule adds to it)")
    parser.add_argument("--no-run", action="store_true",
                        help="tabulate the runs already in --out (e.g. after a change to the analysis)")
    args = parser.parse_args()
    if args.rules is not None:
        RULES[:] = yaml.safe_load(args.rules)
    RULES.extend(yaml.safe_load(r) for r in args.rule)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for mode in args.modes.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            rows.append(analyse(mode, seed, out / mode / f"seed{seed}", lr_after(mode, args))
                        if args.no_run else run(mode, seed, args, out))
            print(json.dumps({k: rows[-1].get(k) for k in ("mode", "seed", "crash", "fall_step",
                                                            "first_trigger", "rollbacks", "final",
                                                            "error")}), flush=True)
    (out / "guard.json").write_text(json.dumps({"rules": RULES, "lr": args.lr, "jump": args.jump,
                                                "factor": args.factor, "extra": EXTRA,
                                                "config": args.config, "set": args.set,
                                                "steps": args.steps, "runs": rows}, indent=1))
    jump = (f"x {args.factor:g} from step {args.jump} but in control" if args.jump > 0 else "no jump")
    lines = [f"# The guard on a collapse (GRPO unless --set says otherwise; {args.steps} RL steps, "
             f"{args.config} "
             f"{' '.join(args.set)}, M = 8, lr {args.lr:g}, {jump}, "
             f"held-out evaluation every {args.eval_every} step(s))", "",
             "Rules (action `warn` in observe / control, `rollback` in rollback): " +
             "; ".join(f"{rule_name(r)} {'<' if r['kind'] == 'entropy' else '>'} {r['threshold']}"
                       + (" (judges the batch)" if judges_batch(r) else "") for r in RULES) + ".", "",
             "*Crash*: `gspo compare`'s crash rule (compare_stats.crash_stats, its defaults: a gain of "
             "0.10, then below cold start − 0.05 for good, or the training reward below half its "
             "start for good). *Fall*: where a run that `collapsed` by the compare table's milder rule "
             f"(gain ≥ {COLLAPSE_MIN_GAIN}, ends below cold start + half its gain) went below that "
             "line for good. *Lead*: crash (fall) step − the guard's first trigger. Per-rule columns: "
             "the first step each rule fired (rolled-back steps included). *Recovered*: no crash, no "
             "collapse, and a last accuracy at least the cold start's.", "",
             *tables(rows), "", *summary(rows, args), "", *paired(rows)]
    (out / "guard.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
