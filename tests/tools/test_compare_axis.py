"""gspo compare with an axis: the variants crossed with the axis values, tuning at one value,
differences to the baseline per value (hand numbers), and a tiny swept suite end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gspo.cli import main
from gspo.config import ConfigError
from gspo.tools import compare, compare_stats

REPO = Path(__file__).resolve().parents[2]

SUITE = {
    "base": str(REPO / "configs/default.yaml"),
    "overrides": [],
    "axis": {"name": "length", "baseline": "grpo", "tune_at": "long",
             "values": {"short": ["rollout.max_new_tokens=4"], "long": ["rollout.max_new_tokens=8"]}},
    "variants": [{"name": "gspo", "overrides": ["objective.name=gspo"]},
                 {"name": "grpo", "overrides": ["objective.name=grpo"]}],
    "tune": {"grid": {"gspo": [["objective.eps_low=3e-4"], ["objective.eps_low=1e-4"]]}},
    "claims": {"stability": ["gspo", "grpo"]},
}


def _write(tmp_path: Path, suite: dict) -> Path:
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite, sort_keys=False))
    return path


def test_expand_crosses_values_and_tunes_once_at_tune_at(tmp_path):
    flat, source = compare.expand(compare.load_suite(_write(tmp_path, SUITE)))
    assert [v.name for v in flat.variants] == ["short/gspo", "short/grpo", "long/gspo", "long/grpo"]
    # the value's overrides come first, then the variant's
    assert flat.variants[0].overrides == ["rollout.max_new_tokens=4", "objective.name=gspo"]
    assert list(flat.tune.grid) == ["long/gspo"]                 # tuned once, at tune_at
    assert source == {"short/gspo": "long/gspo", "short/grpo": "long/grpo",
                      "long/gspo": "long/gspo", "long/grpo": "long/grpo"}
    every = {**SUITE, "axis": {**SUITE["axis"], "tune_at": None}}
    flat, source = compare.expand(compare.load_suite(_write(tmp_path, every)))
    assert list(flat.tune.grid) == ["short/gspo", "long/gspo"]  # tuned at every value
    assert source["short/gspo"] == "short/gspo"


@pytest.mark.parametrize("axis, message", [
    ({"baseline": "ppo"}, "axis.baseline 'ppo' is not a variant"),
    ({"tune_at": "medium"}, "axis.tune_at 'medium' is not an axis value"),
])
def test_axis_errors_name_the_key(tmp_path, axis, message):
    bad = {**SUITE, "axis": {**SUITE["axis"], **axis}}
    with pytest.raises(ConfigError, match=message):
        compare.load_suite(_write(tmp_path, bad))


def _summary(best: list[float], final: list[float], clip: float, length: float, collapses: int = 0) -> dict:
    runs = [{"seed": i, "cold_accuracy": 0.1, "final_accuracy": f, "best_accuracy": b,
             "steps_to_threshold": None, "clip_frac_tokens": clip, "response_length": length,
             "wall_s": 1.0, "train_s": 1.0, "tokens_per_s": 1.0, "collapsed": i < collapses}
            for i, (b, f) in enumerate(zip(best, final))]
    return {"summary": compare_stats.aggregate(runs)}


def test_axis_differences_by_hand():
    variants = {
        # short: gspo best 0.5, 0.7 (mean 0.6, std 0.1414) vs grpo 0.4, 0.4 (mean 0.4, std 0)
        "short/gspo": _summary([0.5, 0.7], [0.5, 0.7], clip=0.2, length=10.0),
        "short/grpo": _summary([0.4, 0.4], [0.3, 0.3], clip=0.01, length=12.0, collapses=1),
        # long: only gspo ran
        "long/gspo": _summary([0.5, 0.5], [0.5, 0.5], clip=0.3, length=90.0),
    }
    d = compare_stats.axis_differences(variants, ["short", "long"], "grpo")
    assert list(d) == ["gspo"] and list(d["gspo"]) == ["short"]   # no baseline at long: left out
    r = d["gspo"]["short"]
    assert r["best_accuracy"]["diff"] == pytest.approx(0.2)
    assert r["best_accuracy"]["spread"] == pytest.approx(2 ** 0.5 / 10)  # std(0.5, 0.7) + 0
    assert r["best_accuracy"]["verdict"] == "better"                   # 0.2 > 0.1414
    assert r["final_accuracy"]["diff"] == pytest.approx(0.3)
    assert r["clip_ratio"] == pytest.approx(20.0)                      # 0.2 / 0.01
    assert r["collapses"] == [0, 1] and r["seeds"] == [2, 2]
    assert r["response_length"] == [10.0, 12.0]


TINY = ["sft.steps=20", "train.steps=2", "eval.n=8", "rollout.prompts_per_step=4",
        "rollout.group_size=4", "task.n_train=200", "task.n_test=50", "run.eval_every=1"]


def test_swept_suite_end_to_end(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    argv = ["compare", str(_write(tmp_path, SUITE)), *TINY, f"sft.cache_dir={tmp_path / 'cache'}",
            "--seeds", "2", "--out", str(out)]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["variants"]) == {"short/gspo", "short/grpo", "long/gspo", "long/grpo"}
    assert list(results["tuning"]["variants"]) == ["long/gspo"]
    chosen = results["tuning"]["variants"]["long/gspo"]["chosen_overrides"]
    for value, tokens in (("short", 4), ("long", 8)):
        cfg = yaml.safe_load((out / value / "gspo" / "seed1" / "config.yaml").read_text())
        assert cfg["rollout"]["max_new_tokens"] == tokens
        assert cfg["objective"]["eps_low"] == float(chosen[0].split("=")[1])  # long's choice, everywhere
        assert results["variants"][f"{value}/gspo"]["tuned_overrides"] == chosen
    axis = results["axis"]
    assert axis["values"] == ["short", "long"] and set(axis["differences"]) == {"gspo"}
    for value, tokens in (("short", 4), ("long", 8)):
        r = axis["differences"]["gspo"][value]
        g = results["variants"][f"{value}/gspo"]["summary"]["final_accuracy"]["mean"]
        b = results["variants"][f"{value}/grpo"]["summary"]["final_accuracy"]["mean"]
        assert r["final_accuracy"]["diff"] == pytest.approx(g - b)
        assert all(0 < n <= tokens for n in r["response_length"])  # within the value's budget
    # the claim is judged at each value, on that value's cells
    assert [(c["value"], c["variants"]) for c in results["claims"]] == [
        ("short", ["short/gspo", "short/grpo"]), ("long", ["long/gspo", "long/grpo"])]
    report = (out / "report.md").read_text()
    assert "## Sweep over length" in report and "| short | gspo |" in report
    for png in ("axis_best_accuracy", "axis_final_accuracy"):
        assert (out / "plots" / f"{png}.png").stat().st_size > 0


def test_report_only_rewrites_from_finished_runs_and_names_a_missing_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    suite = {**SUITE, "axis": {**SUITE["axis"], "values": {"short": ["rollout.max_new_tokens=4"],
                                                         "long": ["rollout.max_new_tokens=6"]}}}
    argv = ["compare", str(_write(tmp_path, suite)), *TINY, "train.steps=1",
            f"sft.cache_dir={tmp_path / 'cache'}", "--no-tune", "--seeds", "1", "--out", str(out)]
    assert main(argv) == 0
    (out / "report.md").unlink()
    # a run written by older code lacks newer keys: only the keys both have must agree
    cfg_file = out / "short" / "gspo" / "seed0" / "config.yaml"
    cfg = yaml.safe_load(cfg_file.read_text())
    del cfg["rollout"]["temperature"]
    cfg_file.write_text(yaml.safe_dump(cfg))
    assert main([*argv, "--report-only"]) == 0
    assert "## Sweep over length" in (out / "report.md").read_text()
    cfg["rollout"]["max_new_tokens"] = 5                          # not this suite's run any more
    cfg_file.write_text(yaml.safe_dump(cfg))
    capsys.readouterr()
    assert main([*argv, "--report-only"]) == 2
    assert "short/gspo seed 0: " in capsys.readouterr().err
    (out / "long" / "grpo" / "seed0" / "summary.json").unlink()
    cfg_file.unlink()
    (out / "short" / "gspo" / "seed0" / "summary.json").unlink()
    assert main([*argv, "--report-only"]) == 2
    assert "has not finished" in capsys.readouterr().err
