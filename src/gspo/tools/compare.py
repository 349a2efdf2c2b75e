"""Equal-budget comparison of objectives: ``gspo compare SUITE.yaml [--seeds K] [--quick]``.

A suite names one base config, the overrides every variant shares (the budget: task, prompts per
step, group size, max tokens, minibatches, steps) and the variants, which change only the
objective, its clip range and switches such as routing replay.

1. Tuning (the suite's ``tune.grid``): each listed variant's candidate overrides (its clip range)
   are trained at the same budget into ``OUT/tune/<variant>/c<i>/seed<k>/`` and scored on the
   task's *validation* split (``eval.split=validation``); the best candidate joins the variant's
   overrides. The test split is never looked at to choose.
2. Test runs: each variant x seed into ``OUT/<variant>/seed<k>/``, evaluated on the test split.

Runs go one after another, or ``jobs`` at a time as ``gspo train`` processes (each with cores /
jobs threads, its output in ``OUT/logs/``); a finished run whose resolved config is unchanged is reused. Then ``OUT/results.json``,
``OUT/report.md`` and ``OUT/plots/*.png`` are written from the runs' ``metrics.jsonl`` and
``summary.json``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import sys
import time
import subprocess
from pathlib import Path
from typing import Callable

import yaml
from pydantic import Field, ValidationError

from gspo.config import (ConfigError, Section, TrainConfig, dump_yaml, format_validation_error,
                         load_config, read_yaml)
from gspo.errors import UserError
from gspo.observe.metrics import read_metrics
from gspo.tools.compare_report import write_report
from gspo.training import provenance
from gspo.tools.compare_stats import (CRASH_DEFAULTS, aggregate, axis_differences, compare_means,
                                      eval_series, pm, run_stats)
from gspo.training.cold_start import cache_key, cached_checkpoint
from gspo.training.trainer import Trainer

# --------------------------------------------------------------------------------- suite format


class BaseSpec(Section):
    config: str
    """Training config every variant starts from (relative to the cwd or the suite's folder)."""
    overrides: list[str] = []
    """key=value overrides shared by all variants (added to the suite's top-level overrides)."""


class Variant(Section):
    name: str
    """Folder name under OUT and the label in tables and plots."""
    overrides: list[str] = []
    """What differs from the other variants: objective.name, its clip range, moe.routing_replay."""


class Tune(Section):
    grid: dict[str, list[list[str]]] = {}
    """Variant name -> candidate override lists (e.g. its clip range), the paper default first; a variant not listed is not tuned."""
    seeds: int = Field(1, ge=1)
    """Seeds per candidate (0..K-1); the score is averaged over them."""
    last_evals: int = Field(3, ge=1)
    """A candidate's score: its mean validation accuracy over its last this-many evaluations (ties: the earlier candidate)."""
    overrides: list[str] = []
    """Overrides for the tuning runs only (before --quick's); eval.split=validation is always added."""


class Axis(Section):
    name: str
    """What the suite sweeps, e.g. length: the x of its difference plots."""
    values: dict[str, list[str]] = Field(min_length=2)
    """Value label -> the overrides that set it (e.g. long: [task.params.max_terms=14, ...]), in plot order. Every variant runs at every value, into OUT/<value>/<variant>/."""
    baseline: str
    """The variant every other one is compared against at each value (e.g. grpo)."""
    tune_at: str | None = None
    """Tune each variant once, at this value, and use its choice at every value (None: tune at every value)."""


class Suite(Section):
    base: str | BaseSpec
    """Base config path, or {config, overrides}."""
    overrides: list[str] = []
    """key=value overrides shared by all variants: the equal budget."""
    variants: list[Variant] = Field(min_length=1)
    """The compared variants; names must be unique."""
    quick: list[str] = []
    """Overrides that shrink the budget for --quick (sft.steps, train.steps, eval.n, ...), shared by all."""
    threshold: float = Field(0.5, ge=0, le=1)
    """Held-out accuracy for 'steps to reach' (the first evaluated step at or above it)."""
    collapse_min_gain: float = Field(0.05, ge=0)
    """A run whose best gain over the cold start is below this cannot collapse (evaluation noise)."""
    crash: dict[str, float] = {}
    """The crash rule's parameters (compare_stats.CRASH_DEFAULTS: min_gain, fall, reward_fraction, window, spike_factor, entropy_band); the defaults unless set."""
    gate: dict[str, float] = {}
    """Metric -> the least run mean that counts as the regime reached (e.g. moe/routing_change_rate: 0.05); the crash claim's precondition."""
    claims: dict[str, list[str]] = {}
    """Paper claims to judge -> the variant names they compare, e.g. {stability: [gspo, grpo]};
    a claim whose variants were not run is left out. Claims: ``available_claims()``."""
    tune: Tune = Tune()
    """Validation-split grid that picks each variant's hyper-parameters before the test runs."""
    axis: Axis | None = None
    """A sweep: the variants run at each of its values, claims are judged and differences to the baseline plotted per value."""


def load_suite(path: str | Path) -> Suite:
    try:
        suite = Suite.model_validate(read_yaml(path))
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, Suite, str(path))) from None
    names = [v.name for v in suite.variants]
    if len(set(names)) != len(names):
        raise ConfigError(f"{path}: variant names must be unique, got {names}")
    unknown = sorted(set(suite.tune.grid) - set(names))
    if unknown:
        raise ConfigError(f"{path}: tune.grid names variants {unknown} the suite does not have; valid: {names}")
    for name, candidates in suite.tune.grid.items():
        if not candidates:
            raise ConfigError(f"{path}: tune.grid.{name} lists no candidates")
    if unknown := sorted(set(suite.crash) - set(CRASH_DEFAULTS)):
        raise ConfigError(f"{path}: crash has no parameter {unknown}; valid: {', '.join(CRASH_DEFAULTS)}")
    for claim, roles in suite.claims.items():
        if claim not in CLAIMS:
            raise ConfigError(f"{path}: unknown claim {claim!r}; valid: {', '.join(CLAIMS)}")
        if len(roles) != CLAIMS[claim][0]:
            raise ConfigError(f"{path}: claim {claim!r} names {CLAIMS[claim][0]} variants, got {roles}")
    if suite.axis is not None:
        if suite.axis.baseline not in names:
            raise ConfigError(f"{path}: axis.baseline {suite.axis.baseline!r} is not a variant; valid: {names}")
        if suite.axis.tune_at is not None and suite.axis.tune_at not in suite.axis.values:
            raise ConfigError(f"{path}: axis.tune_at {suite.axis.tune_at!r} is not an axis value; "
                              f"valid: {list(suite.axis.values)}")
    return suite


