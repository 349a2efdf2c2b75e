"""The run folder: one writer at a time, and what a write that failed tells the user.

* ``RunLock``: a ``filelock.FileLock`` (``flock`` on POSIX) on ``RUN/.gspo.lock``, taken by the
  process that writes the run (``gspo train``, with ``--resume`` or ``run.overwrite=true`` too)
  before it changes anything, and held for the run's life. The kernel releases it when the process
  ends, however it ends (SIGKILL included), so nothing is left to clean up. The holder's PID, host
  and command go to ``RUN/.gspo.lock.holder`` (written atomically once the lock is ours), which a
  refused writer names. Under torchrun only rank 0 writes the folder, so
  rank 0 alone takes it (the trainer claims the folder on rank 0). Readers (``gspo report``,
  ``audit``, ``eval``) never take it: they read a live run.
* ``write_faults(run_dir)``: around training; a ``WriteFailed`` (gspo.storage), or a storage error
  about the run that nobody named yet, gets the run's last complete checkpoint and how to resume.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Iterator

from gspo.errors import UserError, WriteFailed
from filelock import FileLock, Timeout

from gspo.observe.outcome import accuracy_change
from gspo.storage import STORAGE_ERRNOS, reason, write_atomic
from gspo.training.checkpoint import checkpoint_step, list_checkpoints, remove_partial

LOCK_FILE = ".gspo.lock"
HOLDER_FILE = ".gspo.lock.holder"


class RunLock:
    """An exclusive lock on a run folder, held until ``release`` or the process's end."""

    def __init__(self, path: Path, lock: FileLock | None):
        self.path, self._lock = path, lock

    @classmethod
    def acquire(cls, run_dir: str | Path, log=None) -> "RunLock":
        """Take the lock of ``run_dir`` (which exists) or raise UserError naming its holder."""
        path = Path(run_dir) / LOCK_FILE
        lock = FileLock(path, thread_local=False)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            holder = describe_holder(read_holder(Path(run_dir)))
            raise UserError(f"run.dir {run_dir} is in use by {holder}: one process writes a run "
                            f"at a time; wait for it to end or stop it (a stopped or killed run "
                            f"releases it), or choose another run.dir") from None
        except OSError as err:            # a file system without flock (some network mounts)
            if log is not None:
                log(f"run.dir {run_dir}: cannot lock {path} ({err.strerror}); nothing stops a "
                    f"second process from writing this run")
            return cls(path, None)
        with contextlib.suppress(OSError):  # a full disk: the lock holds without its label
            write_atomic(Path(run_dir) / HOLDER_FILE, json.dumps(holder_info()))
        return cls(path, lock)

    @property
    def held(self) -> bool:
        return self._lock is not None

    def release(self) -> None:
        """Release the lock (as the process's end would)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def claim(run_dir: Path, *, resume: bool, overwrite: bool, log, lock: RunLock | None = None
          ) -> RunLock:
    """Lock ``run_dir`` for this process (``lock``: already ours) and remove what a killed writer
    left half-written; a fresh run never mixes with an old one: refuse, or clear it when
    ``overwrite``. Returns the lock (released again when refusing one it took)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    taken = lock is None or not lock.held
    if taken:
        lock = RunLock.acquire(run_dir, log=log)
    remove_partial(run_dir)
    previous = [run_dir / n for n in ("metrics.jsonl", "checkpoints", "summary.json", "tb",
                                      "events.jsonl", "audit", "best")]
    previous = [p for p in previous if p.exists()]
    if previous and not resume:
        if not overwrite:
            if taken:
                lock.release()
            raise FileExistsError(
                f"run.dir {run_dir} already holds a run: use --resume {run_dir} to "
                f"continue it, run.overwrite=true to replace it, or another run.dir")
        log(f"run.overwrite: replacing the previous run in {run_dir}")
        for p in previous:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    return lock


def read_holder(run_dir: Path) -> str:
    """The holder file's text ('' when there is none yet)."""
    try:
        return (run_dir / HOLDER_FILE).read_text()
    except OSError:
        return ""


def holder_info() -> dict:
    """What a refused writer is told about this process."""
    program = Path(sys.argv[0]).name
    program = "gspo" if program in ("__main__.py", "gspo") else program  # python -m gspo
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "command": " ".join([program, *sys.argv[1:]]),
            "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def describe_holder(text: str) -> str:
    """'PID 123 on host (gspo train --resume runs/a, since ...)' from the lock file's text."""
    try:
        info = json.loads(text)
        return (f"PID {info['pid']} on {info['host']} ({info['command']}, since "
                f"{info['since']})")
    except (ValueError, KeyError, TypeError):   # taken an instant ago, not labelled yet
        return "another process"


# ------------------------------------------------------------------------------ write faults
def resume_hint(run_dir: str | Path) -> str:
    """The last complete checkpoint of the run and the command that continues it."""
    run = Path(run_dir)
    if not (run / "config.yaml").is_file():
        return "nothing of the run was saved yet: free space, then start it again"
    done = list_checkpoints(run)          # renamed into place only once whole (gspo.training.checkpoint)
    where = (f"the last complete checkpoint is {done[-1]} (step {checkpoint_step(done[-1])})"
             if done else "no checkpoint is complete yet (a resume starts again from step 0)")
    return f"{where}; free space, then continue with: gspo train --resume {run}"


def about_run(err: OSError, run_dir: Path) -> bool:
    """Whether ``err`` is the storage failing, or any failure to write a file of the run."""
    if err.errno in STORAGE_ERRNOS:
        return True
    name = err.filename
    return name is not None and Path(os.fsdecode(name)).absolute().is_relative_to(
        run_dir.absolute())


@contextlib.contextmanager
def write_faults(run_dir: str | Path, after: str | None = None) -> Iterator[None]:
    """Within: a failed write of the run raises ``WriteFailed`` saying what ``after`` says (by
    default, the last complete checkpoint and the resume command)."""
    run = Path(run_dir)
    try:
        yield
    except WriteFailed as err:
        err.after = after or resume_hint(run)
        raise
    except OSError as err:
        if not about_run(err, run):
            raise
        fault = WriteFailed("a file of the run", Path(os.fsdecode(err.filename or run)),
                            reason(err))
        fault.after = after or resume_hint(run)
        raise fault from err


def run_summary(cfg, history: dict, init_info: dict, final: Path, wall: float, data=None) -> dict:
    """summary.json of a finished run: held-out accuracy before and after (and its change),
    the best validation checkpoint, the cold start, the final checkpoint, skipped data."""
    after = history.get("eval_last") or history["eval_before"]
    return {
        "objective": cfg.objective.name, "task": cfg.task.name, "seed": cfg.seed,
        "steps": cfg.train.steps, "wall_s": round(wall, 1), "eval_split": cfg.eval.split,
        "eval_before": history["eval_before"], "eval_after": after,
        "accuracy_gain": after["accuracy"] - history["eval_before"]["accuracy"],
        "accuracy_change": accuracy_change(history["eval_before"], after),   # fell: stated
        "best_validation": history.get("best_validation"),   # None: no validation split
        "cold_start": init_info, "final_checkpoint": str(final),
        "data": data,                                        # examples skipped (data.on_error)
    }
