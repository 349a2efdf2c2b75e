"""The comparison's ``report.md`` and plots: one table, the claims, mean-over-seeds curves.

Reads ``results.json`` (as built by ``gspo.tools.compare.collect``) and the runs' ``metrics.jsonl``; it
trains nothing and judges nothing (the claim verdicts come computed in the results).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from gspo.observe.metrics import read_metrics  # noqa: E402
from gspo.observe.report import save_figure  # noqa: E402
from gspo.tools.compare_stats import pm  # noqa: E402

# (metric key, title, log y); a panel is drawn only when some run logged the metric.
PANELS = [
    ("reward/mean", "training reward", False),
    ("eval/accuracy", "held-out greedy accuracy", False),
    ("policy/clip_frac_tokens", "clipped fraction of tokens", True),
    ("policy/entropy", "policy entropy", False),
    ("response/length_mean", "response length (tokens)", False),
    ("optim/grad_norm", "gradient norm", False),
    ("moe/routing_change_rate", "routing change rate (old -> new experts)", False),
    ("mismatch/ratio_above_2_frac", "share of tokens with sampler/trainer ratio above 2", True),
    ("moe/sampler_trainer_disagreement", "routers differing, sampler vs trainer", False),
]


def _per_step(rows: list[dict], key: str, x: dict[int, float] | None = None) -> dict[float, float]:
    """{x: value} of one run; x is the step, or ``x[step]`` (e.g. training seconds)."""
    return {(x[r["step"]] if x else r["step"]): r[key] for r in rows
            if isinstance(r.get(key), (int, float)) and (x is None or r["step"] in x)}


def band(curves: list[dict[float, float]]) -> tuple[list, list, list, list]:
    """x, mean, min, max over the runs that have each x (steps aligned across seeds)."""
    xs = sorted(set().union(*curves)) if curves else []
    vals = [[c[x] for c in curves if x in c] for x in xs]
    return xs, [statistics.fmean(v) for v in vals], [min(v) for v in vals], [max(v) for v in vals]


def train_seconds(rows: list[dict]) -> dict[int, float]:
    """Cumulative training seconds (time/step_s; evaluations left out) at each logged step."""
    total, out = 0.0, {0: 0.0}
    for r in sorted(rows, key=lambda r: r["step"]):
        total += r.get("time/step_s", 0.0) if isinstance(r.get("time/step_s"), (int, float)) else 0.0
        out[r["step"]] = total
    return out


def plot_metric(runs: dict[str, list[list[dict]]], key: str, title: str, path: Path, *,
                log: bool = False, wall: bool = False) -> bool:
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    drawn = False
    for name, seeds in runs.items():
        curves = [_per_step(rows, key) for rows in seeds]
        if wall:  # x = training seconds: seeds aligned by step, their seconds averaged
            secs = [train_seconds(rows) for rows in seeds]
            steps, mean, lo, hi = band(curves)
            xs = [statistics.fmean(s[st] for s in secs if st in s) for st in steps]
        else:
            xs, mean, lo, hi = band(curves)
        if log:  # a log axis cannot show 0: leave those points out
            keep = [i for i, m in enumerate(mean) if m > 0]
            lo, hi = [max(lo[i], mean[i] * 1e-3) for i in keep], [hi[i] for i in keep]
            xs, mean = [xs[i] for i in keep], [mean[i] for i in keep]
        if not xs:
            continue
        drawn = True
        (line,) = ax.plot(xs, mean, label=name, lw=1.5, marker="o" if len(xs) < 30 else None, ms=3)
        ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2, lw=0)
    if not drawn:
        plt.close(fig)
        return False
    ax.set_title(title + " (mean, min-max over seeds)", fontsize=9)
    ax.set_xlabel("training seconds (evaluation excluded)" if wall else "RL step")
    if log:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)
    return True


def _cell(stat: dict, fmt: str = ".3f") -> str:
    return pm(stat, fmt, missing="–")


def table(results: dict) -> list[str]:
    t = results["threshold"]
    lines = [f"| variant | seeds | cold start | final acc | best acc | steps to {t:.2f} (reached) "
             "| clip frac tokens | wall s | tokens/s | collapses |", "|---" * 10 + "|"]
    for name, v in results["variants"].items():
        s = v["summary"]
        lines.append(
            f"| {name} | {s['seeds']} | {_cell(s['cold_accuracy'])} | {_cell(s['final_accuracy'])} "
            f"| {_cell(s['best_accuracy'])} | {_cell(s['steps_to_threshold'], '.0f')} "
            f"({s['reached_threshold']}/{s['seeds']}) | {_cell(s['clip_frac_tokens'], '.4f')} "
            f"| {_cell(s['wall_s'], '.0f')} | {_cell(s['tokens_per_s'], '.0f')} "
            f"| {s['collapses']}/{s['seeds']} |")
    return lines


def routing_lines(results: dict) -> list[str]:
    """MoE runs: each variant's mean routing change rate per RL step (share of (token, layer)
    pairs whose top-k expert set changed between the policy that sampled and the updated one)."""
    rates = {n: v["summary"].get("routing_change_rate") for n, v in results["variants"].items()}
    rates = {n: r for n, r in rates.items() if r and r["mean"] is not None}
    if not rates:
        return []
    return ["Routing change rate per RL step (MoE; the paper reports about 10% for a 48-layer "
            "model): " + ", ".join(f"{n} {_cell(r, '.4f')}" for n, r in rates.items()) + ".", ""]


def crash_section(results: dict) -> list[str]:
    """Runs of a suite with a crash claim or a gate: per run, whether and when it crashed, its first
    gradient-norm spike and entropy excursion, and the run means of the gate's metrics."""
    if not results.get("gate") and not any(c["claim"] == "crash" for c in results.get("claims", [])):
        return []
    gate = results.get("gate") or {}
    lines = ["## Crashes", "",
             "The rule (docs/compare.md, \"Crashes\", fixed before the runs): "
             + ", ".join(f"{k} {v:g}" for k, v in results.get("crash_rule", {}).items()) + ". Gate: "
             + (", ".join(f"{k} >= {v:g}" for k, v in gate.items()) or "none") + ".", "",
             "| run | crashed (by, step) | first grad-norm spike | first entropy excursion | "
             + " | ".join(gate) + (" | " if gate else "") + "gate |",
             "|---" * (5 + len(gate)) + "|"]
    dash = lambda x: "–" if x is None else (f"{x:.4g}" if isinstance(x, float) else str(x))
    for name, v in results["variants"].items():
        for r in v["runs"]:
            c = r.get("crash") or {}
            crashed = f"yes ({c['by']}, step {c['step']})" if c.get("crashed") else "no"
            means = [dash((r.get("gate") or {}).get(k)) for k in gate]
            lines.append(f"| {name} seed {r['seed']} | {crashed} | {dash(c.get('grad_spike_step'))} | "
                         f"{dash(c.get('entropy_excursion_step'))} | " + " | ".join(means)
                         + (" | " if gate else "") + ("reached" if r.get("gate_reached") else "short") + " |")
    return lines + [""]