def cell(value: str, variant: str) -> str:
    """The name of one variant at one axis value (also its folder under OUT)."""
    return f"{value}/{variant}"


def expand(suite: Suite) -> tuple[Suite, dict[str, str]]:
    """The suite with its variants crossed with its axis values (cells named ``value/variant``,
    the value's overrides first), its grid over the cells that are tuned, and for each cell the
    cell whose tuning it uses (itself, or the same variant at ``axis.tune_at``). Without an axis:
    the suite as it is, every variant its own source."""
    if suite.axis is None:
        return suite, {v.name: v.name for v in suite.variants}
    axis, variants, grid, source = suite.axis, [], {}, {}
    for value, overrides in axis.values.items():
        for v in suite.variants:
            name = cell(value, v.name)
            variants.append(Variant(name=name, overrides=[*overrides, *v.overrides]))
            at = axis.tune_at or value
            source[name] = cell(at, v.name)
            if v.name in suite.tune.grid and at == value:
                grid[name] = suite.tune.grid[v.name]
    tune = suite.tune.model_copy(update={"grid": grid})
    return suite.model_copy(update={"variants": variants, "tune": tune}), source


def _find(path: str, suite_file: Path) -> Path:
    """``path`` as given (cwd), else relative to the suite's folder or one of its parents."""
    for root in [Path.cwd(), *suite_file.resolve().parents]:
        if (root / path).is_file():
            return root / path
    raise ConfigError(f"{suite_file}: base config {path} not found")


