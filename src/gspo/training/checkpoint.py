"""Checkpoints: a standard transformers directory plus the trainer state, written atomically.

Layout of ``RUN/checkpoints/step_000050/``::

    config.json, model.safetensors, tokenizer files   # loadable by transformers alone
    trainer_state.json                                 # step, data position, metrics, RNG seeds
    optimizer.pt, scheduler.pt                         # tensors only (torch.load weights_only=True)
    checksums.json                                     # sha256 of every file above

A checkpoint is written to a temporary folder, flushed to disk (fsync) and renamed into place, so
a crash leaves either the previous checkpoint or the new one, never half of one. Weights that are
not finite are refused (the previous checkpoints stay the last good ones). Loading verifies the
checksums and falls back to the previous checkpoint when the newest is corrupt. A write that fails
(a full disk) removes the temporary folder and raises ``WriteFailed`` (gspo.storage); the folders
of a writer that was killed are removed by the run's next writer (``remove_partial``). Nothing is
ever unpickled: weights are safetensors, the trainer state JSON, optimizer and scheduler state go
through ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from gspo.models.presets import save_model
from gspo.storage import save_torch, writing

STATE_FILE = "trainer_state.json"
CHECKSUM_FILE = "checksums.json"
PREFIX = "step_"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted (missing files, checksum mismatch)."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"{PREFIX}{step:06d}"


def save_checkpoint(run_dir: str | Path, step: int, model, tokenizer, optimizer, scheduler,
                    state: dict, keep: int = 2, *, model_state: dict | None = None,
                    optimizer_state: dict | None = None, extra=None) -> Path:
    """Atomically write the checkpoint of ``step`` and prune old ones (keeping ``keep``).

    ``model_state`` / ``optimizer_state`` replace the model's and optimizer's own state dicts
    (full states gathered from FSDP shards, gspo.training.distributed). ``extra(folder)`` (optional) writes
    more files into the folder before it is checksummed (PPO's critic, gspo.training.algorithms)."""
    check_finite(model, step, model_state)
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with writing(f"the checkpoint of step {step}", tmp):
            tmp.mkdir(parents=True)
            if model_state is None:
                save_model(model, tokenizer, tmp)
            else:                                   # full weights gathered from FSDP shards
                save_model(model, tokenizer, tmp, state_dict=model_state)
            save_torch(optimizer.state_dict() if optimizer_state is None else optimizer_state,
                       tmp / "optimizer.pt")
            save_torch(scheduler.state_dict(), tmp / "scheduler.pt")
            (tmp / STATE_FILE).write_text(json.dumps({**state, "step": step}, indent=1))
            if extra is not None:
                extra(tmp)
            sums = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
            (tmp / CHECKSUM_FILE).write_text(json.dumps(sums, indent=1))
            for p in tmp.iterdir():
                _fsync(p)
            _fsync(tmp)
    except BaseException:  # a full disk, a signal: leave no temporary folder behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    with writing(f"the checkpoint of step {step}", final):
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        _fsync(final.parent)
    prune(run_dir, keep)
    return final


def check_finite(model, step: int, state: dict | None = None) -> None:
    """CheckpointError when a parameter (of ``state``, if given) holds NaN or Inf: never written."""
    params = list(state.items()) if state is not None else list(model.named_parameters())
    finite = torch.stack([torch.isfinite(p.detach()).all() for _, p in params]).tolist()
    bad = [name for (name, _), ok in zip(params, finite) if not ok]
    if bad:
        raise CheckpointError(f"refusing to save the checkpoint of step {step}: non-finite weights "
                              f"in {bad[0]}" + (f" and {len(bad) - 1} more" if len(bad) > 1 else "")
                              + "; the previous checkpoints are kept")


def _fsync(path: Path) -> None:
    """Flush a file or folder to disk (a rename is durable only once its folder is synced)."""
    if not path.is_dir() and not path.is_file():
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Finished checkpoints, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX))


