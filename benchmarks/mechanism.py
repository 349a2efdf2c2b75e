"""The mechanism study: does token-level importance weighting add gradient noise that grows with
response length, off-policy degree and routing change faster than the sequence-level ratio?

Cells (each the cold start of an existing job, cached by `gspo sft`; 5 seeds = 5 sampled batches):
    short    configs/default.yaml           tiny-dense, answers of ~4 tokens (budget 8)
    medium   configs/long.yaml              tiny-dense, ~50 tokens (budget 96; 300 SFT steps)
    long     configs/long.yaml, 8-14 terms  tiny-dense, ~90 tokens (budget 144; 300 SFT steps)
    tiny-moe configs/moe.yaml               routing axis: 8 experts, top-2
    wide-moe configs/moe.yaml wide-moe      routing axis: 64 experts, top-8
Dense cells run the steps axis (k = 0, 1, 2, 4, 8 AdamW steps at the job's lr), MoE cells the
routing axis (router noise for 0-30% changed (token, layer) expert sets, with and without Routing
Replay); gspo.tools.mechanism does the measuring.

Usage (one cell a process, so two can run side by side; then the report from their JSON):
    python benchmarks/mechanism.py --cell short --out docs/results/mechanism [--seeds 5] [--prompts 4]
    python benchmarks/mechanism.py --report --out docs/results/mechanism
Writes OUT/<cell>.json, then OUT/report.md (tables, verdicts) and OUT/results.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from gspo.config import load_config
from gspo.rollout.data import build_task
from gspo.tools import mechanism as mech
from gspo.tools.compare_stats import compare_means, mean_std, pm
from gspo.training.cold_start import initial_policy

ROOT = Path(__file__).resolve().parents[1]
LONG = ["task.params.min_terms=8", "task.params.max_terms=14", "task.params.flawed_min_terms=10",
        "rollout.max_new_tokens=144", "sft.steps=300"]
CELLS = {  # name -> (config, overrides, axes)
    "short": ("configs/default.yaml", [], ("steps",)),
    "medium": ("configs/long.yaml", ["sft.steps=300"], ("steps",)),
    "long": ("configs/long.yaml", LONG, ("steps",)),
    "tiny-moe": ("configs/moe.yaml", [], ("routing",)),
    "wide-moe": ("configs/moe.yaml", ["model.preset=wide-moe"], ("routing",)),
}
LENGTHS = ("short", "medium", "long")
MOES = ("tiny-moe", "wide-moe")
CACHE = "runs/.sft-cache"


def run_cell(name: str, out: Path, seeds: int, prompts: int) -> Path:
    config, overrides, axes = CELLS[name]
    cfg = load_config(ROOT / config, [*overrides, f"sft.cache_dir={CACHE}", "run.threads=1"])
    task = build_task(cfg)
    model, tokenizer, info = initial_policy(cfg, task, log=lambda m: print(m, file=sys.stderr),
                                            progress=False)
    model.train(False)
    results = mech.measure(cfg, model, tokenizer, seeds=tuple(range(seeds)), prompts=prompts,
                           axes=axes, log=lambda m: print(f"[{name}] {m}", file=sys.stderr))
    results.update(cell=name, config=config, overrides=overrides, cold_start=info.get("cache_key"),
                   sft_steps=info.get("sft_steps"), preset=cfg.model.preset)
    path = out / f"{name}.json"
    path.write_text(json.dumps(results, indent=1))
    return path


# ----------------------------------------------------------------------------- the report

def rows_at(cell: dict, axis: str, level, replay: bool = False) -> list[dict]:
    return [r for r in cell["rows"] if r["axis"] == axis and r["level"] == level
            and r.get("replay", False) == replay]


PAIRS = {"at the paper clip": ("grpo", "gspo"), "without a clip": mech.PAIR_NO_CLIP}
"""(token-level, sequence-level) objectives compared: as trained, and the weights alone."""


def gap_stat(rows: list[dict], pair: tuple[str, str] = ("grpo", "gspo")) -> dict:
    """mean_std over seeds of snr(sequence)/snr(token) (above 1: the token-level one is noisier)."""
    return mean_std([mech.noise_gap(r, *pair) for r in rows])


def dispersion_ratio(rows: list[dict]) -> dict:
    """mean_std over seeds of token spread / sequence deviation (token log-ratio spread within a
    response over |log s_i|)."""
    return mean_std([r["dispersion"]["token_spread"] / r["dispersion"]["seq_dev"]
                     for r in rows if r["dispersion"]["seq_dev"] > 0])


def verdict_word(a: dict, b: dict) -> str:
    return {"better": "yes", "worse": "no (the opposite)", "within": "within the seed spread"}[
        compare_means(a, b)]


def claims(cells: dict, what: str, pair: tuple[str, str]) -> list[str]:
    """The verdict lines for one (token-level, sequence-level) pair."""
    lines, gap = [], lambda rows: mech.gap_verdict(rows, *pair)
    for name in (n for n in LENGTHS if n in cells):
        gaps = {k: gap(rows_at(cells[name], "steps", k)) for k in (1, 2, 4, 8)}
        lines.append(f"* Off-policy degree, {name}, {what}: snr {pair[1]} / snr {pair[0]} at k = 1, 2, "
                     "4, 8: " + ", ".join(pm(g["gap"], ".3g") for g in gaps.values())
                     + f" (exactly 1 at k = 0). Token-level noisier at k = 8 beyond the seed spread? "
                     f"**{gaps[8]['verdict']}**")
    if "short" in cells and "long" in cells:
        for k in (1, 8):
            a = gap_stat(rows_at(cells["long"], "steps", k), pair)
            b = gap_stat(rows_at(cells["short"], "steps", k), pair)
            lines.append(f"* Length, k = {k}, {what}: snr {pair[1]} / snr {pair[0]} larger at the long "
                         f"than at the short job? **{verdict_word(a, b)}** (long {pm(a, '.3g')}, "
                         f"short {pm(b, '.3g')}).")
    for name in (n for n in MOES if n in cells):
        for replay in (False, True):
            gaps = {lv: gap(rows_at(cells[name], "routing", lv, replay)) for lv in mech.ROUTING[1:]}
            lines.append(f"* Routing change, {name}, {'with' if replay else 'without'} replay, {what}: "
                         f"snr {pair[1]} / snr {pair[0]} at 5, 10, 20, 30% changed: "
                         + ", ".join(pm(g["gap"], ".3g") for g in gaps.values())
                         + f". Token-level noisier at 30% beyond the seed spread? "
                         f"**{gaps[0.3]['verdict']}**")
    return lines


def dispersion_claims(cells: dict) -> list[str]:
    """The ratio-dispersion verdict lines: token spread / sequence deviation against length and
    routing change."""
    lines = []
    for k in (1, 8) if "short" in cells and "long" in cells else ():
        a, b = (dispersion_ratio(rows_at(cells["long"], "steps", k)),
                dispersion_ratio(rows_at(cells["short"], "steps", k)))
        lines.append(f"* Length, ratio dispersion at k = {k}: token spread / sequence deviation larger "
                     f"at the long than at the short job? **{verdict_word(a, b)}** (long {pm(a, '.3g')}, "
                     f"short {pm(b, '.3g')}).")
    for name in (n for n in MOES if n in cells):
        a = dispersion_ratio(rows_at(cells[name], "routing", 0.3))
        b = dispersion_ratio(rows_at(cells[name], "routing", 0.05))
        lines.append(f"* Routing change, {name}, ratio dispersion without replay: token spread / "
                     f"sequence deviation larger at 30% than at 5%? **{verdict_word(a, b)}** "
                     f"(30%: {pm(a, '.3g')}, 5%: {pm(b, '.3g')}).")
    return lines


def report(out: Path) -> str:
    cells = {n: json.loads((out / f"{n}.json").read_text()) for n in CELLS if (out / f"{n}.json").is_file()}
    lines = ["# The mechanism, measured: token- vs sequence-level importance weights", "",
             "Generated by `python benchmarks/mechanism.py --report` from the cell files beside it. "
             "Every value is mean ± std over the seeds (one sampled batch a seed). snr: norm of the "
             "mean minibatch gradient over the spread of minibatch gradients (B = N/4 responses, "
             "drawn without replacement, closed form); cos: mean cosine of a minibatch gradient to "
             "the full-batch gradient; token spread: within-response std of log r_it; seq dev: "
             "|log s_i|; tokens out (grpo): share of tokens with r_it outside [0.8, 1.27]; seqs out "
             "(gspo): share of responses with s_i outside [1-3e-4, 1+4e-4].", ""]
    verdicts = []
    for name, cell in cells.items():
        lines += [f"## {name} ({cell['preset']}, {' '.join([cell['config'], *cell['overrides']])})",
                  "", f"N = {cell['prompts']} prompts x {cell['group_size']}, mean response length "
                  f"{mech.median_length(cell['rows']):.1f} tokens (median over rows), lr {cell['lr']:g}, "
                  f"cold start: {cell['sft_steps']} SFT steps.", "", *mech.table(cell["rows"]), ""]
    for what, pair in PAIRS.items():
        verdicts += claims(cells, what, pair)
    verdicts += dispersion_claims(cells)
    lines += ["## Verdicts", "", "Computed as in `gspo compare`: a difference counts when it exceeds "
              "the sum of the two seed standard deviations.", "", *verdicts]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps({"verdicts": verdicts}, indent=1))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cell", choices=sorted(CELLS))
    parser.add_argument("--report", action="store_true")
    parser.add_argument("--out", default="docs/results/mechanism")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.cell:
        print(run_cell(args.cell, out, args.seeds, args.prompts))
    if args.report:
        print(report(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
