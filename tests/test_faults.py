"""Faults lose nothing: SIGKILL at several points (one during a checkpoint write, one mid-way through
a metrics line) and resume give the uninterrupted run bit for bit; SIGTERM / SIGINT save and exit
143 / 130; a corrupt newest checkpoint is refused and resume falls back, saying so; NaN/Inf losses
and gradients skip the update and non-finite weights are never saved.

One reference run (4 GSPO steps, evaluation at 2 and 4, parity reward) is made in-process; the
interrupted runs are subprocesses, so kills and signals are real."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gspo.training.checkpoint import CheckpointError, checkpoint_dir, list_checkpoints, verify
from gspo.cli import main
from gspo.config import dump_yaml
from gspo.observe.metrics import read_metrics
from gspo.training.trainer import Trainer
from conftest import parity_rewards

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
STEPS = 4

# Runs `gspo train` in a fresh interpreter, but first arranges a SIGKILL of itself at a chosen
# point: "checkpoint N" (weights of step N written into the temporary folder, before checksums and
# rename) or "metrics N" (half of the row of step N written, no newline).
KILLER = r"""
import json, os, signal, sys
import gspo.training.checkpoint, gspo.observe.metrics
from gspo.cli import main

where, step = sys.argv[1], int(sys.argv[2])
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
if where == "checkpoint":
    save_model = gspo.training.checkpoint.save_model
    def killing_save(model, tokenizer, path):
        save_model(model, tokenizer, path)
        if path.name == f".step_{step:06d}.tmp":
            die()
    gspo.training.checkpoint.save_model = killing_save
elif where == "metrics":
    write = gspo.observe.metrics.MetricsWriter.write
    def killing_write(self, row):
        if row["step"] == step:
            with self.path.open("a") as fh:
                fh.write(json.dumps(row)[:50])
            die()
        write(self, row)
    gspo.observe.metrics.MetricsWriter.write = killing_write