def remove_partial(run_dir: str | Path) -> list[Path]:
    """Remove the temporary folders of checkpoints whose writer died (SIGKILL, power loss) and
    return them. Only the run's lock holder may call it: a live writer's folder looks the same."""
    root = Path(run_dir) / "checkpoints"
    partial = sorted(root.glob(f".{PREFIX}*.tmp")) if root.is_dir() else []
    for path in partial:
        shutil.rmtree(path, ignore_errors=True)
    return partial


def checkpoint_step(path: Path) -> int:
    """The RL step of a checkpoint folder (``step_000012`` -> 12)."""
    return int(path.name[len(PREFIX):])


def drop_after(run_dir: str | Path, step: int) -> list[Path]:
    """Remove the finished checkpoints of steps after ``step`` (a roll-back abandoned them, so a
    resume must not pick them up) and return them."""
    later = [p for p in list_checkpoints(run_dir) if checkpoint_step(p) > step]
    for path in later:
        shutil.rmtree(path, ignore_errors=True)
    return later


def prune(run_dir: str | Path, keep: int) -> None:
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def verify(path: Path) -> None:
    sums_file = path / CHECKSUM_FILE
    if not sums_file.is_file():
        raise CheckpointError(f"{path}: no {CHECKSUM_FILE} (incomplete checkpoint)")
    try:
        sums = json.loads(sums_file.read_text())
    except ValueError:
        raise CheckpointError(f"{path}: unreadable {CHECKSUM_FILE}") from None
    for name, digest in sums.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path}: missing {name}")
        if _sha256(file) != digest:
            raise CheckpointError(f"{path}: checksum mismatch in {name}")


@dataclass
class LoadedState:
    path: Path
    state: dict
    optimizer: dict
    scheduler: dict


def load_latest(run_dir: str | Path, warn=print, accept: Callable[[dict], bool] | None = None,
                who: str = "resume") -> LoadedState | None:
    """The newest checkpoint that verifies and whose trainer state ``accept`` takes (default:
    any); corrupt ones are reported (as ``who``) and skipped."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            verify(path)
        except CheckpointError as err:
            warn(f"{who}: refusing corrupt checkpoint {err}; falling back to the previous one")
            continue
        state = json.loads((path / STATE_FILE).read_text())
        if accept is not None and not accept(state):
            continue
        return LoadedState(
            path=path, state=state,
            optimizer=torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu"),
            scheduler=torch.load(path / "scheduler.pt", weights_only=True, map_location="cpu"),
        )
    return None


# ------------------------------------------------------------------ the best checkpoint
def selection_examples(task, cfg) -> list:
    """The validation examples that choose the best checkpoint (eval.keep_best): none when the
    task has no validation split or the evaluations already score it (eval.split=validation)."""
    if not cfg.eval.keep_best or cfg.eval.split != "test":
        return []
    examples = task.split("validation")
    return examples[:cfg.eval.n] if cfg.eval.n else examples


BEST = "best"              # <run.dir>/best: the weights that scored best on validation
BEST_RECORD = "best.json"  # in it: which step, its validation and test accuracy


def kept_best(run_dir: Path) -> dict | None:
    """The record of <run.dir>/best, if one was kept."""
    record = run_dir / BEST / BEST_RECORD
    return json.loads(record.read_text()) if record.is_file() else None


def save_weights(model, tokenizer, folder: Path, record: dict) -> None:
    """Weights, tokenizer and ``record`` to ``folder``, replaced whole: written beside it, then
    renamed; a write that fails leaves the previous folder as it was."""
    tmp, old = folder.with_name(f".{folder.name}.tmp"), folder.with_name(f".{folder.name}.old")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with writing("the best checkpoint", tmp):
            save_model(model, tokenizer, tmp)
            (tmp / BEST_RECORD).write_text(json.dumps(record, indent=1))
    except BaseException:   # a full disk, a signal: no temporary folder left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        folder.rename(old)
    tmp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)