def resolve(suite: Suite, suite_file: Path, variant: Variant, seed: int, out: Path, *,
            quick: bool, extra: list[str] = (), candidate: int | None = None,
            chosen: list[str] = ()) -> TrainConfig:
    """One run's config: base file < shared overrides < (tuning: tune.overrides) < quick < extra
    (CLI) < variant < its chosen or candidate overrides < (tuning: eval.split=validation) < seed
    and run folder. ``candidate`` i: the i-th tuning run of the variant, else a test run."""
    base = suite.base if isinstance(suite.base, BaseSpec) else BaseSpec(config=suite.base)
    tuning = candidate is not None
    if tuning:
        run_dir = out / "tune" / variant.name / f"c{candidate}" / f"seed{seed}"
        own = [*suite.tune.grid[variant.name][candidate], "eval.split=validation"]
    else:
        run_dir, own = out / variant.name / f"seed{seed}", list(chosen)
    overrides = [*base.overrides, *suite.overrides, *(suite.tune.overrides if tuning else []),
                 *(suite.quick if quick else []), *extra, *variant.overrides, *own,
                 f"seed={seed}", f"run.dir={run_dir}", "run.overwrite=true", "run.progress=false"]
    return load_config(_find(base.config, suite_file), overrides)


# --------------------------------------------------------------------------------- running

def _recorded_config(run_dir: Path) -> dict | None:
    """The config.yaml of a finished run (summary.json written); None if either file is missing."""
    if not (run_dir / "summary.json").is_file() or not (run_dir / "config.yaml").is_file():
        return None
    return yaml.safe_load((run_dir / "config.yaml").read_text())


def _finished(cfg: TrainConfig) -> bool:
    """summary.json exists and config.yaml is this very config: the run can be reused."""
    return _recorded_config(Path(cfg.run.dir)) == cfg.model_dump(mode="json")


