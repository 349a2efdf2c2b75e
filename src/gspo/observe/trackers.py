"""Experiment trackers: where the step metrics go besides ``metrics.jsonl``, by name (``run.trackers``).

A tracker is opened with the run folder and the run's config, then receives one row of numeric
metrics per step (``log``), ``flush`` at checkpoints and ``close`` at the end. All of them work
without a network: tensorboard writes ``run.dir/tb``; wandb runs in offline mode (``run.dir/wandb``,
``wandb sync`` uploads later) unless ``WANDB_MODE`` says otherwise; mlflow logs to a local
``file:`` store (``run.dir/mlruns``) unless ``MLFLOW_TRACKING_URI`` names another; trackio writes
its local database. The packages are optional: ``check_available`` names a missing one before
anything is built. Nothing here knows about training.
"""

from __future__ import annotations

import importlib.util
import os
import re
import time
from pathlib import Path

from gspo.observe.samples import as_markdown
from gspo.registry import Registry

PROJECT = "gspo"


class Tracker:
    """One destination of the metric rows."""

    package: str = ""
    """The Python package it needs (checked by ``check_available``)."""
    pip: str = ""
    """What to pip install for it (default: ``package``)."""

    def __init__(self, run_dir: Path, config: dict):
        self.run_dir, self.config = run_dir, config

    def files(self) -> tuple[str, Path]:
        """What this tracker writes and where, for the one-line error of a failed write."""
        return f"the {type(self).__name__} tracker's files", self.run_dir

    def log(self, row: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def log_samples(self, rows: list[dict], step: int) -> None:
        """What the model wrote (gspo.observe.samples rows); a tracker without text ignores them."""

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


TRACKERS: Registry[type[Tracker]] = Registry("tracker")


register = TRACKERS.register
"""Class decorator: ``@register(name)`` makes the tracker ``name`` of ``run.trackers``."""
available = TRACKERS.names
"""Sorted names of the trackers (installed or not)."""


def check_available(names: list[str]) -> None:
    """ValueError (one line, naming run.trackers and the package) for a tracker not installed."""
    for name in names:
        tracker = TRACKERS.get(name)
        if importlib.util.find_spec(tracker.package) is None:
            raise ValueError(f"run.trackers: {name} needs the {tracker.package!r} package, which is "
                             f"not installed (pip install {tracker.pip or tracker.package}, or drop "
                             f"it from run.trackers)")


def open_trackers(names: list[str], run_dir: str | Path, config: dict) -> list[Tracker]:
    return [TRACKERS.get(name)(Path(run_dir), config) for name in names]


@register("tensorboard")
class TensorBoard(Tracker):
    package = "tensorboard"

    def __init__(self, run_dir: Path, config: dict):
        super().__init__(run_dir, config)
        from torch.utils.tensorboard import SummaryWriter  # optional package: only when chosen
        self.writer = SummaryWriter(str(run_dir / "tb"))

    def files(self) -> tuple[str, Path]:
        return "TensorBoard events", self.run_dir / "tb"

    def log(self, row: dict[str, float], step: int) -> None:
        for key, value in row.items():
            self.writer.add_scalar(key, value, step)

    def log_samples(self, rows: list[dict], step: int) -> None:
        self.writer.add_text("samples", as_markdown(rows), step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


@register("wandb")
class WandB(Tracker):
    package = "wandb"

    def __init__(self, run_dir: Path, config: dict):
        super().__init__(run_dir, config)
        import wandb  # optional package: only when chosen
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=run_dir.name,
                              dir=str(run_dir), config=config,
                              mode=os.environ.get("WANDB_MODE", "offline"), reinit="create_new")

    def log(self, row: dict[str, float], step: int) -> None:
        self.run.log(row, step=step)

    def log_samples(self, rows: list[dict], step: int) -> None:
        import wandb
        table = wandb.Table(columns=["step", "prompt", "completion", "reward", "advantage", "ratio",
                                     "clip_frac"])
        for row in rows:
            for c in row["completions"]:
                table.add_data(step, row["prompt"], c["text"], c["reward"], c["advantage"],
                               c["ratio"], c["clip_frac"])
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


# MLflow metric names allow letters, digits, _ - . space : and /; "eval/pass@1" becomes "eval/pass_1"
MLFLOW_UNSAFE = re.compile(r"[^\w\-. :/]")


@register("mlflow")
class MLflow(Tracker):
    package, pip = "mlflow", "mlflow-skinny"

    def __init__(self, run_dir: Path, config: dict):
        super().__init__(run_dir, config)
        from mlflow import MlflowClient  # optional package: only when chosen
        from mlflow.entities import Metric
        self.metric = Metric
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").absolute().as_uri()
        if uri.startswith("file:"):  # MLflow 3 keeps the file store behind an opt-in
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(PROJECT)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(PROJECT))
        self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
        flat = _flatten(config)
        for key in list(flat)[:100]:  # MLflow's batch limit on params
            self.client.log_param(self.run_id, MLFLOW_UNSAFE.sub("_", key), str(flat[key])[:500])

    def log(self, row: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        metrics = [self.metric(MLFLOW_UNSAFE.sub("_", k), float(v), now, step) for k, v in row.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


@register("trackio")
class Trackio(Tracker):
    package = "trackio"

    def __init__(self, run_dir: Path, config: dict):
        super().__init__(run_dir, config)
        import trackio  # optional package: only when chosen
        self.trackio = trackio
        self.run = trackio.init(project=PROJECT, name=run_dir.name, config=config)

    def log(self, row: dict[str, float], step: int) -> None:
        self.trackio.log(row, step=step)

    def close(self) -> None:
        self.trackio.finish()


def _flatten(tree: dict, prefix: str = "") -> dict:
    """{'a': {'b': 1}} -> {'a.b': 1}"""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
