"""Faults lose nothing: SIGKILL at several points (one during a checkpoint write, one mid-way through
a metrics line) and resume give the uninterrupted run bit for bit; SIGTERM / SIGINT save and exit
143 / 130; a disk that fills mid-run ends with one line and exit 4, and resume (with just enough
room) gives the uninterrupted run; a second writer of a live run is refused, and accepted once the
first is SIGKILLed; a corrupt newest checkpoint is refused and resume falls back, saying so;
NaN/Inf losses and gradients skip the update and non-finite weights are never saved.

One reference run (4 GSPO steps, evaluation at 2 and 4, parity reward) is made in-process; the
interrupted runs are subprocesses, so kills and signals are real."""

import errno
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

from safetensors import SafetensorError

from gspo.training import checkpoint
from gspo.tools import preflight
from gspo.training.checkpoint import CheckpointError, checkpoint_dir, list_checkpoints, verify
from gspo.cli import main
from gspo.config import dump_yaml, load_config
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


# ------------------------------------------------------------------------------- full disk

def _disk_fills_at(patch, where: str, step: int) -> None:
    """The disk fills while the run writes the metrics row of ``step`` (half of it reaches the
    file, then ENOSPC, as the kernel does) or the weights of the checkpoint of ``step`` (the
    error safetensors raises for ENOSPC)."""
    if where == "metrics":
        real = os.write

        def write(fd, data):
            if os.readlink(f"/proc/self/fd/{fd}").endswith("metrics.jsonl") \
                    and data.startswith(b'{"step": %d,' % step):
                real(fd, data[:len(data) // 2])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(fd, data)
        patch.setattr(os, "write", write)
    else:
        save_model = checkpoint.save_model

        def failing(model, tokenizer, path, **kwargs):
            save_model(model, tokenizer, path, **kwargs)
            if path.name == f".step_{step:06d}.tmp":
                raise SafetensorError("Error while serializing: I/O error: No space left on "
                                      "device (os error 28)")
        patch.setattr(checkpoint, "save_model", failing)


@pytest.mark.parametrize("where, what, path", [
    ("metrics", "the metrics row of step 3", "metrics.jsonl"),
    ("checkpoint", "the checkpoint of step 3", "checkpoints/.step_000003.tmp"),
])
def test_disk_full_mid_run_then_resume_with_just_enough_room(ref, capsys, monkeypatch, where,
                                                             what, path):
    """One line naming the file, the last complete checkpoint (step 2) and the resume command,
    exit 4; metrics.jsonl ends with the whole row of step 2 at most beyond it; the newest
    checkpoint verifies. Resume with room for exactly one more checkpoint proceeds and gives
    the uninterrupted run."""
    config, run = ref["make"](f"full-{where}")
    with monkeypatch.context() as patch:
        _disk_fills_at(patch, where, 3)
        assert main(["train", str(config)]) == 4
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("gspo: error") == 1
    assert err.strip().splitlines()[-1] == (
        f"gspo: error: could not write {what} ({run / path}): No space left on device (errno 28);"
        f" the last complete checkpoint is {checkpoint_dir(run, 2)} (step 2); free space, then "
        f"continue with: gspo train --resume {run}")
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert all(line.endswith("\n") for line in lines)                   # no torn row
    assert [json.loads(line)["step"] for line in lines] == ([0, 1, 2] if where == "metrics"
                                                             else [0, 1, 2, 3])
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    verify(checkpoint_dir(run, 2))

    one_more = preflight.checkpoint_bytes(load_config(str(run / "config.yaml")))
    free = one_more + preflight.MIN_FREE_MB * preflight.MB     # 2 kept on disk: room for a third
    usage = type(preflight.shutil.disk_usage(run))
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: usage(1 << 40, 0, free - 1))
    assert main(["train", "--resume", str(run)]) == 2                   # a byte short: refused
    assert "2 of them already on disk" in capsys.readouterr().err
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: usage(1 << 40, 0, free))
    err = _resume(capsys, run)
    assert "restored" in err and "(step 2)" in err
    _assert_same_run(run, ref["run"])


# A real full disk: a 100 MB tmpfs in a private mount namespace (unshare: no root needed where
# user namespaces are allowed). The run's disk is filled by another process once the step-2
# checkpoint exists; the run and, after the filler is removed, its resume are copied out.
TMPFS_SCRIPT = r"""
set -u
mount -t tmpfs -o size=100m tmpfs "$MNT" || exit 97
"$PY" -m gspo train "$CONFIG" 2> "$OUT/first.err" &
pid=$!
while [ ! -d "$RUN/checkpoints/step_000002" ] && kill -0 $pid 2>/dev/null; do sleep 0.02; done
dd if=/dev/zero of="$MNT/fill" bs=1M 2>/dev/null
wait $pid; echo $? > "$OUT/first.rc"
cp -a "$RUN" "$OUT/after-fault"
rm "$MNT/fill"
df -B1 --output=avail "$MNT" | tail -1 > "$OUT/free"
"$PY" -m gspo train --resume "$RUN" 2> "$OUT/resume.err"; echo $? > "$OUT/resume.rc"
cp -a "$RUN" "$OUT/resumed"
"""


