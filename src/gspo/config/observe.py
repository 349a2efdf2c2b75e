"""Sections for the run folder and what watches the run (``gspo.observe``, ``gspo.training``'s
guard and faults): run, guard, audit, monitor, faults."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from gspo.config.base import Section, one_of
from gspo.observe.stability_rules import check_rule
from gspo.observe.trackers import available as available_trackers


class RunConfig(Section):
    dir: str = "runs/default"
    """Output folder: config.yaml, metrics.jsonl, TensorBoard events, checkpoints, report.md."""
    save_every: int = Field(50, ge=0)
    """Checkpoint every this many RL steps (0: only at the end)."""
    eval_every: int = Field(25, ge=0)
    """Held-out evaluation every this many RL steps (0: only before and after training)."""
    overwrite: bool = False
    """Replace a previous run found in run.dir (otherwise refuse; --resume continues it)."""
    keep_checkpoints: int = Field(2, ge=1)
    """How many step checkpoints to keep (the final one is always kept)."""
    trackers: list[str] = ["tensorboard"]
    """Experiment trackers besides metrics.jsonl: tensorboard | wandb | mlflow | trackio; [] for none (docs/real-models.md)."""
    samples_every: int = Field(10, ge=0)
    """Every this many RL steps, a few prompts' completions with rewards, advantages, ratio and clip to samples.jsonl and the trackers (0: never)."""
    samples_prompts: int = Field(2, ge=1)
    """Prompts (each with its G completions) kept per samples_every step."""
    progress: bool = True
    """Show a progress bar (disabled automatically when stderr is not a terminal)."""
    threads: int = Field(1, ge=0)
    """torch CPU threads, set when training starts (0: torch's default, one per core); docs/performance.md."""

    @model_validator(mode="before")
    @classmethod
    def _tensorboard_key(cls, data: Any) -> Any:
        """The former ``run.tensorboard: bool`` (old configs, old runs' config.yaml): mapped to
        ``run.trackers`` ([tensorboard] or []); refused when given together with run.trackers."""
        if not isinstance(data, dict) or "tensorboard" not in data:
            return data
        data = dict(data)
        old = data.pop("tensorboard")
        if "trackers" in data:
            raise ValueError("run.tensorboard was replaced by run.trackers: give only run.trackers "
                             "(e.g. run.trackers=[tensorboard] or run.trackers=[])")
        if not isinstance(old, bool):
            raise ValueError(f"run.tensorboard (replaced by run.trackers) must be true or false, got {old!r}")
        data["trackers"] = ["tensorboard"] if old else []
        return data

    @field_validator("trackers")
    @classmethod
    def _trackers(cls, names: list[str]) -> list[str]:
        for name in names:
            one_of("tracker", name, available_trackers())
        if len(set(names)) < len(names):
            raise ValueError(f"a tracker is listed twice: {names}")
        return names


GuardAction = Literal["warn", "skip", "pause", "rollback"]


class GuardRule(Section):
    kind: str
    """Rule kind (gspo.observe.stability_rules.available()): nan | clip_frac | approx_kl | kl_ref | grad_norm | entropy | reward_drop | moe_imbalance | metric."""
    threshold: float | None = None
    """The limit (every kind but nan): the metric above it fires (below it for entropy; reward_drop: the drop below the moving average)."""
    action: GuardAction = "warn"
    """warn | skip (discard this step's update) | pause (save, exit 3) | rollback (last good checkpoint)."""
    metric: str | None = None
    """The metric watched: required for kind=metric, otherwise replaces the kind's default metric."""
    below: bool | None = None
    """kind=metric: fire when the value falls below the threshold (default: above)."""
    ema: float | None = Field(None, gt=0, lt=1)
    """reward_drop: weight of the past in the moving average (default 0.9)."""
    warmup: int = Field(0, ge=0)
    """Skip this many RL steps before the rule is checked."""
    judges: Literal["update", "batch"] | None = None
    """What a firing rule blames, so where a roll-back goes: update | batch (default: the kind's); docs/trust.md."""

    @model_validator(mode="after")
    def _kind(self) -> "GuardRule":
        check_rule(self)
        return self


class GuardConfig(Section):
    nan: Literal["off", "warn", "skip", "pause", "rollback"] = "skip"
    """Action when any step metric (loss, gradient norm, reward, ...) is NaN or Inf."""
    rules: list[GuardRule] = []
    """Threshold rules checked after every RL step, e.g. [{kind: clip_frac, threshold: 0.5, action: rollback}]."""
    max_rollbacks: int = Field(3, ge=0)
    """Roll-backs allowed per run; a roll-back beyond them pauses the run instead."""
    rollback_lr_scale: float = Field(1.0, gt=0, le=1)
    """Multiply the learning rate by this at every roll-back (1: unchanged)."""
    snapshot_device: Literal["cpu", "same"] = "cpu"
    """Where the pre-step copy of weights and optimizer (kept for skip / pause rules) lives."""


class AuditConfig(Section):
    every: int = Field(0, ge=0)
    """Record the rollout batch, π_old and π_new of every K-th RL step under run.dir/audit/ (0: off); check with `gspo audit`."""


class MonitorConfig(Section):
    length_buckets: int = Field(4, ge=0)
    """Equal-width response-length buckets over 1..max_new_tokens for the length/<lo>-<hi>/* metrics (0: off)."""


class FaultsConfig(Section):
    lr_factor: float = Field(1.0, gt=0)
    """Deliberate fault, to exercise the guard: multiply the learning rate by this (e.g. 1000) ..."""
    lr_from_step: int = Field(1, ge=1)
    """... from this RL step on (1-based, as logged)."""
