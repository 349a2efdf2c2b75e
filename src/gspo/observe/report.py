"""Run report: PNG plots of the logged metrics and a ``report.md`` that links them.

Reads only the run folder (``metrics.jsonl``, ``summary.json``, ``config.yaml``,
``provenance.json``, ``samples.jsonl``: the best and worst completion of the last step), so
``gspo report RUN_DIR`` rebuilds it at any time, including for a run that is still going.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from gspo.observe.diagnostics import plot_length_slices  # noqa: E402
from gspo.observe.stability_rules import event_table, read_events  # noqa: E402
from gspo.observe.metrics import read_metrics  # noqa: E402
from gspo.observe.timing import PARTS  # noqa: E402
from gspo.observe.provenance import read as read_provenance, table as provenance_table  # noqa: E402
from gspo.observe.samples import best_and_worst, read_samples  # noqa: E402

# (metric key, title); a panel is drawn only when the run logged that metric.
PANELS = [
    ("reward/mean", "training reward"),
    ("eval/accuracy", "held-out greedy accuracy"),
    ("policy/clip_frac_tokens", "clipped fraction of tokens"),
    ("policy/entropy", "policy entropy"),
    ("response/length_mean", "response length (tokens)"),
    ("optim/grad_norm", "gradient norm"),
    ("policy/kl_ref", "KL to reference"),
    ("policy/approx_kl", "approx KL old -> new"),
]


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def save_figure(fig, path: Path, dpi: int = 90) -> None:
    """Lay out, write and release a matplotlib figure (pyplot keeps every open figure alive)."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def plot_panel(rows: list[dict], key: str, title: str, path: Path) -> bool:
    xs, ys = series(rows, key)
    if not xs:
        return False
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, lw=1.5)
    ax.set_title(title)
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
    save_figure(fig, path)
    return True


def time_table(rows: list[dict]) -> list[str]:
    """Markdown lines: mean seconds and share of an RL step per part (time/* metrics)."""
    steps = [r for r in rows if isinstance(r.get("time/step_s"), (int, float)) and r["time/step_s"] > 0]
    if not steps:
        return []
    mean = lambda key: sum(r.get(key, 0.0) for r in steps) / len(steps)  # noqa: E731
    total = mean("time/step_s")
    lines = ["", "## Where the time goes", "",
             f"Mean over {len(steps)} RL steps: {total:.3f} s per step "
             "(eval and checkpoints left out).", "",
             "| part | s / step | share | |", "|---|---|---|---|"]
    for part in PARTS:
        s = mean(f"time/{part}_s")
        lines.append(f"| {part.replace('_', ' ')} | {s:.3f} | {s / total:.1%} | "
                     f"{'█' * round(20 * s / total)} |")
    return lines


def _fmt(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def sample_lines(run_dir: Path) -> list[str]:
    """The best and the worst completion of the last step in samples.jsonl (none: no section)."""
    rows = read_samples(run_dir, -1)
    pair = best_and_worst(rows)
    if pair is None:
        return []
    lines = ["", f"## Samples of step {rows[0]['step']}", "",
             f"Best and worst by reward; all of them: `gspo samples {run_dir} --step {rows[0]['step']}`."]
    for label, (row, c) in zip(("best", "worst"), pair):
        lines += ["", f"**{label}** (reward {c['reward']:.3f}, advantage {c['advantage']:.3f}), prompt:",
                  "", "```", row["prompt"], "```", "", "completion:", "", "```", c["text"], "```"]
    return lines


def build_report(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    if not rows:
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl to report on")
    plots = run_dir / "plots"
    plots.mkdir(exist_ok=True)
    lines = [f"# Run report: `{run_dir}`", ""]
    summary_file = run_dir / "summary.json"
    if summary_file.is_file():
        s = json.loads(summary_file.read_text())
        before, after = s["eval_before"], s["eval_after"]
        lines += [f"Objective **{s['objective']}** on task **{s['task']}**, seed {s['seed']}, "
                  f"{s['steps']} steps, {s['wall_s']:.0f} s wall.", "",
                  "| held-out | before RL | after RL |", "|---|---|---|"]
        lines += [f"| {k} | {_fmt(before[k])} | {_fmt(after[k])} |" for k in before if k in after]
        lines.append("")
    else:
        lines += ["Run in progress (no summary.json yet).", ""]
    lines += ["## Provenance", "", *provenance_table(read_provenance(run_dir)), "",
              "All of it in `provenance.json`; `gspo train --resume` and `gspo audit` check it.",
              ""]
    for key, title in PANELS:
        name = key.replace("/", "_") + ".png"
        if plot_panel(rows, key, title, plots / name):
            lines.append(f"![{title}](plots/{name})")
    if plot_length_slices(rows, plots / "length_slices.png"):
        lines += ["", "## Length slices", "", "![length slices](plots/length_slices.png)"]
    lines += time_table(rows)
    lines += ["", "## Guard events", "", *event_table(read_events(run_dir))]
    lines += sample_lines(run_dir)
    last = rows[-1]
    lines += ["", "## Last logged step", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in last.items()]
    out = run_dir / "report.md"
    out.write_text("\n".join(lines) + "\n")
    return out
