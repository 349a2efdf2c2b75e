"""The errors a user sees, and the exit codes of the command line.

* ``UserError``: something the user can fix (config, data, paths, their reward code). The CLI
  prints its one-line message and exits ``EXIT_USAGE`` (2), without a traceback.
* ``RewardError``: a reward source failed on a sample under ``reward.on_error: fail``; a
  ``UserError``, so the same one line and exit code.
* ``Interrupted``: SIGINT / SIGTERM stopped training; carries the checkpoint that was saved. The
  CLI exits ``128 + signal number`` (130 for SIGINT, 143 for SIGTERM), as a shell would.
* ``WriteFailed``: a file of the run could not be written (a full disk, a quota, a read-only
  remount); one line naming the file, the last complete checkpoint and how to resume, exit
  ``EXIT_WRITE`` (4).

Anything else escaping the CLI is a bug and keeps its traceback (exit 1). This module holds only
types and numbers; the checks live in ``preflight``, ``data`` and ``isolation``.
"""

from __future__ import annotations

import signal
from pathlib import Path

EXIT_OK = 0
EXIT_BUG = 1  # Python's own status for an uncaught exception
EXIT_USAGE = 2
EXIT_WRITE = 4  # a run's file could not be written (disk full...): free space, then --resume


class UserError(Exception):
    """A problem the user can fix; its message is one line that names the key, file:line or sample."""


class RewardError(UserError):
    """A reward source failed on a sample and ``reward.on_error`` is ``fail``."""


class Interrupted(Exception):
    """Training stopped on a signal; ``checkpoint`` is where it can be resumed from (or None)."""

    def __init__(self, signum: int, step: int | None, checkpoint: Path | None, run_dir: Path):
        self.signum, self.step, self.checkpoint, self.run_dir = signum, step, checkpoint, run_dir
        name = signal.Signals(signum).name
        if checkpoint is not None:
            where = f"after step {step}: checkpoint saved in {checkpoint}"
        else:
            where = "before a checkpoint could be saved"
        super().__init__(f"interrupted by {name} {where}; continue with: gspo train --resume {run_dir}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class RewardFault(Exception):
    """One sample's reward could not be computed (an exception, a hang, a non-number...).

    Internal: the reward layer turns it into ``reward.on_error`` (zero, drop or a RewardError).
    """


class WriteFailed(Exception):
    """A file of a run could not be written: ``what`` (e.g. "the metrics row of step 3"), its
    ``path`` and the file system's ``reason``. ``after`` is filled in by whoever knows the run
    (gspo.rundir): its last complete checkpoint and how to continue."""

    exit_code = EXIT_WRITE

    def __init__(self, what: str, path: Path, reason: str):
        self.what, self.path, self.reason = what, path, reason
        self.after = ""
        super().__init__(what, str(path), reason)

    def __str__(self) -> str:
        line = f"could not write {self.what} ({self.path}): {self.reason}"
        return f"{line}; {self.after}" if self.after else line