def _agree(old, new) -> bool:
    """The keys both configs have hold equal values (a run written by older code lacks newer keys,
    which then hold their defaults)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return all(_agree(old[k], new[k]) for k in old.keys() & new.keys())
    return old == new


def require_finished(runs: dict[str, TrainConfig]) -> None:
    """--report-only: every run has finished, and its config agrees with the resolved one on every
    key both have; else one UserError naming the first that does not."""
    for label, cfg in runs.items():
        run_dir = Path(cfg.run.dir)
        recorded = _recorded_config(run_dir)
        if recorded is None:
            raise UserError(f"compare --report-only: {label} has not finished ({run_dir}); run "
                            "the suite without --report-only")
        if not _agree(recorded, cfg.model_dump(mode="json")):
            raise UserError(f"compare --report-only: {label}: {run_dir}/config.yaml is not the "
                            "suite's config for that run")


def _command(kind: str, config_file: Path) -> list[str]:
    """The command line of one job: ``gspo sft`` (the cold start only) or ``gspo train``."""
    return [sys.executable, "-m", "gspo.cli", "sft" if kind == "cold_start" else "train", str(config_file)]


def _cold_start_key(cfg: TrainConfig) -> str | None:
    if cfg.model.path or not cfg.sft.enabled or cfg.sft.steps == 0:
        return None
    key = cache_key(cfg.model, cfg.task, cfg.sft, cfg.seed, cfg.multiturn)
    return None if cached_checkpoint(cfg.sft.cache_dir, key) else key


def train_all(runs: dict[str, TrainConfig], jobs: int, log: Callable[[str], None],
              logs: Path) -> None:
    """Train every unfinished run: in this process (jobs=1) or as ``jobs`` parallel ``gspo``
    processes, each with cores / jobs torch threads and its output in ``logs/<run>.log``.

    A worker is the same ``gspo train CONFIG`` a user would type, fed the resolved config as
    YAML, so nothing but files crosses between processes. The cold starts the runs need and the
    cache lacks are trained first, once per cache key, so that two workers never train the same
    one at once.
    """
    todo = {}
    for label, cfg in runs.items():
        if _finished(cfg):
            log(f"compare: {label}: reusing {cfg.run.dir}")
        else:
            todo[label] = cfg
    if not todo:
        return
    if jobs == 1:
        for label, cfg in todo.items():
            log(f"compare: {label}: training into {cfg.run.dir}")
            t0 = time.perf_counter()
            Trainer(cfg, log=lambda m: None).run()
            log(f"compare: {label}: done in {time.perf_counter() - t0:.0f} s")
        return
    cold = {}
    for label, cfg in todo.items():
        if (key := _cold_start_key(cfg)) is not None:
            cold.setdefault(key, (f"cold start {key}", cfg))
    threads = max(1, (os.cpu_count() or 1) // jobs)
    for kind, batch in (("cold_start", dict(cold.values())), ("train", todo)):
        _run_parallel(kind, batch, jobs, threads, logs, log)


def _run_parallel(kind: str, batch: dict[str, TrainConfig], jobs: int, threads: int,
                  logs: Path, log: Callable[[str], None]) -> None:
    """Run ``batch`` ``jobs`` at a time; log each as it ends. After a failure no new job starts;
    those in flight finish (their runs are kept), then the failure is raised naming its log."""
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TQDM_DISABLE": "1"}
    queue, running, failed = list(batch.items()), {}, []
    while queue or running:
        while queue and len(running) < jobs and not failed:
            label, cfg = queue.pop(0)
            name = label.replace(" ", "_").replace("/", "-")
            config_file, log_file = logs / f"{name}.yaml", logs / f"{name}.log"
            dump_yaml(cfg, config_file)
            with log_file.open("w") as fh:
                proc = subprocess.Popen(_command(kind, config_file), stdout=fh, stderr=subprocess.STDOUT,
                                        env=env)
            running[proc] = (label, log_file, time.perf_counter())
            log(f"compare: {label}: started" + (f" (into {cfg.run.dir})" if kind == "train" else ""))
        if failed and not running:
            break
        time.sleep(0.5)
        for proc in [p for p in running if p.poll() is not None]:
            label, log_file, t0 = running.pop(proc)
            if proc.returncode == 0:
                log(f"compare: {label}: done in {time.perf_counter() - t0:.0f} s")
            else:
                lines = log_file.read_text(errors="replace").strip().splitlines() or ["(no output)"]
                log(f"compare: {label}: FAILED (exit {proc.returncode}): {lines[-1]}")
                failed.append(f"{label} failed (exit {proc.returncode}): {lines[-1]}; full output in {log_file}")
    if failed:
        raise UserError("compare: " + failed[0])


def tune_scores(suite: Suite, dirs: dict[int, list[Path]]) -> list[dict]:
    """Each candidate's overrides, per-seed and mean validation scores (``Tune.last_evals``)."""
    out = []
    for i, seeds in sorted(dirs.items()):
        per_seed, n_eval = [], []
        for run_dir in seeds:
            series = eval_series(read_metrics(run_dir))
            last = [a for _, a in series[1:]][-suite.tune.last_evals:] or [a for _, a in series]
            per_seed.append(statistics.fmean(last))
            summary = run_dir / "summary.json"
            if summary.is_file():
                n_eval.append(json.loads(summary.read_text())["eval_after"].get("n"))
        out.append({"candidate": i, "score": statistics.fmean(per_seed), "per_seed": per_seed,
                    "n_eval": min((n for n in n_eval if n), default=None),
                    "runs": [str(d) for d in seeds]})
    return out


def choose(scores: list[dict]) -> int:
    """Index of the best-scoring candidate; ties go to the earlier one (the paper default first)."""
    return max(range(len(scores)), key=lambda i: (scores[i]["score"], -i))


