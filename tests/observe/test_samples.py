"""samples.jsonl: what the model writes every run.samples_every steps, with rewards, advantages,
ratio and clip state; ``gspo samples`` prints it; the report shows the best and the worst."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from conftest import parity_rewards

from gspo.cli import main
from gspo.observe.report import build_report
from gspo.observe.samples import read_samples
from gspo.training.trainer import Trainer


def _run(make_cfg, reward_module, *overrides, run="run"):
    cfg = make_cfg(parity_rewards(reward_module), "sft.enabled=false", "run.samples_every=1",
                   "run.samples_prompts=2", *overrides, run=run)
    Trainer(cfg, log=lambda m: None).run()
    return Path(cfg.run.dir)


def test_single_turn_samples_rows_and_the_samples_command(make_cfg, reward_module, capsys):
    run = _run(make_cfg, reward_module)
    rows = read_samples(run)
    assert [r["step"] for r in rows] == [1, 1, 2, 2]            # 2 prompts per step, 2 steps
    for row in rows:
        assert len(row["completions"]) == 4                      # G = 4
        rewards = [c["reward"] for c in row["completions"]]
        advantages = [c["advantage"] for c in row["completions"]]
        assert abs(sum(advantages)) < 1e-4                       # group-relative: mean zero
        assert all(r in (0.0, 1.0) for r in rewards)             # the parity reward
        for c in row["completions"]:
            assert c["ratio"] is None or c["ratio"] > 0
            assert c["tokens"] >= 1 and isinstance(c["text"], str)
    assert main(["samples", str(run), "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("=== step 2") == 2 and "=== step 1" not in out and "reward" in out
    report = build_report(run).read_text()
    assert "## Samples of step 2" in report and "**best**" in report and "**worst**" in report


def test_multi_turn_samples_are_whole_transcripts(make_cfg, reward_module):
    run = _run(make_cfg, reward_module, "task.name=calculator", "task.params={digits: 2}",
               "multiturn.env=tools", "multiturn.tools=[gspo.tasks.tooluse:calc]",
               "multiturn.call_format=bracket", "multiturn.max_turns=2", "multiturn.max_total_tokens=24",
               "rollout.max_new_tokens=8")
    rows = read_samples(run, -1)
    assert rows and all(r["step"] == 2 for r in rows)
    assert all(len(r["completions"]) == 4 for r in rows)


def test_samples_command_without_samples_is_one_line(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    assert main(["samples", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no samples" in err


def test_rows_past_a_step_are_cut_on_resume(tmp_path):
    from gspo.observe.metrics import MetricsWriter
    path = tmp_path / "samples.jsonl"
    path.write_text('{"step": 1, "completions": []}\n{"step": 2, "completions": []}\n{"step": 3, "comp')
    MetricsWriter(tmp_path).truncate_after(1)
    assert [r["step"] for r in read_samples(tmp_path)] == [1]


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
def test_a_ray_run_writes_the_colocated_runs_samples(make_cfg, reward_module):
    """Generators on a local Ray cluster sample what the colocated run samples (test_ray.py):
    so are its samples, row for row."""
    colocated = read_samples(_run(make_cfg, reward_module))
    on_ray = read_samples(_run(make_cfg, reward_module, "rollout.placement=ray", run="ray"))
    assert on_ray == colocated and len(on_ray) == 4
