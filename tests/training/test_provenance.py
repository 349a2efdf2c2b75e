"""Provenance: RUN/provenance.json of a real CPU run holds what produced it (checked against
independent sources: git, torch, the registry, config.yaml); resume and audit refuse another
objective definition (exit 2, one line) and warn on other code or libraries; compare refuses to
tabulate runs of different code unless told to; the git state is read right (clean, dirty,
untracked, not a checkout)."""

import dataclasses
import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import transformers
import yaml

import gspo
from gspo.tools import compare
from gspo.core import objectives
from gspo.training import provenance
from gspo.cli import main
from gspo.errors import UserError
from gspo.observe.report import build_report
from gspo.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
HAS_GIT = shutil.which("git") is not None


def _parity(reward_module: str) -> str:
    return f"rewards.sources=[{{type: function, fn: '{reward_module}'}}]"


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_config, reward_module):
    """A finished tiny GSPO run (2 steps, clip range overridden, every step recorded for audit)."""
    root = tmp_path_factory.mktemp("prov")
    cfg = small_config(root, _parity(reward_module), "audit.every=1", "objective.eps_low=0.05",
                       "model.device=cpu")
    Trainer(cfg, log=lambda m: None).run()
    return Path(cfg.run.dir)


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    cfg = yaml.safe_load((dst / "config.yaml").read_text())
    cfg["run"]["dir"] = str(dst)
    (dst / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return dst


def _edit(run: Path, edit) -> None:
    path = run / provenance.FILE
    prov = json.loads(path.read_text())
    edit(prov)
    path.write_text(json.dumps(prov))


def _git(*args: str, cwd=REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                          check=True).stdout.strip()


# ----------------------------------------------------------------------------- the file

def test_fields_of_a_cpu_run(run):
    prov = json.loads((run / provenance.FILE).read_text())
    assert prov["command"] == "train" and prov["format"] == provenance.FORMAT
    c = prov["code"]
    assert c["gspo"] == gspo.__version__
    if HAS_GIT and (REPO / ".git").exists():
        assert c["commit"] == _git("rev-parse", "HEAD")
        changed = _git("status", "--porcelain", "--", "src/gspo") != ""
        assert c["dirty"] is changed and (c["diff_sha256"] is not None) is changed
    lib = prov["libraries"]
    assert lib["torch"] == torch.__version__ and lib["transformers"] == transformers.__version__
    assert lib["python"].count(".") == 2 and "vllm" in lib and "peft" in lib
    hw = prov["hardware"]
    assert (hw["device"], hw["dtype"], hw["world_size"]) == ("cpu", "float32", 1)
    assert hw["cpu"] and (hw["gpu"] is None) is (not torch.cuda.is_available())
    o, spec = prov["objective"], objectives.spec("gspo")
    assert (o["name"], o["algorithm"], o["registry"]) == ("gspo", "GroupRelative", "gspo")
    assert o["paper"] == spec.paper and "2507.18071" in o["paper"]
    assert o["equations"] == spec.equations and "clip(s_i, 1−ε_low, 1+ε_high)" in o["equations"]
    assert o["sequence_level"] is True and o["defaults"] == dict(spec.defaults)
    assert o["hyperparameters"] == {"eps_low": 0.05, "eps_high": 4e-4, "aggregation": "seq-mean"}
    assert o["aggregation"] == "seq-mean" and o["token_sum_norm"] == 4
    a = prov["advantage"]
    assert (a["name"], a["scale"], a["group_size"]) == ("group", "group", 4)
    assert a["formula"].startswith("Â_i = (r_i − mean_group(r)) / (std_group(r) + eps)")
    assert prov["sampling"]["rollout"] == {"temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                           "max_new_tokens": 4, "group_size": 4,
                                           "prompts_per_step": 4}
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert prov["config"] == config
    assert prov["config_sha256"] == hashlib.sha256(
        json.dumps(config, sort_keys=True).encode()).hexdigest()
    assert "history" not in prov


def test_report_shows_the_provenance(run):
    report = build_report(run).read_text()
    prov = json.loads((run / provenance.FILE).read_text())
    section = report.split("## Provenance", 1)[1].split("\n\n", 2)[1]
    assert f"commit `{prov['code']['commit']}`" in section
    assert "| objective | gspo: " in section and "| in force | seq-mean, eps_low=0.05" in section
    assert f"torch {torch.__version__}" in section and "| hardware | cpu (float32)" in section


def test_every_objective_states_its_equations():
    for name in ("cispo", "gmpo", "grpo", "gspo", "gspo_token", "luspo", "ppo", "sapo"):
        spec = objectives.spec(name)
        assert "ℓ_" in spec.equations and spec.paper, name


def test_estimators_and_baselines_are_described():
    from gspo.config import load_config

    def entry(*overrides):
        return provenance.collect(load_config(None, list(overrides)), command="train", device="cpu")
    rloo = entry("advantage.estimator=rloo")["advantage"]
    assert (rloo["name"], rloo["scale"]) == ("rloo", "none")
    assert rloo["formula"] == "Â_i = r_i − mean_{j≠i} r_j  [RLOO, arXiv 2402.14740 Eq. 5]"
    ppo = entry("objective.name=ppo")
    assert (ppo["objective"]["registry"], ppo["objective"]["aggregation"]) == ("ppo", "token-mean")
    assert ppo["advantage"]["name"] == "gae" and ppo["advantage"]["lam"] == 0.95
    for name, algorithm in (("sft", "SFTBaseline"), ("dpo", "OnlineDPO")):
        prov = entry(f"objective.name={name}")
        assert prov["objective"]["algorithm"] == algorithm and prov["objective"]["registry"] is None
        assert prov["advantage"]["name"] == "none"
    assert provenance.objective_differences(entry("objective.name=sft")["objective"],
                                            entry("objective.name=dpo")["objective"])[:2] == [
        "name 'sft' -> 'dpo'", "algorithm 'SFTBaseline' -> 'OnlineDPO'"]


# ----------------------------------------------------------------------------- resume

def _patch_default(monkeypatch, name: str, **defaults) -> None:
    """The registry as if ``name``'s paper defaults had been edited since the run."""
    original = objectives.spec

    def spec(n: str):
        s = original(n)
        return dataclasses.replace(s, defaults={**s.defaults, **defaults}) if n == name else s
    monkeypatch.setattr(objectives, "spec", spec)


def test_resume_with_a_changed_objective_default_is_refused(run, tmp_path, monkeypatch, capsys):
    copy = _copy(run, tmp_path)
    before = {p.name: p.read_bytes() for p in copy.iterdir() if p.is_file()}
    _patch_default(monkeypatch, "gspo", eps_high=0.5)
    assert main(["train", "--resume", str(copy)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gspo: error: resume: the objective differs")
    assert "defaults.eps_high 0.0004 -> 0.5; hyperparameters.eps_high 0.0004 -> 0.5" in err[0]
    assert "eps_low" not in err[0]                   # overridden in the run: in force unchanged
    assert before == {p.name: p.read_bytes() for p in copy.iterdir() if p.is_file()}


def test_resume_with_another_aggregation_is_refused(run, tmp_path, capsys):
    copy = _copy(run, tmp_path)
    assert main(["train", "--resume", str(copy), "objective.aggregation=token-mean"]) == 2
    err = capsys.readouterr().err
    assert "aggregation 'seq-mean' -> 'token-mean'" in err and "Traceback" not in err


def test_resume_with_other_libraries_warns_and_keeps_the_history(run, tmp_path, capsys):
    copy = _copy(run, tmp_path)
    _edit(copy, lambda p: p["libraries"].update(torch="0.0.1"))
    old = json.loads((copy / provenance.FILE).read_text())
    assert main(["train", "--resume", str(copy)]) == 0          # finished run: nothing to redo
    err = capsys.readouterr().err
    assert f"gspo: warning: resume: differs from the run ({copy / provenance.FILE}): " \
           f"libraries: torch '0.0.1' -> '{torch.__version__}'" in err
    new = json.loads((copy / provenance.FILE).read_text())
    assert new["history"] == [old] and new["libraries"]["torch"] == torch.__version__


# ----------------------------------------------------------------------------- audit

def test_audit_of_a_run_made_by_another_commit_warns(run, tmp_path, capsys):
    copy = _copy(run, tmp_path)
    _edit(copy, lambda p: p["code"].update(commit="0" * 40, dirty=False, diff_sha256=None))
    assert main(["audit", str(copy), "--step", "1"]) == 0
    err = capsys.readouterr().err
    now = provenance.code_id(provenance.collect(command="audit"))
    assert (f"gspo: warning: audit: differs from the run ({copy / provenance.FILE}): code: "
            f"gspo {gspo.__version__} at 000000000000 -> gspo {gspo.__version__} at {now}") in err


def test_audit_under_a_changed_objective_definition_is_refused(run, tmp_path, monkeypatch, capsys):
    copy = _copy(run, tmp_path)
    original = objectives.spec
    monkeypatch.setattr(objectives, "spec", lambda n: dataclasses.replace(
        original(n), equations="ℓ_i = −s_i Â_i") if n == "gspo" else original(n))
    assert main(["audit", str(copy)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "audit: the objective differs" in err[0] and "equations" in err[0]


def test_audit_of_a_run_without_provenance_warns(run, tmp_path, capsys):
    copy = _copy(run, tmp_path)
    (copy / provenance.FILE).unlink()
    assert main(["audit", str(copy), "--step", "2"]) == 0
    assert f"no {provenance.FILE}" in capsys.readouterr().err


# ----------------------------------------------------------------------------- sft / eval

def test_eval_and_sft_write_provenance_to_out(saved_tiny, tmp_path, capsys):
    small = ["task.n_train=20", "task.n_test=4", "eval.k=1", "rollout.max_new_tokens=2"]
    out = ["--out", str(tmp_path / "e")]
    assert main(["eval", *small, "--checkpoint", str(saved_tiny), *out]) == 0
    printed = json.loads(capsys.readouterr().out)
    prov = json.loads((tmp_path / "e" / provenance.FILE).read_text())
    assert prov["command"] == "eval" and prov["objective"]["name"] == "gspo"
    assert printed["provenance"] == provenance.summary(prov)
    assert json.loads((tmp_path / "e" / "eval.json").read_text()) == printed
    assert main(["sft", *small, "sft.enabled=false", "--out", str(tmp_path / "s")]) == 0
    printed = json.loads(capsys.readouterr().out)
    prov = json.loads((tmp_path / "s" / provenance.FILE).read_text())
    assert prov["command"] == "sft" and printed["provenance"] == provenance.summary(prov)
    assert (tmp_path / "s" / "config.json").is_file()           # the model saved beside it


# ----------------------------------------------------------------------------- compare

def _fake_run(folder: Path, commit: str | None, dirty_diff: str | None = None) -> Path:
    folder.mkdir(parents=True)
    if commit is not None:
        provenance.write(folder, {"code": {"gspo": "0.1.0", "commit": commit,
                                           "dirty": dirty_diff is not None,
                                           "diff_sha256": dirty_diff}})
    return folder


def test_one_code_groups_runs_by_commit_and_diff(tmp_path):
    runs = {"a": _fake_run(tmp_path / "a", "a" * 40), "b": _fake_run(tmp_path / "b", "a" * 40)}
    assert compare.one_code(runs, False, print) == {"a" * 12: ["a", "b"]}
    runs["c"] = _fake_run(tmp_path / "c", "a" * 40, dirty_diff="d" * 64)   # same commit, edited
    runs["d"] = _fake_run(tmp_path / "d", None)                            # an older run
    with pytest.raises(UserError) as err:
        compare.one_code(runs, False, print)
    assert str(err.value).startswith("compare: the runs come from different code (")
    assert f"{'a' * 12}: a, b; {'a' * 12}+dirty:{'d' * 12}: c; unknown (no provenance.json): d" \
           in str(err.value) and "--allow-mixed-commits" in str(err.value)
    logged = []
    assert len(compare.one_code(runs, True, logged.append)) == 3 and "warning" in logged[0]


TINY = ["sft.steps=5", "train.steps=1", "eval.n=4", "eval.k=1", "rollout.prompts_per_step=2",
        "rollout.group_size=2", "rollout.max_new_tokens=4", "task.n_train=40", "task.n_test=8",
        "train.minibatches=1"]


def test_compare_refuses_mixed_commits_unless_told(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    argv = ["compare", str(REPO / "configs/compare/dense.yaml"), *TINY,
            f"sft.cache_dir={tmp_path / 'cache'}", "--seeds", "1", "--no-tune",
            "--variants", "gspo,grpo", "--out", str(out)]
    assert main(argv) == 0
    here = provenance.code_id(json.loads((out / "gspo" / "seed0" / provenance.FILE).read_text()))
    assert f"Code: every run made at commit `{here}`" in (out / "report.md").read_text()
    assert json.loads((out / provenance.FILE).read_text())["command"] == "compare"
    _edit(out / "grpo" / "seed0", lambda p: p["code"].update(commit="f" * 40, dirty=False))
    capsys.readouterr()
    assert main(argv) == 2                                   # both runs reused: mixed code
    err = capsys.readouterr().err
    assert err.count("reusing") == 2
    assert f"different code ({here}: gspo seed 0; {'f' * 12}: grpo seed 0)" in err
    assert main([*argv, "--allow-mixed-commits"]) == 0
    report = (out / "report.md").read_text()
    assert f"**Mixed code** (--allow-mixed-commits): `{here}`: gspo seed 0; `{'f' * 12}`: " \
           "grpo seed 0." in report
    assert json.loads((out / "results.json").read_text())["code"] == {
        here: ["gspo seed 0"], "f" * 12: ["grpo seed 0"]}


# ----------------------------------------------------------------------------- git state

@pytest.mark.skipif(not HAS_GIT, reason="needs git")
def test_git_state_clean_dirty_untracked_and_not_a_checkout(tmp_path):
    repo = tmp_path / "repo"
    pkg = repo / "src" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("x = 1\n")
    (repo / "notes.txt").write_text("not code\n")
    _git("init", "-q", cwd=repo)
    _git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "init", "--allow-empty",
         cwd=repo)
    _git("add", "src/pkg/__init__.py", cwd=repo)
    _git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "pkg", cwd=repo)
    head = _git("rev-parse", "HEAD", cwd=repo)
    clean = provenance.code(pkg)
    assert (clean["commit"], clean["dirty"], clean["diff_sha256"]) == (head, False, None)
    (pkg / "__init__.py").write_text("x = 2\n")                  # a tracked edit
    edited = provenance.code(pkg)
    assert edited["commit"] == head and edited["dirty"] is True
    diff = subprocess.run(["git", "diff", "HEAD", "--binary", "--", "src/pkg"], cwd=repo,
                          capture_output=True, check=True).stdout
    assert edited["diff_sha256"] == hashlib.sha256(diff).hexdigest()
    (pkg / "new.py").write_text("y = 1\n")                       # untracked code counts
    assert provenance.code(pkg)["diff_sha256"] not in (None, edited["diff_sha256"])
    (pkg / "new.py").unlink()
    (pkg / "__init__.py").write_text("x = 1\n")
    (repo / "notes.txt").write_text("edited, outside the package\n")
    assert provenance.code(pkg)["dirty"] is False
    outside = tmp_path / "site-packages" / "pkg"                 # e.g. a pip-installed copy
    outside.mkdir(parents=True)
    (outside / "__init__.py").write_text("x = 1\n")
    unknown = provenance.code(outside)
    assert unknown["commit"] == "unknown" and unknown["source"].startswith("unknown: ")
    assert provenance.code_id({"code": unknown}) == f"unknown (gspo {gspo.__version__})"


def test_objective_differences_by_hand():
    run = {"name": "gspo", "algorithm": "GroupRelative", "registry": "gspo", "equations": "ℓ",
           "sequence_level": True, "aggregation": "seq-mean", "token_sum_norm": 4,
           "defaults": {"eps_low": 3e-4}, "hyperparameters": {"eps_low": 3e-4,
                                                             "aggregation": "seq-mean"},
           "paper": "A"}
    assert provenance.objective_differences(run, {**run, "paper": "B"}) == []
    now = {**run, "aggregation": "token-mean",
           "hyperparameters": {"eps_low": 3e-4, "aggregation": "token-mean"}}
    assert provenance.objective_differences(run, now) == ["aggregation 'seq-mean' -> 'token-mean'"]
    now = {**run, "defaults": {"eps_low": 1e-3}, "hyperparameters": {"eps_low": 1e-3}}
    assert provenance.objective_differences(run, now) == [
        "defaults.eps_low 0.0003 -> 0.001", "hyperparameters.eps_low 0.0003 -> 0.001"]
    assert provenance.warnings_between({"code": {"gspo": "1"}, "objective": run},
                                       {"code": {"gspo": "1"}, "objective": {**run, "paper": "B"}}
                                       ) == ["objective citation: 'A' -> 'B'"]


def test_another_cached_commit_of_a_hub_id_warns():
    hub = {"model.path": {"id": "Qwen/Qwen3-0.6B", "revision": "a" * 40}}
    moved = {"model.path": {"id": "Qwen/Qwen3-0.6B", "revision": "b" * 40}}
    base = {"code": {"gspo": "1"}}
    assert provenance.warnings_between({**base, "hub": hub}, {**base, "hub": hub}) == []
    [line] = provenance.warnings_between({**base, "hub": hub}, {**base, "hub": moved})
    assert line.startswith("hub: model.path.revision")