def tuning_section(tuning: dict) -> list[str]:
    """The grid, each candidate's validation score and the choice, as report lines."""
    lines = ["## Hyper-parameters", ""]
    if not tuning.get("enabled", False) or not tuning.get("variants"):
        why = "tuning was switched off (--no-tune)" if tuning and not tuning.get("enabled") else \
            "the suite lists no grid"
        return lines + [f"Each objective's paper defaults (src/gspo/objectives.py): {why}."]
    budget = (f"at the test runs' budget except `{' '.join(tuning['overrides'])}`"
              if tuning["overrides"] else "at the test runs' budget")
    lines += [f"Chosen on the task's **validation** split (disjoint from train and test; the test "
              f"split is never looked at to choose), {budget}, {tuning['seeds']} seed(s) per "
              f"candidate. Score: mean validation accuracy over a run's last "
              f"{tuning['last_evals']} evaluations, averaged over seeds; ties go to the earlier "
              "candidate (the paper default is listed first). Variants not listed use their paper "
              "defaults.", "",
              "| variant | candidate | validation score | chosen |", "|---|---|---|---|"]
    for name, t in tuning["variants"].items():
        for c in t["candidates"]:
            per = ", ".join(f"{x:.3f}" for x in c["per_seed"])
            lines.append(f"| {name} | `{' '.join(c['overrides'])}` | {c['score']:.3f}"
                         + (f" ({per})" if len(c["per_seed"]) > 1 else "")
                         + f" | {'**yes**' if c['candidate'] == t['chosen'] else ''} |")
    lines += ["", *resolution(tuning)]
    return lines


