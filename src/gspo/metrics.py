"""Metric sinks: one JSON object per step in ``metrics.jsonl``, mirrored to TensorBoard."""

from __future__ import annotations

import json
import math
from pathlib import Path


def _clean(value):
    """JSON has no NaN/Inf: write them as strings so the file stays parseable everywhere."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsWriter:
    def __init__(self, run_dir: str | Path, tensorboard: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(str(Path(run_dir) / "tb"))

    def truncate_after(self, step: int) -> None:
        """On resume: drop rows past the checkpoint so the log matches the restored state."""
        if not self.path.is_file():
            return
        rows = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", -1) <= step]
        self.path.write_text("".join(r + "\n" for r in rows))

    def write(self, row: dict) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")
        if self._tb is not None:
            step = row["step"]
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
