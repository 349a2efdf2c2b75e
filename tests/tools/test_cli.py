"""The command line: help, one-line user errors with exit status 2, eval/sft/report, and one
end-to-end `gspo train` in a subprocess."""

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gspo.cli import main
from gspo.config import dump_yaml
from gspo.models.presets import load_model

_SCRIPT = Path(sys.executable).with_name("gspo")
GSPO = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "gspo"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def gspo(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([*GSPO, *args], capture_output=True, text=True, env=ENV, cwd=cwd,
                          timeout=300)


# ------------------------------------------------------------------------------- subprocess

@pytest.mark.parametrize("args", [[], ["train"], ["sft"], ["eval"], ["report"], ["mechanism"]])
def test_help_exits_0(args):
    out = gspo(*args, "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: gspo")
    assert "Traceback" not in out.stderr


def test_bad_override_is_one_line_exit_2():
    out = gspo("train", "train.stpes=5")
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gspo: error: ")
    assert "'train.stpes'" in lines[0] and "did you mean 'steps'?" in lines[0]
    assert out.stdout == ""


def test_train_end_to_end(tmp_path, small_config, reward_module, reward_dir):
    """A 1-step run in a subprocess, from the user's side: exit 0, summary line, outputs."""
    cfg = small_config(tmp_path, "sft.enabled=false", "train.steps=1",
                       f"rewards.sources=[{{type: function, fn: '{reward_module}'}}]")
    dump_yaml(cfg, tmp_path / "cfg.yaml")
    run = Path(cfg.run.dir)
    out = subprocess.run([*GSPO, "train", str(tmp_path / "cfg.yaml"), "seed=0"],
                         capture_output=True, text=True, timeout=300,
                         env={**ENV, "PYTHONPATH": os.pathsep.join([str(reward_dir),  # this checkout's
                                                                    ENV.get("PYTHONPATH", "")])})
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r"held-out accuracy( fell)?: ", out.stdout) and "after 1 gspo steps" in out.stdout
    for name in ("summary.json", "metrics.jsonl", "config.yaml", "report.md"):
        assert (run / name).is_file(), name
    assert json.loads((run / "summary.json").read_text())["steps"] == 1
    # resume the finished run for one more step, in-process
    assert main(["train", "--resume", str(run), "train.steps=2"]) == 0
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] \
        == [0, 1, 2]


# ------------------------------------------------------------------------------- in-process

def _error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("gspo: error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


def test_unknown_objective_exit_2(capsys, tmp_path):
    err = _error(capsys, ["train", "objective.name=nope", "task.n_train=50",
                          f"run.dir={tmp_path / 'run'}"])
    assert "unknown objective 'nope'" in err and "gspo" in err and "grpo" in err
    assert not (tmp_path / "run").exists()              # nothing built, nothing written


def test_report_missing_dir_exit_2(capsys, tmp_path):
    assert "no such run folder" in _error(capsys, ["report", str(tmp_path / "missing")])
    assert "no metrics.jsonl" in _error(capsys, ["report", str(tmp_path)])


@pytest.mark.parametrize("argv, message", [
    (["train", "missing.yaml"], "not found"),
    (["train", "a.yaml", "b.yaml"], "at most one config file"),
    (["train", "--resume", "/nonexistent/run"], "no config.yaml"),
    (["eval", "--checkpoint", "/nonexistent/ckpt"], "no config.json"),
    (["train", "rollout.group_size=1"], "rollout.group_size"),
])
def test_user_errors_exit_2(capsys, argv, message):
    assert message in _error(capsys, argv)


def test_no_command_is_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2


def test_eval_prints_json(capsys, saved_tiny):
    argv = ["eval", "--checkpoint", str(saved_tiny), "task.n_train=50", "task.n_test=10",
            "eval.n=4", "eval.k=2", "rollout.max_new_tokens=3"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["checkpoint"] == str(saved_tiny) and result["task"] == "multistep"  # the main job's
    assert 0 <= result["accuracy"] <= 1 and 0 <= result["pass@2"] <= 1
    assert result["n"] == 4 and result["k"] == 2
    assert 0 < result["length"] <= 3


def test_eval_samples_with_the_configs_sampler(capsys, saved_tiny, monkeypatch):
    """gspo eval's pass@k draws as the config's rollout.sampler says (the greedy pass never draws)."""
    from gspo.rollout import generate
    draws = []
    real = generate.draw_rows
    monkeypatch.setattr(generate, "draw_rows", lambda w, **kw: draws.append(w.shape) or real(w, **kw))
    argv = ["eval", "--checkpoint", str(saved_tiny), "task.n_train=50", "task.n_test=10",
            "eval.n=4", "eval.k=2", "rollout.max_new_tokens=3"]
    assert main(argv) == 0 and draws == []
    assert main([*argv, "rollout.sampler=inverse_cdf"]) == 0
    assert draws and all(rows == 4 * 2 for rows, _ in draws), draws
    capsys.readouterr()


def test_sft_command_saves_a_model(capsys, tmp_path):
    out = tmp_path / "sft-model"
    argv = ["sft", "task.n_train=50", "task.n_test=10", "sft.steps=2", "sft.batch_size=8",
            f"sft.cache_dir={tmp_path / 'cache'}", "--out", str(out)]
    assert main(argv) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["sft_steps"] == 2 and info["checkpoint"] == str(out)
    model, tok = load_model(out)
    assert tok.eos_token_id == 2


# ------------------------------------------------------------------------------ warnings
def test_warnings_print_as_one_line_in_the_tools_voice(tmp_path, capsys, monkeypatch):
    """A warning raised by gspo (prompts in both the train and the test file) prints as one
    `gspo: warning:` line: no `path:line: UserWarning:` prefix, no source line under it."""
    import warnings
    from gspo import tasks
    from gspo.cli import one_line_warnings
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n')
    (tmp_path / "overlap_reward.py").write_text("def score(completion, **row): return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with one_line_warnings(), warnings.catch_warnings():
        warnings.simplefilter("always")
        tasks.build("custom", train_file=str(rows), test_file=str(rows), reward="overlap_reward:score")
    err = capsys.readouterr().err
    assert err == f"gspo: warning: custom task: 2 prompt(s) appear in both {rows} and {rows}\n"
    assert warnings.showwarning is not None and "one_line" not in warnings.showwarning.__qualname__


@pytest.mark.parametrize("filename, line", [
    ("/x/site-packages/torch/nn/modules/module.py", "gspo: warning (torch): slow path taken"),
    ("/x/site-packages/gspo/tasks/custom.py", "gspo: warning: slow path taken"),
    ("/home/me/src/gspo/tasks/custom.py", "gspo: warning: slow path taken"),
    ("/x/dist-packages/six.py", "gspo: warning (six): slow path taken"),
])
def test_warning_line_names_a_library_not_a_path(filename, line):
    from gspo.cli import warning_line
    assert warning_line("slow path\n  taken", UserWarning, filename) == line