sys.exit(main(sys.argv[3:]))
"""


_parity = parity_rewards


def _strip(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rows]


def _tensors(path: Path) -> dict:
    return load_file(path)


def _assert_same_run(run: Path, ref: Path) -> None:
    """metrics.jsonl (wall-clock keys aside), final weights and optimizer state: identical."""
    assert _strip(read_metrics(run)) == _strip(read_metrics(ref))
    a, b = (_tensors(checkpoint_dir(r, STEPS) / "model.safetensors") for r in (run, ref))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    oa, ob = (torch.load(checkpoint_dir(r, STEPS) / "optimizer.pt", weights_only=True) for r in (run, ref))
    assert all(torch.equal(oa["state"][i][k], ob["state"][i][k])
               for i in oa["state"] for k in ("exp_avg", "exp_avg_sq"))
    sa, sb = (json.loads((r / "summary.json").read_text()) for r in (run, ref))
    assert sa["eval_after"] == sb["eval_after"] and sa["eval_before"] == sb["eval_before"]


@pytest.fixture(scope="module")
def ref(tmp_path_factory, small_config, reward_module, reward_dir):
    """The uninterrupted run; make(name, *overrides) writes a config file for another run."""
    root = tmp_path_factory.mktemp("faults")
    overrides = [_parity(reward_module), f"train.steps={STEPS}", "run.save_every=1",
                 "run.eval_every=2", "sft.steps=3"]
    cfg = small_config(root, *overrides, run="reference")
    Trainer(cfg, log=lambda m: None).run()

    def make(name: str, *more: str) -> tuple[Path, Path]:
        cfg = small_config(root, *overrides, *more, run=name)
        dump_yaml(cfg, root / f"{name}.yaml")
        return root / f"{name}.yaml", Path(cfg.run.dir)

    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(reward_dir), ENV.get("PYTHONPATH", "")])}
    return {"run": Path(cfg.run.dir), "make": make, "env": env}


def _gspo(ref, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gspo", *args], capture_output=True, text=True,
                          env=ref["env"], timeout=300)


def _killed(ref, where: str, step: int, *args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-c", KILLER, where, str(step), *args],
                         capture_output=True, text=True, env=ref["env"], timeout=300)
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    return out


def _resume(capsys, run: Path) -> str:
    """`gspo train --resume RUN` in-process; returns its stderr."""
    assert main(["train", "--resume", str(run)]) == 0
    return capsys.readouterr().err


# ------------------------------------------------------------------------------- SIGKILL

def test_sigkill_anywhere_then_resume_is_exact(ref, capsys):
    """Killed from outside once the step-2 checkpoint exists (wherever the run is then)."""
    config, run = ref["make"]("outside")
    proc = subprocess.Popen([sys.executable, "-m", "gspo", "train", str(config)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ref["env"])
    deadline = time.monotonic() + 240
    while not checkpoint_dir(run, 2).is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (run / "summary.json").exists()
    _resume(capsys, run)
    _assert_same_run(run, ref["run"])


def test_sigkill_during_checkpoint_write_and_mid_metrics_line(ref, capsys):
    """Two kills in a row: inside the step-3 checkpoint write, then half-way through writing the
    metrics row of step 4 (after resuming). The half-written folder and line are never used."""
    config, run = ref["make"]("twice")
    _killed(ref, "checkpoint", 3, "train", str(config))
    assert [p.name for p in list_checkpoints(run)] == ["step_000001", "step_000002"]
    assert (run / "checkpoints" / ".step_000003.tmp").is_dir()          # what the kill left
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2, 3]      # row 3 logged, not saved

    _killed(ref, "metrics", 4, "train", "--resume", str(run))
    assert not (run / "metrics.jsonl").read_text().endswith("\n")       # a line cut short
    assert [p.name for p in list_checkpoints(run)][-1] == "step_000003"

    err = _resume(capsys, run)
    assert "restored" in err and "(step 3)" in err
    assert not (run / "checkpoints" / ".step_000003.tmp").exists()
    _assert_same_run(run, ref["run"])


# ------------------------------------------------------------------------------- signals

def test_sigterm_saves_a_checkpoint_and_exits_143(ref, capsys):
    config, run = ref["make"]("sigterm", "run.save_every=0")            # only the stop saves
    proc = subprocess.Popen([sys.executable, "-m", "gspo", "train", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ref["env"])
    deadline = time.monotonic() + 240
    while len(read_metrics(run)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)                                                 # step 1 is logged
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 143, err[-2000:]
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("gspo: interrupted by SIGTERM after step ") and "--resume" in last
    saved = list_checkpoints(run)
    assert len(saved) == 1 and str(saved[0]) in last
    verify(saved[0])                                                     # complete, checksums ok
    step = int(saved[0].name.removeprefix("step_"))
    assert 1 <= step < STEPS and [r["step"] for r in read_metrics(run)] == list(range(step + 1))
    _resume(capsys, run)
    _assert_same_run(run, ref["run"])


def test_sigint_in_process_exits_130(ref, capsys, tmp_path, reward_dir, monkeypatch):
    """SIGINT (Ctrl-C) during step 2: the step finishes, its checkpoint is saved, exit 130."""
    (tmp_path / "ctrl_c.py").write_text(
        "import os, signal\ncalls = 0\n"
        "def reward(completion, **row):\n"
        "    global calls\n    calls += 1\n"
        "    if calls == 20:  # 16 samples a step: inside step 2\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "    return float(len(completion) % 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config, run = ref["make"]("sigint", "rewards.sources=[{type: function, fn: 'ctrl_c:reward'}]",
                              "run.save_every=0", "rewards.timeout_s=60")
    before = signal.getsignal(signal.SIGINT)    # SIG_IGN when the test runner was started with &
    assert main(["train", str(config)]) == 130
    err = capsys.readouterr().err
    assert "SIGINT received" in err and "Traceback" not in err
    assert "interrupted by SIGINT after step 2" in err
    assert [p.name for p in list_checkpoints(run)] == ["step_000002"]
    assert signal.getsignal(signal.SIGINT) is before                       # handlers restored


# ------------------------------------------------------------------------------- corrupt checkpoints

def test_truncated_newest_checkpoint_falls_back_to_the_previous(ref, capsys):
    """The newest checkpoint (the final one) cut short: refused, step 3 restored, run redone."""
    config, run = ref["make"]("truncated")
    assert main(["train", str(config)]) == 0
    capsys.readouterr()
    weights = checkpoint_dir(run, STEPS) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="checksum mismatch in model.safetensors"):
        verify(checkpoint_dir(run, STEPS))
    err = _resume(capsys, run)
    assert "refusing corrupt checkpoint" in err and "step_000004" in err and "falling back" in err
    assert "restored" in err and "step_000003 (step 3)" in err
    _assert_same_run(run, ref["run"])


# ------------------------------------------------------------------------------- numerics

def _params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")
def test_nan_loss_skips_the_update(fresh):
    t = fresh("train.minibatches=2")
    real = t.step.objective
    t.step.objective = lambda *a, **k: (lambda loss, stats: (loss * float("nan"), stats))(*real(*a, **k))
    before = _params(t.model)
    row = t.step(0)
    assert row["optim/skipped_nonfinite"] == 2
    assert all(torch.equal(before[n], p) for n, p in t.model.named_parameters())
    assert t.optimizer.state == {}                                  # AdamW never stepped
    assert all(p.grad is None for p in t.model.parameters())        # nothing left to leak


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")
def test_nan_gradient_skips_only_that_update(fresh):
    t = fresh("train.minibatches=2")
    calls = []

    def poison(grad):
        calls.append(1)
        return grad * float("nan") if len(calls) == 1 else grad     # first minibatch only
    handle = t.model.model.embed_tokens.weight.register_hook(poison)
    before = _params(t.model)
    row = t.step(0)
    handle.remove()
    assert row["optim/skipped_nonfinite"] == 1
    assert not torch.equal(before["model.embed_tokens.weight"], t.model.model.embed_tokens.weight)
    assert all(torch.isfinite(p).all() for p in t.model.parameters())
    assert all(torch.isfinite(s["exp_avg"]).all() for s in t.optimizer.state.values())


def test_non_finite_weights_are_never_saved(fresh):
    t = fresh()
    t.save(1, 0.0)
    with torch.no_grad():
        t.model.model.norm.weight[0] = float("inf")
    with pytest.raises(CheckpointError, match="non-finite weights in model.norm.weight"):
        t.save(2, 0.0)
    assert [p.name for p in list_checkpoints(t.run_dir)] == ["step_000001"]
    assert not any(p.name.startswith(".") for p in (t.run_dir / "checkpoints").iterdir())