def resolution(tuning: dict) -> list[str]:
    """How far apart candidates must be for the grid to tell them apart: the binomial standard
    error sqrt(p(1-p)/n) of one evaluation's accuracy, against each variant's spread of scores."""
    out = []
    for name, t in tuning["variants"].items():
        cands = t["candidates"]
        n = min((c.get("n_eval") or 0 for c in cands), default=0)
        if not n:
            continue
        p = statistics.fmean(c["score"] for c in cands)
        se = (p * (1 - p) / n) ** 0.5
        spread = max(c["score"] for c in cands) - min(c["score"] for c in cands)
        verdict = "wider than" if spread > 2 * se else "within"
        out.append(f"{name}: candidates span {spread:.3f}, {verdict} twice the standard error "
                   f"of one evaluation on {n} prompts (2 × {se:.3f})"
                   + ("; the choice is not distinguishable from noise." if verdict == "within" else "."))
    return ["Resolution of the grid: " + " ".join(f"{x}" for x in out)] if out else []


def code_line(results: dict) -> str:
    """Which code made the runs: one commit, or (--allow-mixed-commits) each code and its runs."""
    by_code = results.get("code") or {}
    if not by_code:
        return "Code: not recorded."
    if len(by_code) == 1:
        return (f"Code: every run made at commit `{next(iter(by_code))}` "
                "(each run's provenance.json).")
    return ("**Mixed code** (--allow-mixed-commits): "
            + "; ".join(f"`{code}`: {', '.join(labels)}" for code, labels in by_code.items()) + ".")


AXIS_PANELS = [  # (difference key, y label, log y)
    ("best_accuracy", "best held-out accuracy − baseline's", False),
    ("final_accuracy", "final held-out accuracy − baseline's", False),
    ("clip_ratio", "clipped-token fraction / baseline's", True),
]


def _axis_labels(axis: dict) -> list[str]:
    """Each axis value with the baseline's mean response length there (tokens)."""
    labels = []
    for value in axis["values"]:
        lengths = [r[value]["response_length"][1] for r in axis["differences"].values() if value in r]
        n = next((x for x in lengths if x is not None), None)
        labels.append(value if n is None else f"{value}\n({n:.0f} tok)")
    return labels


def plot_axis(axis: dict, key: str, ylabel: str, path: Path, *, log: bool = False) -> bool:
    """Each variant's difference to the baseline against the axis value; error bars: the seed
    spread the claims use (std_a + std_b)."""
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    drawn = False
    for i, (name, rows) in enumerate(axis["differences"].items()):
        xs, ys, errs = [], [], []
        for j, value in enumerate(axis["values"]):
            d = rows.get(value, {}).get(key)
            y, err = (d, 0.0) if not isinstance(d, dict) else (d["diff"], d["spread"])
            if y is not None:
                xs.append(j + 0.06 * (i - 1)), ys.append(y), errs.append(err or 0.0)
        if xs:
            ax.errorbar(xs, ys, yerr=errs if any(errs) else None, marker="o", capsize=3, label=name)
            drawn = True
    if not drawn:
        plt.close(fig)
        return False
    ax.axhline(1.0 if log else 0.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(axis["values"])), _axis_labels(axis))
    ax.set_xlabel(axis["name"]), ax.set_ylabel(ylabel, fontsize=8)
    ax.set_title(f"vs {axis['baseline']}, by {axis['name']}", fontsize=9)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=7)
    save_figure(fig, path, dpi=110)
    return True


def _diff_cell(d: dict) -> str:
    if d["diff"] is None:
        return "–"
    mark = {"better": " (higher)", "worse": " (lower)", "within": ""}[d["verdict"]]
    return f"{d['diff']:+.3f} ± {d['spread']:.3f}{mark}"


