"""gspo compare: aggregation on hand-made metric rows, claim verdicts, and one --quick suite end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gspo.tools import compare, compare_stats
from gspo.cli import main

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------- aggregation
def test_mean_std_is_sample_std_and_skips_none():
    # values 0.2, 0.4, 0.6: mean 0.4, sample var ((-.2)^2 + 0 + .2^2) / (3-1) = 0.04 -> std 0.2
    s = compare_stats.mean_std([0.2, None, 0.4, 0.6])
    assert s["mean"] == pytest.approx(0.4) and s["std"] == pytest.approx(0.2)
    assert (s["min"], s["max"], s["n"]) == (0.2, 0.6, 3)
    assert compare_stats.mean_std([0.5])["std"] == 0.0
    assert compare_stats.mean_std([None])["mean"] is None


def _rows(accs: dict[int, float], clip: float = 0.1) -> list[dict]:
    """Metric rows: step 0 the cold start, then RL steps with time, length, clip and some evals."""
    rows = [{"step": 0, "eval/accuracy": accs[0]}]
    for s in range(1, max(accs) + 1):
        row = {"step": s, "time/step_s": 0.5, "response/length_mean": 4.0,
               "policy/clip_frac_tokens": clip}
        if s in accs:
            row["eval/accuracy"] = accs[s]
        rows.append(row)
    return rows


def test_steps_to_threshold_is_first_evaluated_step_at_or_above():
    series = compare_stats.eval_series(_rows({0: 0.1, 2: 0.4, 4: 0.5, 6: 0.7}))
    assert series == [(0, 0.1), (2, 0.4), (4, 0.5), (6, 0.7)]
    assert compare_stats.steps_to(series, 0.5) == 4      # equal counts
    assert compare_stats.steps_to(series, 0.9) is None


@pytest.mark.parametrize("accs, collapsed", [
    # cold 0.2, best 0.6 (gain 0.4): the bar is 0.2 + 0.4/2 = 0.4
    ({0: 0.2, 2: 0.6, 4: 0.3}, True),              # ends at 0.3 < 0.4: collapsed
    ({0: 0.2, 2: 0.6, 4: 0.3, 6: 0.45}, False),    # fell, recovered above 0.4 by the end
    ({0: 0.2, 2: 0.6, 4: 0.4}, False),             # exactly at the bar is not below it
    ({0: 0.2, 2: 0.23, 4: 0.0}, False),            # gain 0.03 < min_gain 0.05: noise, not a collapse
    ({0: 0.5, 2: 0.3}, False),                     # never gained: nothing to collapse from
])
def test_collapse(accs, collapsed):
    assert compare_stats.collapsed(compare_stats.eval_series(_rows(accs)), min_gain=0.05) is collapsed


def test_run_stats_and_aggregate():
    summary = {"seed": 0, "eval_after": {"accuracy": 0.3}, "wall_s": 9.0, "rollout_size": 8}
    r = compare_stats.run_stats(_rows({0: 0.2, 2: 0.6, 4: 0.3}, clip=0.25), summary, 0.5, 0.05)
    assert (r["cold_accuracy"], r["best_accuracy"], r["best_step"]) == (0.2, 0.6, 2)
    assert r["steps_to_threshold"] == 2 and r["collapsed"] is True
    assert r["clip_frac_tokens"] == pytest.approx(0.25)
    # 4 steps x 0.5 s = 2 s; tokens 4 steps x 4.0 mean length x 8 responses = 128 -> 64 tokens/s
    assert r["train_s"] == 2.0 and r["tokens_per_s"] == 64.0
    r2 = {**r, "seed": 1, "final_accuracy": 0.5, "steps_to_threshold": None, "collapsed": False}
    agg = compare_stats.aggregate([r, r2])
    assert agg["final_accuracy"]["mean"] == pytest.approx(0.4)
    assert agg["steps_to_threshold"]["mean"] == 2 and agg["reached_threshold"] == 1
    assert agg["collapses"] == 1 and agg["seeds"] == 2


def test_run_stats_means_response_length_and_routing_change_over_steps():
    rows = _rows({0: 0.2, 2: 0.4})
    rows[1]["moe/routing_change_rate"], rows[2]["moe/routing_change_rate"] = 0.1, 0.3
    rows[2]["response/length_mean"] = 8.0                   # steps 1, 2: lengths 4 and 8
    summary = {"seed": 0, "eval_after": {"accuracy": 0.4}, "wall_s": 1.0, "rollout_size": 8}
    r = compare_stats.run_stats(rows, summary, 0.5, 0.05)
    assert r["routing_change_rate"] == pytest.approx(0.2) and r["response_length"] == pytest.approx(6.0)
    assert compare_stats.run_stats(_rows({0: 0.2}), summary, 0.5, 0.05)["routing_change_rate"] is None


# --------------------------------------------------------------------------------- claims
def _variant(finals: list[float], clip: float, collapses: int = 0) -> dict:
    runs = [{"cold_accuracy": 0.1, "final_accuracy": f, "best_accuracy": f, "steps_to_threshold": None,
             "clip_frac_tokens": clip, "wall_s": 1.0, "train_s": 1.0, "tokens_per_s": 1.0,
             "collapsed": i < collapses} for i, f in enumerate(finals)]
    return {"summary": compare_stats.aggregate(runs)}


def test_compare_means_needs_two_seeds_and_a_gap_beyond_the_spread():
    a, b = compare_stats.mean_std([0.6, 0.62]), compare_stats.mean_std([0.3, 0.32])
    assert compare_stats.compare_means(a, b) == "better" and compare_stats.compare_means(b, a) == "worse"
    assert compare_stats.compare_means(a, compare_stats.mean_std([0.55, 0.65])) == "within"
    assert compare_stats.compare_means(compare_stats.mean_std([0.9]), compare_stats.mean_std([0.1])) == "within"


def test_claim_verdicts_from_numbers():
    gspo, grpo = _variant([0.6, 0.62], clip=0.2), _variant([0.3, 0.32], clip=0.001, collapses=1)
    assert compare.claim_stability(gspo, grpo)[0] == "held"
    assert compare.claim_stability(grpo, gspo)[0] == "did not hold"
    assert compare.claim_clipping(gspo, grpo)[0] == "held"          # 200x more, and better
    assert compare.claim_clipping(grpo, gspo)[0] == "did not hold"  # clips less
    on_policy = _variant([0.6, 0.62], clip=0.0)                     # M = 1: every ratio is 1
    assert compare.claim_clipping(on_policy, on_policy)[0] == compare.NOT_APPLICABLE
    same = _variant([0.5, 0.6], clip=0.2)
    assert compare.claim_stability(same, _variant([0.5, 0.6], clip=0.2))[0] == compare.INCONCLUSIVE
    replay = _variant([0.6, 0.61], clip=0.001)
    assert compare.claim_routing_replay(gspo, grpo, replay)[0] == "held"
    assert compare.claim_routing_replay(grpo, gspo, replay)[0] == "did not hold"  # 'gspo' collapsed


def test_suite_errors_name_the_problem(tmp_path):
    bad = tmp_path / "s.yaml"
    bad.write_text("base: configs/default.yaml\nvariants: [{name: a}, {name: a}]\n")
    with pytest.raises(compare.ConfigError, match="unique"):
        compare.load_suite(bad)
    bad.write_text("base: configs/default.yaml\nvariants: [{name: a}]\nclaims: {stabilty: [a, a]}\n")
    with pytest.raises(compare.ConfigError, match="unknown claim 'stabilty'"):
        compare.load_suite(bad)
    bad.write_text("base: configs/default.yaml\nvariants: [{name: a}]\ntune: {grid: {b: [[seed=1]]}}\n")
    with pytest.raises(compare.ConfigError, match=r"tune.grid names variants \['b'\].*valid: \['a'\]"):
        compare.load_suite(bad)


def test_tune_score_is_mean_of_last_evaluations_and_ties_go_first(tmp_path):
    from gspo.observe.metrics import MetricsWriter
    suite = compare.Suite(base="x.yaml", variants=[{"name": "a"}], tune={"last_evals": 2})
    dirs = {}
    for i, accs in enumerate([{0: 0.1, 2: 0.9, 4: 0.3, 6: 0.5},     # last two: (0.3 + 0.5) / 2 = 0.4
                              {0: 0.1, 2: 0.2, 4: 0.4, 6: 0.4},     # 0.4: a tie, loses to c0
                              {0: 0.1, 2: 0.0}]):                    # one evaluation: 0.0
        w = MetricsWriter(tmp_path / f"c{i}")
        for row in _rows(accs):
            w.write(row)
        w.close()
        dirs[i] = [tmp_path / f"c{i}"]
    scores = compare.tune_scores(suite, dirs)
    assert [s["score"] for s in scores] == pytest.approx([0.4, 0.4, 0.0])
    assert compare.choose(scores) == 0
    scores[1]["score"] += 1e-9
    assert compare.choose(scores) == 1


@pytest.mark.parametrize("suite", sorted(p.stem for p in (REPO / "configs" / "compare").glob("*.yaml")))
def test_shipped_suites_resolve(suite, tmp_path):
    """Every configs/compare/*.yaml (not a hand list: stress.yaml's --quick budget once failed
    validation unnoticed): each variant's config, full and --quick, passes a run's validation."""
    path = REPO / "configs" / "compare" / f"{suite}.yaml"
    s, _ = compare.expand(compare.load_suite(path))
    for v in s.variants:
        for quick in (False, True):
            compare.resolve(s, path, v, 0, tmp_path, quick=quick)


# --------------------------------------------------------------------------------- end to end
TINY = ["sft.steps=20", "train.steps=3", "eval.n=8", "rollout.prompts_per_step=4",
        "rollout.group_size=4", "task.n_train=200", "task.n_test=50", "run.eval_every=1"]


def test_quick_suite_end_to_end_and_reuse(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)                  # the base config is found next to the suite
    out = tmp_path / "out"
    argv = ["compare", str(REPO / "configs/compare/dense.yaml"), *TINY,
            f"sft.cache_dir={tmp_path / 'cache'}", "--quick", "--seeds", "2",
            "--variants", "gspo,grpo", "--out", str(out)]
    assert main([*argv, "--jobs", "2"]) == 0     # worker processes: cold starts first, then runs
    results = json.loads((out / "results.json").read_text())
    assert set(results["variants"]) == {"gspo", "grpo"}
    for v in results["variants"].values():
        assert [r["seed"] for r in v["runs"]] == [0, 1]
        assert v["summary"]["final_accuracy"]["n"] == 2
    # the grid: 3 candidates each, scored on validation, the best used by the test runs
    suite = compare.load_suite(REPO / "configs/compare/dense.yaml")
    for name in ("gspo", "grpo"):
        tuned = results["tuning"]["variants"][name]
        assert [c["overrides"] for c in tuned["candidates"]] == suite.tune.grid[name]
        for c in tuned["candidates"]:
            run = json.loads((Path(c["runs"][0]) / "summary.json").read_text())
            assert run["eval_split"] == "validation" and run["steps"] == 3  # quick's steps win
        best = max(c["score"] for c in tuned["candidates"])
        assert tuned["candidates"][tuned["chosen"]]["score"] == best
        assert results["variants"][name]["tuned_overrides"] == tuned["chosen_overrides"]
        cfg = yaml.safe_load((out / name / "seed1" / "config.yaml").read_text())
        eps = {o.split("=")[0]: float(o.split("=")[1]) for o in tuned["chosen_overrides"]}
        assert cfg["objective"]["eps_low"] == eps["objective.eps_low"]
        assert cfg["eval"]["split"] == "test"
    report = (out / "report.md").read_text()
    assert {c["claim"] for c in results["claims"]} == {"stability", "clipping"}
    for c in results["claims"]:
        assert c["verdict"] in ("held", "did not hold", compare.INCONCLUSIVE)
        assert c["statement"] in report and c["verdict"] in report
    for png in ("reward_mean", "eval_accuracy", "eval_accuracy_vs_time", "policy_clip_frac_tokens",
                "policy_entropy", "response_length_mean", "optim_grad_norm"):
        assert (out / "plots" / f"{png}.png").stat().st_size > 0
    capsys.readouterr()
    assert main(argv) == 0                       # second time: every run is reused
    assert capsys.readouterr().err.count("reusing") == 4 + 6   # 2 x 2 test runs, 2 x 3 candidates
    assert "## Hyper-parameters" in report and "validation" in report


def test_parallel_failure_names_the_run_and_its_log(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    argv = ["compare", str(REPO / "configs/compare/dense.yaml"), *TINY, "model.path=missing-ckpt",
            "--seeds", "1", "--variants", "gspo,grpo", "--no-tune", "--jobs", "2", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "compare: gspo seed 0: FAILED (exit 2): gspo: error: model.path" in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("gspo: error: compare: ") and "logs/" in last and "Traceback" not in err
    assert not (out / "results.json").exists()