def run_suite(suite_file: str | Path, *, seeds: int = 3, quick: bool = False,
              out: str | Path | None = None, extra: list[str] = (),
              only: list[str] | None = None, tune: bool = True, jobs: int = 1,
              allow_mixed_commits: bool = False, report_only: bool = False,
              log: Callable[[str], None] | None = None) -> Path:
    """Tune (validation split), train every variant x seed (reusing finished runs), then write
    results and report. ``report_only``: train nothing, write them from the finished runs (which
    may come from older code; see ``require_finished``). Runs made by different code (``gspo.training.provenance.code_id``) are
    refused unless ``allow_mixed_commits``."""
    log = log or (lambda m: print(m, file=sys.stderr))
    suite_file = Path(suite_file)
    suite, source = expand(load_suite(suite_file))
    variants = suite.variants
    if only:  # variant names, or with an axis also value/variant cells
        names = {v.name for v in variants} | {v.name.rpartition("/")[2] for v in variants}
        unknown = sorted(set(only) - names)
        if unknown:
            raise ConfigError(f"--variants: unknown {unknown}; valid: {sorted(names)}")
        variants = [v for v in variants if {v.name, v.name.rpartition("/")[2]} & set(only)]
    out = Path(out or Path("runs/compare") / (suite_file.stem + ("-quick" if quick else "")))

    def config(v: Variant, k: int, **kw) -> TrainConfig:
        return resolve(suite, suite_file, v, k, out, quick=quick, extra=extra, **kw)

    needed = {source[v.name] for v in variants}
    tuned = [v for v in suite.variants if tune and v.name in suite.tune.grid and v.name in needed]
    grid = {(v.name, i, k): config(v, k, candidate=i) for v in tuned
            for i in range(len(suite.tune.grid[v.name])) for k in range(suite.tune.seeds)}
    for v in variants:  # every test config validates before the first run (with any candidate)
        for cand in suite.tune.grid.get(source[v.name], [[]]) if tune else [[]]:
            config(v, 0, chosen=cand)
    if not report_only:  # the suite's own record stays that of the command that trained it
        provenance.write(out, provenance.collect(command="compare", extra={"suite": {
            "file": str(suite_file), "sha256": hashlib.sha256(suite_file.read_bytes()).hexdigest(),
            "seeds": seeds, "quick": quick, "extra": list(extra), "tune": tune,
            "variants": [v.name for v in variants]}}))
    train = (lambda runs, *_: require_finished(runs)) if report_only else train_all
    train({f"tune {n} candidate {i} seed {k}": c for (n, i, k), c in grid.items()}, jobs, log,
          out / "logs")
    tuning, chosen = {}, {}
    for v in tuned:
        scores = tune_scores(suite, {i: [Path(grid[v.name, i, k].run.dir) for k in range(suite.tune.seeds)]
                                     for i in range(len(suite.tune.grid[v.name]))})
        best = choose(scores)
        chosen[v.name] = suite.tune.grid[v.name][best]
        for s in scores:
            s["overrides"] = suite.tune.grid[v.name][s["candidate"]]
        tuning[v.name] = {"candidates": scores, "chosen": best, "chosen_overrides": chosen[v.name]}
        log(f"compare: tuned {v.name}: {' '.join(chosen[v.name])} (validation score "
            f"{scores[best]['score']:.3f})")
    chosen = {v.name: chosen[source[v.name]] for v in variants if source[v.name] in chosen}
    configs = {(v.name, k): config(v, k, chosen=chosen.get(v.name, [])) for v in variants for k in range(seeds)}
    train({f"{n} seed {k}": c for (n, k), c in configs.items()}, jobs, log, out / "logs")
    runs = {v.name: [Path(configs[v.name, k].run.dir) for k in range(seeds)] for v in variants}
    code = one_code({**{f"tune {n} candidate {i} seed {k}": Path(c.run.dir)
                        for (n, i, k), c in grid.items()},
                     **{f"{n} seed {k}": Path(c.run.dir) for (n, k), c in configs.items()}},
                    allow_mixed_commits, log)
    results = collect(suite, runs, quick=quick, suite_file=str(suite_file), extra=list(extra),
                      chosen=chosen)
    results["code"] = code
    results["tuning"] = {"enabled": tune, "seeds": suite.tune.seeds, "last_evals": suite.tune.last_evals,
                         "overrides": suite.tune.overrides, "variants": tuning}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    write_report(results, runs, out)
    return out


