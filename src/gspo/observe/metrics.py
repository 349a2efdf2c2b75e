"""Metric sinks: one JSON object per step in ``metrics.jsonl``, mirrored to the experiment
trackers of ``run.trackers`` (gspo.observe.trackers: TensorBoard by default).

A row is appended as one whole line; a write that fails part-way (a full disk) is cut back and
raises ``WriteFailed`` (gspo.storage), so the file never ends in half a row. A line cut short by a
kill is skipped by ``read_metrics`` and dropped on resume (``truncate_after``). A tracker's failed
write is named the same way (``Tracker.files``).
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

from gspo.observe.samples import truncate_samples
from gspo.storage import append_line, write_atomic, writing
from gspo.observe.trackers import open_trackers


def _clean(value):
    """JSON has no NaN/Inf: write them as strings so the file stays parseable everywhere."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsWriter:
    """Every row goes to metrics.jsonl at once; the trackers (``trackers``: names in
    gspo.observe.trackers, opened with ``config``) are flushed at most every ``flush_s`` seconds (and by
    ``flush`` / ``close``: checkpoints, pauses, the end), not per row."""

    def __init__(self, run_dir: str | Path, trackers: list[str] = (), config: dict | None = None,
                 flush_s: float = 2.0):
        self.flush_s, self._flushed = flush_s, time.monotonic()
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _quiet_tensorboard_thread()
        with writing("the trackers' files", Path(run_dir)):
            self._trackers = open_trackers(list(trackers), Path(run_dir), config or {})

    @staticmethod
    def _writing(tracker):
        """A failed write of ``tracker`` is one named WriteFailed (a full disk), not a traceback."""
        what, where = tracker.files()
        return writing(what, where)

    def truncate_after(self, step: int) -> None:
        """On resume: drop rows past the checkpoint (and a line cut short by a kill) so the log
        matches the restored state (samples.jsonl too). Rewritten atomically: a second kill loses
        nothing."""
        truncate_samples(self.path.parent, step)
        if not self.path.is_file():
            return
        rows = [line for line in self.path.read_text().splitlines()
                if (row := _parse(line)) is not None and row.get("step", -1) <= step]
        with writing(f"metrics.jsonl cut back to step {step}", self.path):
            write_atomic(self.path, "".join(r + "\n" for r in rows))

    def write(self, row: dict) -> None:
        with writing(f"the metrics row of step {row.get('step')}", self.path):
            append_line(self.path, json.dumps({k: _clean(v) for k, v in row.items()}))
        if self._trackers:
            numbers = {k: v for k, v in row.items()
                       if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
            for tracker in self._trackers:
                with self._writing(tracker):
                    tracker.log(numbers, row["step"])
            if time.monotonic() - self._flushed >= self.flush_s:
                self.flush()

    def log_samples(self, rows: list[dict], step: int) -> None:
        """What the model wrote at ``step`` (gspo.observe.samples) to the trackers that show text."""
        for tracker in self._trackers:
            with self._writing(tracker):
                tracker.log_samples(rows, step)

    def flush(self) -> None:
        """Write the trackers' pending events now."""
        for tracker in self._trackers:
            with self._writing(tracker):
                tracker.flush()
        self._flushed = time.monotonic()

    def close(self) -> None:
        for tracker in self._trackers:
            with self._writing(tracker):
                tracker.close()


class NullWriter:
    """The sink of ranks other than 0 under torchrun: rank 0 alone writes (gspo.training.distributed)."""

    def truncate_after(self, step: int) -> None:
        pass

    def write(self, row: dict) -> None:
        pass

    def log_samples(self, rows: list[dict], step: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def _quiet_tensorboard_thread() -> None:
    """TensorBoard writes events in a thread; a failed write (a full disk) there would print a
    thread traceback, and is raised again by the writer's next call on the main thread (where
    ``writing`` names it). Keep only the latter: one line instead of a traceback and a line."""
    previous = threading.excepthook
    if getattr(previous, "gspo_tensorboard", False):
        return

    def hook(args) -> None:
        if not (isinstance(args.exc_value, OSError)
                and type(args.thread).__module__.startswith("tensorboard.")):
            previous(args)
    hook.gspo_tensorboard = True
    threading.excepthook = hook


def _parse(line: str) -> dict | None:
    """A row, or None for a blank line or one cut short (a run killed while writing it)."""
    try:
        return json.loads(line) if line.strip() else None
    except ValueError:
        return None


def read_metrics(run_dir: str | Path) -> list[dict]:
    """All rows; a last line cut short by a kill (or still being written) is left out."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = [json.loads(line) for line in lines[:-1]]
    last = _parse(lines[-1]) if lines else None
    return rows + ([last] if last is not None else [])


def report_progress(bar, row: dict, last_acc: float, steps: int, log=None) -> None:
    """A step's figures on the progress ``bar``; with ``log`` (no bar shown), a line every 10
    steps and at the last."""
    done = row["step"]
    bar.set_postfix(reward=f"{row.get('reward/mean', float('nan')):.2f}", acc=f"{last_acc:.2f}",
                    clip=f"{row.get('policy/clip_frac_tokens', float('nan')):.3f}")
    if log is not None and (done % 10 == 0 or done == steps):
        log(f"step {done}/{steps} reward {row.get('reward/mean', 0):.3f} "
            f"held-out acc {last_acc:.3f} clip {row.get('policy/clip_frac_tokens', 0):.4f}")
