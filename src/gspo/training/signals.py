"""SIGINT / SIGTERM during training: finish the step, save a checkpoint, exit with 128 + signal.

``GracefulStop`` is a context manager the CLI wraps around ``Trainer.run``. The first signal only
records itself; the trainer looks at ``signum`` between steps (``Trainer.stop_if_requested``),
saves a checkpoint of the last finished step and raises ``Interrupted``. A second signal stops at
once, without saving (the previous checkpoints are intact: they are written atomically).

Not a supervisor: SIGKILL cannot be caught; exact resume from the last periodic checkpoint is
what covers it (docs/reliability.md).
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

from gspo.errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulStop:
    """Records the first SIGINT/SIGTERM in ``signum``; raises ``Interrupted`` on the second."""

    def __init__(self, run_dir: str | Path, log=None):
        self.run_dir = Path(run_dir)
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:  # the second one: stop now
            raise Interrupted(signum, None, None, self.run_dir)
        self.signum = signum
        self.log(f"gspo: {signal.Signals(signum).name} received: stopping after the current step and "
                 f"saving a checkpoint (send it again to stop at once, without saving)")

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():  # handlers only work there
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