def one_code(runs: dict[str, Path], allow_mixed: bool, log: Callable[[str], None]) -> dict:
    """{code id: run labels} of the runs (``gspo.training.provenance.mixed_code``); more than one code is
    a UserError naming them, or with ``allow_mixed`` a logged warning."""
    by_code = provenance.mixed_code(runs)
    if len(by_code) > 1:
        def some(labels: list[str]) -> str:
            more = f" and {len(labels) - 3} more" if len(labels) > 3 else ""
            return ", ".join(labels[:3]) + more
        what = "; ".join(f"{code}: {some(labels)}" for code, labels in by_code.items())
        if not allow_mixed:
            raise UserError(f"compare: the runs come from different code ({what}); retrain the "
                            "stale ones (remove their folders) or pass --allow-mixed-commits")
        log(f"compare: warning: mixing runs of different code ({what})")
    return by_code


def collect(suite: Suite, runs: dict[str, list[Path]], chosen: dict[str, list[str]] | None = None,
            **meta) -> dict:
    """results.json's body: per variant its overrides (with the tuned ones), runs and summary."""
    chosen, variants = chosen or {}, {}
    for v in suite.variants:
        if v.name not in runs:
            continue
        per_seed = []
        for run_dir in runs[v.name]:
            summary = json.loads((run_dir / "summary.json").read_text())
            cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
            summary["rollout_size"] = cfg["rollout"]["prompts_per_step"] * cfg["rollout"]["group_size"]
            per_seed.append(run_stats(read_metrics(run_dir), summary, suite.threshold,
                                      suite.collapse_min_gain, suite.crash, suite.gate))
        variants[v.name] = {"overrides": v.overrides, "tuned_overrides": chosen.get(v.name, []),
                            "runs": per_seed, "summary": aggregate(per_seed)}
    results = {**meta, "quick_overrides": suite.quick, "threshold": suite.threshold, "collapse_min_gain": suite.collapse_min_gain,
               "crash_rule": {**CRASH_DEFAULTS, **suite.crash}, "gate": suite.gate,
               "shared_overrides": suite.overrides, "variants": variants}
    results["claims"] = judge_claims(suite.claims, variants)
    if suite.axis is not None:
        axis = suite.axis
        for value in axis.values:
            at_value = {name.rpartition("/")[2]: v for name, v in variants.items()
                        if name.rpartition("/")[0] == value}
            results["claims"] += [{**c, "value": value, "variants": [cell(value, r) for r in c["variants"]]}
                                  for c in judge_claims(suite.claims, at_value)]
        results["axis"] = {"name": axis.name, "values": list(axis.values), "baseline": axis.baseline,
                           "tune_at": axis.tune_at,
                           "differences": axis_differences(variants, list(axis.values), axis.baseline)}
    return results


# --------------------------------------------------------------------------------- claims
# A difference of means counts only when it exceeds the seeds' spread: |Δ| > std_a + std_b
# (sample std over seeds). With one seed there is no spread, and every comparison is inconclusive.

INCONCLUSIVE = "inconclusive (difference within seed spread)"
NOT_APPLICABLE = "not applicable (neither clipped a token: every ratio was 1, on-policy)"


SPEED = {"better": "GSPO faster", "worse": "GSPO slower", "within": "within the seed spread"}