def test_a_real_full_disk_then_resume_on_the_freed_space(ref, tmp_path):
    """On a real file system that fills: exit 4 and one line naming a file and the newest
    complete checkpoint; whole metrics rows and a verified newest checkpoint. Then, on the freed
    space (the 2 kept checkpoints still on it: less than the 4 checkpoints + 64 MB the old
    estimate asked for, more than the one more + 64 MB a resume needs), the resume runs and
    gives the uninterrupted run."""
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs tmpfs {tmp_path}"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip("cannot mount a tmpfs in a user namespace here")
    mnt, out = tmp_path / "mnt", tmp_path / "out"
    mnt.mkdir()
    out.mkdir()
    config, run = ref["make"]("tmpfs", f"run.dir={mnt / 'run'}")
    env = {**ref["env"], "MNT": str(mnt), "OUT": str(out), "RUN": str(run), "CONFIG": str(config),
           "PY": sys.executable}
    done = subprocess.run(["unshare", "-rm", "bash", "-c", TMPFS_SCRIPT], env=env, timeout=400,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    first = (out / "first.err").read_text()
    assert (out / "first.rc").read_text().strip() == "4", first[-2000:]
    assert "Traceback" not in first and first.count("gspo: error") == 1
    faulted = out / "after-fault"
    newest = list_checkpoints(faulted)[-1]
    step = int(newest.name.removeprefix("step_"))
    last = first.strip().splitlines()[-1]
    assert last.startswith("gspo: error: could not write ") and "No space left on device" in last
    assert last.endswith(f"the last complete checkpoint is {run / 'checkpoints' / newest.name} "
                         f"(step {step}); free space, then continue with: gspo train --resume "
                         f"{run}")
    verify(newest)
    assert not any(p.name.startswith(".") for p in (faulted / "checkpoints").iterdir())
    text = (faulted / "metrics.jsonl").read_text()
    assert text.endswith("\n") and [json.loads(x)["step"] for x in text.splitlines()][:step + 1] \
        == list(range(step + 1))
    one = preflight.checkpoint_bytes(load_config(str(config)))
    margin = preflight.MIN_FREE_MB * preflight.MB
    assert one + margin <= int((out / "free").read_text()) < 4 * one + margin
    assert (out / "resume.rc").read_text().strip() == "0", (out / "resume.err").read_text()[-2000:]
    _assert_same_run(out / "resumed", ref["run"])


# ------------------------------------------------------------------------------- one writer

def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("gspo: error: ") and err.count("\n") == 1, err
    return err


def test_a_second_writer_is_refused_until_the_first_is_killed(ref, capsys):
    """While a run trains (a real subprocess), `train --resume` and `train run.overwrite=true`
    on its folder are refused with one line naming its PID, exit 2, and change nothing; `gspo
    report` still reads it. Once it is SIGKILLed, the kernel has released the lock: resume runs."""
    config, run = ref["make"]("live", "train.steps=100000", "run.eval_every=0", "run.save_every=2")
    proc = subprocess.Popen([sys.executable, "-m", "gspo", "train", str(config)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ref["env"])
    try:
        deadline = time.monotonic() + 240
        while not checkpoint_dir(run, 2).is_dir() and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, "the first run ended early"
        assert main(["train", "--resume", str(run)]) == 2
        err = _one_error_line(capsys)
        assert f"run.dir {run} is in use by PID {proc.pid} on " in err
        assert f"(gspo train {config}, since " in err
        assert main(["train", str(config), "run.overwrite=true"]) == 2
        assert f"is in use by PID {proc.pid}" in _one_error_line(capsys)
        assert (run / "metrics.jsonl").is_file() and list_checkpoints(run)   # nothing deleted
        assert main(["report", str(run)]) == 0                            # readers do not lock
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
    capsys.readouterr()
    last = int(list_checkpoints(run)[-1].name.removeprefix("step_"))
    assert main(["train", "--resume", str(run), f"train.steps={last + 1}"]) == 0
    assert "restored" in capsys.readouterr().err
    assert not any(p.name.startswith(".") for p in (run / "checkpoints").iterdir())


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
