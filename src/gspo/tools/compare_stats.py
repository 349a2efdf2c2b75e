"""The comparison's statistics: per-run numbers from a run's metrics, mean ± std over seeds, and
whether two means differ by more than the seeds' spread. Pure functions of plain numbers; read by
``gspo.tools.compare`` (results.json, the claims) and ``gspo.tools.compare_report`` (the tables).
"""

from __future__ import annotations

import math
import statistics


def eval_series(rows: list[dict]) -> list[tuple[int, float]]:
    """(step, held-out accuracy) of every evaluated step, the cold start at step 0 first."""
    return [(r["step"], r["eval/accuracy"]) for r in rows
            if isinstance(r.get("eval/accuracy"), (int, float))]


def steps_to(series: list[tuple[int, float]], threshold: float) -> int | None:
    """First evaluated RL step whose accuracy is at least ``threshold`` (None: never)."""
    return next((s for s, a in series if a >= threshold), None)


def collapsed(series: list[tuple[int, float]], min_gain: float) -> bool:
    """Collapse: after its best step, accuracy ends below cold start + half the best gain.

    With cold start a0, best a* (gain g = a* - a0 >= min_gain) and last evaluation a_end, the run
    collapsed when a_end < a0 + g/2: it fell below half of its gain and had not recovered by the end.
    """
    if len(series) < 2:
        return False
    cold, best, last = series[0][1], max(a for _, a in series), series[-1][1]
    gain = best - cold
    return gain >= min_gain and last < cold + gain / 2


def run_stats(rows: list[dict], summary: dict, threshold: float, min_gain: float,
              crash_rule: dict | None = None, gate: dict[str, float] | None = None) -> dict:
    """One run's numbers for the table; with ``crash_rule`` / ``gate`` (the stability suite) also
    its crash analysis (``crash_stats``) and the run means of the gate's metrics."""
    series = eval_series(rows)
    steps = [r for r in rows if isinstance(r.get("time/step_s"), (int, float))]
    clip = [r["policy/clip_frac_tokens"] for r in rows
            if isinstance(r.get("policy/clip_frac_tokens"), (int, float))]
    routing = [r["moe/routing_change_rate"] for r in rows
               if isinstance(r.get("moe/routing_change_rate"), (int, float))]
    lengths = [r["response/length_mean"] for r in steps
               if isinstance(r.get("response/length_mean"), (int, float))]
    train_s = sum(r["time/step_s"] for r in steps)
    n = summary.get("rollout_size")
    tokens = sum(r.get("response/length_mean", 0.0) * (n or 0) for r in steps)
    best_step, best = max(series, key=lambda p: (p[1], -p[0])) if series else (None, None)
    means = gate_means(rows, gate or {})
    return {
        "seed": summary["seed"], "cold_accuracy": series[0][1] if series else None,
        "final_accuracy": summary["eval_after"]["accuracy"], "best_accuracy": best,
        "best_step": best_step, "steps_to_threshold": steps_to(series, threshold),
        "clip_frac_tokens": statistics.fmean(clip) if clip else None,
        "response_length": statistics.fmean(lengths) if lengths else None,
        "routing_change_rate": statistics.fmean(routing) if routing else None,
        "wall_s": summary["wall_s"], "train_s": round(train_s, 2),
        "tokens_per_s": round(tokens / train_s, 1) if n and train_s > 0 else None,
        "collapsed": collapsed(series, min_gain), "eval_n": summary["eval_after"].get("n"),
        "crash": crash_stats(rows, crash_rule or {}),
        "gate": means, "gate_reached": gate_reached(means, gate or {}),
    }