def claim_stability(gspo: dict, grpo: dict) -> tuple[str, str]:
    """GSPO trains more stably and efficiently than GRPO (Fig. 1)."""
    g, r = gspo["summary"], grpo["summary"]
    acc = compare_means(g["best_accuracy"], r["best_accuracy"])
    stable = g["collapses"] <= r["collapses"]
    verdict = ("held" if acc == "better" and stable else
               "did not hold" if acc == "worse" or g["collapses"] > r["collapses"] else INCONCLUSIVE)
    return verdict, (f"best held-out accuracy {pm(g['best_accuracy'])} vs {pm(r['best_accuracy'])}, "
                     f"final {pm(g['final_accuracy'])} vs {pm(r['final_accuracy'])}, collapses "
                     f"{g['collapses']}/{g['seeds']} vs {r['collapses']}/{r['seeds']}, reached the "
                     f"threshold {g['reached_threshold']}/{g['seeds']} vs "
                     f"{r['reached_threshold']}/{r['seeds']} (steps to it "
                     f"{pm(g['steps_to_threshold'], '.0f')} vs {pm(r['steps_to_threshold'], '.0f')}, "
                     f"{SPEED[compare_means(r['steps_to_threshold'], g['steps_to_threshold'])]})")


CLIP_FACTOR = 10.0  # "far more": at least an order of magnitude (the paper reports about two)


def claim_clipping(gspo: dict, grpo: dict) -> tuple[str, str]:
    """GSPO clips far more tokens than GRPO yet learns as well or better (Fig. 2)."""
    g, r = gspo["summary"], grpo["summary"]
    cg, cr = g["clip_frac_tokens"]["mean"], r["clip_frac_tokens"]["mean"]
    factor = cg / cr if cg is not None and cr else float("inf") if cg else None
    acc = compare_means(g["final_accuracy"], r["final_accuracy"])
    more = factor is not None and factor >= CLIP_FACTOR
    verdict = (NOT_APPLICABLE if not cg and not cr else
               "did not hold" if not more or acc == "worse" else
               "held" if min(g["seeds"], r["seeds"]) > 1 else INCONCLUSIVE)
    ftxt = "n/a" if factor is None else "GRPO clipped none" if factor == float("inf") else f"{factor:.1f}x"
    return verdict, (f"clipped fraction of tokens {pm(g['clip_frac_tokens'], '.4f')} vs "
                     f"{pm(r['clip_frac_tokens'], '.4f')} ({ftxt}; 'far more' means >= "
                     f"{CLIP_FACTOR:.0f}x), final accuracy {pm(g['final_accuracy'])} vs "
                     f"{pm(r['final_accuracy'])} ({'as well or better' if acc != 'worse' else 'worse'})")


def claim_routing_replay(gspo: dict, grpo: dict, grpo_replay: dict) -> tuple[str, str]:
    """MoE: GSPO trains stably without Routing Replay, GRPO needs it (Fig. 3)."""
    g, r, rr = gspo["summary"], grpo["summary"], grpo_replay["summary"]
    gspo_stable = g["collapses"] == 0 and (g["final_accuracy"]["mean"] or 0) >= (g["cold_accuracy"]["mean"] or 0)
    acc = compare_means(rr["final_accuracy"], r["final_accuracy"])
    needs = r["collapses"] > rr["collapses"] or acc == "better"
    verdict = ("held" if gspo_stable and needs else
               "did not hold" if not gspo_stable or acc == "worse" else INCONCLUSIVE)
    return verdict, (f"GSPO without replay: collapses {g['collapses']}/{g['seeds']}, final "
                     f"{pm(g['final_accuracy'])} from cold start {pm(g['cold_accuracy'])}; GRPO "
                     f"without / with replay: final {pm(r['final_accuracy'])} / "
                     f"{pm(rr['final_accuracy'])}, collapses {r['collapses']}/{r['seeds']} / "
                     f"{rr['collapses']}/{rr['seeds']}")


CRASH_MAJORITY, CRASH_FEW = 0.6, 0.2  # "GRPO in >= 3 of 5 seeds, GSPO in <= 1"