def axis_section(axis: dict, figures: list[str]) -> list[str]:
    """The sweep's table: at each value, each variant against the baseline."""
    base = axis["baseline"]
    lines = [f"## Sweep over {axis['name']}", "",
             f"Every variant ran at every {axis['name']} value with the same budget; each row is a "
             f"variant minus **{base}** at one value (mean over seeds ± the seed spread std_a + "
             "std_b; *higher* / *lower* only when the difference exceeds that spread)."
             + (f" Hyper-parameters were chosen once, at `{axis['tune_at']}`, and used at every "
                "value." if axis.get("tune_at") else ""), "",
             f"| {axis['name']} | variant | response tokens (variant / {base}) | best acc Δ | final acc Δ "
             f"| collapses (variant / {base}) | clip-frac ratio |", "|---" * 7 + "|"]
    for value in axis["values"]:
        for name, rows in axis["differences"].items():
            r = rows.get(value)
            if r is None:
                continue
            la, lb = r["response_length"]
            tokens = "–" if la is None or lb is None else f"{la:.0f} / {lb:.0f}"
            ratio = "–" if r["clip_ratio"] is None else f"{r['clip_ratio']:.1f}x"
            lines.append(f"| {value} | {name} | {tokens} | {_diff_cell(r['best_accuracy'])} "
                         f"| {_diff_cell(r['final_accuracy'])} | {r['collapses'][0]}/{r['seeds'][0]} / "
                         f"{r['collapses'][1]}/{r['seeds'][1]} | {ratio} |")
    return lines + ["", *figures]


def write_report(results: dict, run_dirs: dict[str, list[Path]], out: Path) -> Path:
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    runs = {name: [read_metrics(d) for d in dirs] for name, dirs in run_dirs.items()}
    figures = []
    for key, title, log in PANELS:
        name = key.replace("/", "_") + ".png"
        if plot_metric(runs, key, title, plots / name, log=log):
            figures.append(f"![{title}](plots/{name})")
        if key == "eval/accuracy" and plot_metric(runs, key, title + " vs time",
                                                  plots / "eval_accuracy_vs_time.png", wall=True):
            figures.append(f"![{title} vs time](plots/eval_accuracy_vs_time.png)")
    axis_lines = []
    if results.get("axis"):
        axis_figures = []
        for key, ylabel, log in AXIS_PANELS:
            name = f"axis_{key}.png"
            if plot_axis(results["axis"], key, ylabel, plots / name, log=log):
                axis_figures.append(f"![{ylabel}](plots/{name})")
        axis_lines = axis_section(results["axis"], axis_figures) + [""]
    seeds = max(v["summary"]["seeds"] for v in results["variants"].values())
    lines = [f"# Equal-budget comparison: `{results['suite_file']}`", "",
             f"{seeds} seed(s) per variant{', --quick budget' if results['quick'] else ''}. "
             f"Shared overrides (the budget): `{' '.join(results['shared_overrides'] + results['extra']) or 'none'}`. "
             + (f"--quick adds `{' '.join(results['quick_overrides'])}`. " if results["quick"] else "")
             + "Each variant adds only its own overrides:", ""]
    lines += [f"* **{n}**: `{' '.join(v['overrides'] + v.get('tuned_overrides', [])) or '(base)'}`"
              + (" (the last ones chosen on the validation split)" if v.get("tuned_overrides") else "")
              for n, v in results["variants"].items()]
    lines += ["", code_line(results), "", *tuning_section(results.get("tuning") or {}), "",
              "## Results", "", *table(results), "", *routing_lines(results), *axis_lines,
              "Mean ± sample std over seeds. *Final*: last held-out evaluation; *best*: the highest "
              "one (cold start included). *Steps to* the threshold: first evaluated RL step at or "
              "above it, over the seeds that reached it. *Clip frac tokens*: mean over RL steps. "
              "*Wall s*: the whole run with evaluations; *tokens/s*: generated response tokens per "
              "second of RL steps (evaluations excluded).", "",
              f"**Collapse**: after its best evaluation the run's held-out accuracy ends below "
              f"cold start + half of its best gain (gain = best − cold start, at least "
              f"{results['collapse_min_gain']}), i.e. it fell and did not recover by the end.", "",
              *crash_section(results),
              "## The paper's claims at this scale", "",
              "A difference counts only when it exceeds the seed spread (|Δ mean| > std_a + std_b); "
              "with one seed every comparison is inconclusive.", ""]
    if not results["claims"]:
        lines.append("No claim applies to the variants run.")
    for c in results["claims"]:
        lines.append(f"* **{c['statement']}** ({' vs '.join(c['variants'])}): "
                     f"**{c['verdict']}**: {c['numbers']}.")
    lines += ["", "To test further: more seeds (the spread shrinks as 1/√K), longer runs "
              "(collapse needs time to show), a larger eval.n (finer accuracy), a larger model "
              "and longer responses (the paper's regime), and a wider grid (learning rate too).",
              "", "## Plots", "", *figures, ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