def mean_std(values: list) -> dict:
    """{mean, std (sample, 0 for one value), min, max, n} of the non-None values."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "min": min(xs), "max": max(xs), "n": len(xs)}


AGGREGATED = ["cold_accuracy", "final_accuracy", "best_accuracy", "steps_to_threshold",
              "clip_frac_tokens", "response_length", "routing_change_rate", "wall_s", "train_s", "tokens_per_s"]


def aggregate(per_seed: list[dict]) -> dict:
    agg = {key: mean_std([r.get(key) for r in per_seed]) for key in AGGREGATED}
    agg["reached_threshold"] = sum(r["steps_to_threshold"] is not None for r in per_seed)
    agg["collapses"] = sum(r["collapsed"] for r in per_seed)
    agg["crashes"] = sum(r["crash"]["crashed"] for r in per_seed if "crash" in r)
    agg["gate_reached"] = sum(bool(r.get("gate_reached")) for r in per_seed)
    agg["seeds"] = len(per_seed)
    return agg


# A difference of means counts only when it exceeds the seeds' spread: |Δ| > std_a + std_b
# (sample std over seeds). With one seed there is no spread, and every comparison is inconclusive.

def compare_means(a: dict, b: dict) -> str:
    """'better' | 'worse' | 'within' (a vs b, each a mean_std dict)."""
    if a["mean"] is None or b["mean"] is None or min(a["n"], b["n"]) < 2:
        return "within"
    diff, spread = a["mean"] - b["mean"], a["std"] + b["std"]
    return "better" if diff > spread else "worse" if diff < -spread else "within"


def pm(stat: dict, fmt: str = ".3f", missing: str = "n/a") -> str:
    """'mean ± std' of a mean_std dict, or ``missing`` when it has no values."""
    if stat["mean"] is None:
        return missing
    return f"{stat['mean']:{fmt}} ± {stat['std']:{fmt}}"




def difference(a: dict, b: dict) -> dict:
    """a − b of two mean_std dicts: {diff, spread (std_a + std_b, the claims' bar), verdict}."""
    if a["mean"] is None or b["mean"] is None:
        return {"diff": None, "spread": None, "verdict": "within"}
    return {"diff": a["mean"] - b["mean"], "spread": (a["std"] or 0.0) + (b["std"] or 0.0),
            "verdict": compare_means(a, b)}


def axis_differences(variants: dict, values: list[str], baseline: str) -> dict:
    """Per variant other than ``baseline``, per axis value: its difference to the baseline at that
    value (best and final held-out accuracy, collapses, clipped-token ratio) and both mean
    response lengths. ``variants``: results' variants keyed ``value/variant``."""
    names = [n for n in dict.fromkeys(k.rpartition("/")[2] for k in variants) if n != baseline]
    out = {}
    for name in names:
        rows = {}
        for value in values:
            a, b = variants.get(f"{value}/{name}"), variants.get(f"{value}/{baseline}")
            if a is None or b is None:
                continue
            sa, sb = a["summary"], b["summary"]
            ca, cb = sa["clip_frac_tokens"]["mean"], sb["clip_frac_tokens"]["mean"]
            rows[value] = {
                "best_accuracy": difference(sa["best_accuracy"], sb["best_accuracy"]),
                "final_accuracy": difference(sa["final_accuracy"], sb["final_accuracy"]),
                "collapses": [sa["collapses"], sb["collapses"]], "seeds": [sa["seeds"], sb["seeds"]],
                "clip_ratio": ca / cb if ca is not None and cb else None,
                "response_length": [sa["response_length"]["mean"], sb["response_length"]["mean"]],
            }
        out[name] = rows
    return out


# ---------------------------------------------------------------------- crashes (the stability suite)
# A crash, defined before the stress suite ran (docs/compare.md, "Crashes"): a run that gained at
# least ``min_gain`` over its cold start and then fell below cold start − ``fall`` without coming
# back (every later evaluation stays below), or whose training reward fell below
# ``reward_fraction`` of its start (the mean of its first ``window`` steps) and stayed there (the
# trailing ``window``-step mean never rises above it again). The warnings it had: the first
# gradient-norm spike (above ``spike_factor`` x the median of all earlier steps, after ``window``
# steps) and the first entropy excursion (leaving [1/(1+b), 1+b] x the median of the first
# ``window`` steps, b = ``entropy_band``).

CRASH_DEFAULTS = {"min_gain": 0.10, "fall": 0.05, "reward_fraction": 0.5, "window": 5,
                  "spike_factor": 3.0, "entropy_band": 0.5}


def metric_series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of every row that logged ``key`` as a finite number."""
    return [(r["step"], float(r[key])) for r in rows
            if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]


def accuracy_crash(series: list[tuple[int, float]], min_gain: float, fall: float) -> int | None:
    """The evaluated step from which accuracy stayed below cold − ``fall``, after a gain of at
    least ``min_gain`` (None: no crash)."""
    if len(series) < 2:
        return None
    cold = series[0][1]
    gained = next((i for i, (_, a) in enumerate(series) if a >= cold + min_gain), None)
    if gained is None:
        return None
    crash = None
    for step, acc in series[gained + 1:]:
        below = acc < cold - fall
        crash = (crash if crash is not None else step) if below else None
    return crash


def reward_crash(series: list[tuple[int, float]], fraction: float, window: int) -> int | None:
    """The step from which the trailing ``window``-step mean reward stayed below ``fraction`` of the
    first ``window`` steps' mean (None: no crash, or too few steps, or a start of 0 or less)."""
    if len(series) < 2 * window:
        return None
    values = [v for _, v in series]
    start = statistics.fmean(values[:window])
    if start <= 0:
        return None
    crash = None
    for i in range(window, len(values)):
        below = statistics.fmean(values[i - window + 1:i + 1]) < fraction * start
        crash = (crash if crash is not None else series[i][0]) if below else None
    return crash


def first_spike(series: list[tuple[int, float]], factor: float, warmup: int) -> int | None:
    """First step whose value exceeds ``factor`` x the median of all earlier values (after
    ``warmup`` of them)."""
    for i in range(warmup, len(series)):
        if series[i][1] > factor * statistics.median(v for _, v in series[:i]):
            return series[i][0]
    return None


def first_excursion(series: list[tuple[int, float]], band: float, warmup: int) -> int | None:
    """First step whose value leaves [m/(1+band), m·(1+band)], m the median of the first ``warmup``."""
    if len(series) <= warmup:
        return None
    m = statistics.median(v for _, v in series[:warmup])
    return next((s for s, v in series[warmup:] if not m / (1 + band) <= v <= m * (1 + band)), None)


def crash_stats(rows: list[dict], rule: dict) -> dict:
    """One run's crash analysis: crashed, by what, from which step, and its early warnings."""
    r = {**CRASH_DEFAULTS, **rule}
    by_acc = accuracy_crash(eval_series(rows), r["min_gain"], r["fall"])
    by_reward = reward_crash(metric_series(rows, "reward/mean"), r["reward_fraction"], r["window"])
    steps = [s for s in (by_acc, by_reward) if s is not None]
    step = min(steps) if steps else None
    spike = first_spike(metric_series(rows, "optim/grad_norm"), r["spike_factor"], r["window"])
    entropy = first_excursion(metric_series(rows, "policy/entropy"), r["entropy_band"], r["window"])
    return {"crashed": step is not None,
            "by": None if step is None else "accuracy" if step == by_acc else "reward",
            "step": step, "grad_spike_step": spike, "entropy_excursion_step": entropy}


def gate_means(rows: list[dict], gate: dict[str, float]) -> dict[str, float | None]:
    """Per gate metric, its mean over the run's steps (None: never logged)."""
    out = {}
    for key in gate:
        values = [v for _, v in metric_series(rows, key)]
        out[key] = statistics.fmean(values) if values else None
    return out


def gate_reached(means: dict[str, float | None], gate: dict[str, float]) -> bool:
    """Every gate metric logged, its run mean at least its threshold."""
    return all(means.get(k) is not None and means[k] >= v for k, v in gate.items())