def paired_final(a: dict, b: dict) -> dict:
    """a − b of the final accuracy over the seeds both ran: mean, sample std, and two standard
    errors of one evaluation's difference, 2·sqrt(pa(1−pa)/n + pb(1−pb)/n) at the means."""
    fa = {r["seed"]: r for r in a["runs"]}
    pairs = [(fa[r["seed"]], r) for r in b["runs"] if r["seed"] in fa]
    if not pairs:
        return {"diff": None, "std": None, "two_se": None, "n": 0}
    diffs = [x["final_accuracy"] - y["final_accuracy"] for x, y in pairs]
    pa = statistics.fmean(x["final_accuracy"] for x, _ in pairs)
    pb = statistics.fmean(y["final_accuracy"] for _, y in pairs)
    n = min((x.get("eval_n") or 0) for pair in pairs for x in pair)
    two_se = 2 * math.sqrt(pa * (1 - pa) / n + pb * (1 - pb) / n) if n else None
    return {"diff": statistics.fmean(diffs), "std": statistics.stdev(diffs) if len(diffs) > 1 else 0.0,
            "two_se": two_se, "n": len(pairs)}


def claim_crash(gspo: dict, grpo: dict, grpo_tight: dict) -> tuple[str, str]:
    """Where GRPO crashes (sampler mismatch, routing churn), GSPO holds; a tightly clipped GRPO
    controls for GSPO's tight clip. Verdicts: regime not reached | reproduced | refuted at this
    scale | inconclusive (docs/compare.md, "Crashes")."""
    g, r, t = gspo["summary"], grpo["summary"], grpo_tight["summary"]
    paired = paired_final(gspo, grpo)
    reached = all(s["gate_reached"] * 2 > s["seeds"] for s in (g, r))     # a majority of each arm's runs
    beyond = (paired["diff"] is not None and paired["two_se"] is not None
              and paired["diff"] > max(paired["std"], paired["two_se"]))
    against = (paired["diff"] is not None and paired["two_se"] is not None
               and -paired["diff"] > max(paired["std"], paired["two_se"]))
    if not reached:
        verdict = "regime not reached"
    elif (r["crashes"] >= CRASH_MAJORITY * r["seeds"] and g["crashes"] <= CRASH_FEW * g["seeds"]
          and beyond and t["crashes"] > g["crashes"]):
        verdict = "reproduced"
    elif (r["crashes"] and g["crashes"] >= r["crashes"]) or against:
        verdict = "refuted at this scale"
    else:
        verdict = "inconclusive"
    return verdict, (f"gate reached in {g['gate_reached']}/{g['seeds']} GSPO and {r['gate_reached']}/"
                     f"{r['seeds']} GRPO runs; crashes GSPO {g['crashes']}/{g['seeds']}, GRPO "
                     f"{r['crashes']}/{r['seeds']}, tight-clip GRPO {t['crashes']}/{t['seeds']}; "
                     f"paired final GSPO − GRPO {_num(paired['diff'], '+.3f')} (seed std "
                     f"{_num(paired['std'])}, two evaluation SEs {_num(paired['two_se'])}, "
                     f"{paired['n']} seeds)")


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "n/a" if x is None else format(x, fmt)


# claim -> (number of variants, judge, the claim as the report states it)
CLAIMS: dict[str, tuple[int, Callable, str]] = {
    "stability": (2, claim_stability, "GSPO trains more stably and efficiently than GRPO (Fig. 1)"),
    "clipping": (2, claim_clipping, "GSPO clips far more tokens than GRPO yet learns as well or better (Fig. 2)"),
    "routing_replay": (3, claim_routing_replay, "MoE: GSPO trains stably without Routing Replay "
                                                "while GRPO needs it (Fig. 3)"),
    "crash": (3, claim_crash, "Where GRPO crashes (sampler/trainer mismatch, routing churn), GSPO "
                              "holds, and not only by clipping tightly"),
}


def available_claims() -> list[str]:
    return list(CLAIMS)


def judge_claims(claims: dict[str, list[str]], variants: dict) -> list[dict]:
    out = []
    for claim, roles in claims.items():
        if not all(name in variants for name in roles):
            continue  # e.g. --variants left one out
        _, judge, text = CLAIMS[claim]
        verdict, numbers = judge(*(variants[name] for name in roles))
        out.append({"claim": claim, "statement": text, "variants": roles, "verdict": verdict,
                    "numbers": numbers})
    return out

