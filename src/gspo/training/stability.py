"""The stability guard's actions: undo a step, roll back, pause, scale the learning rate.

``StabilityGuard`` runs the rules of ``gspo.observe.stability_rules`` after every RL step and
carries out the most severe action of the step's triggers: a copy of weights / optimizer /
scheduler before each step when a ``skip`` or ``pause`` rule exists, ``events.jsonl`` + console,
undoing a step, rolling back to the last checkpoint that passed, learning-rate scaling, and
pausing with ``GuardPause`` (the CLI exits with ``EXIT_PAUSED``).

Actions, by severity: ``warn`` < ``skip`` (discard this step's update) < ``rollback`` (restore the
last checkpoint that passed, scale the learning rate, continue; at most ``max_rollbacks`` times,
then pause) < ``pause`` (discard this step's update, save a checkpoint, stop).

Where a roll-back goes depends on what the rule judges. A rule on the update (its KL, clipped
share, gradient norm) blames step N: back to the checkpoint before N. A rule on the sampled batch
(its reward, the sampler's tail) blames the weights that drew it, those of update N − 1: back to
a checkpoint before N − 1, since from N − 1's checkpoint step N would draw the same batch again
and fire again, whatever the learning rate (measured: docs/results/stability.md, "The guard on a
real collapse").

It is handed the policy, its optimizer and scheduler, the metrics sink and a ``RunControl``
(checkpoint now, restore a checkpoint, rank 0 decides); never the trainer. What it is not: a fix.
It stops a run from compounding damage and records what it saw; the thresholds are the user's
(docs/trust.md), and only the NaN/Inf rule is on by default.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import torch

from gspo.observe.metrics import MetricsWriter
from gspo.observe.stability_rules import (EVENTS_FILE, Rule, decide, evaluate, finite_row,
                                          initial_state, observe, resolve_rules)
from gspo.training.checkpoint import drop_after, load_latest

EXIT_PAUSED = 3
"""Exit status of `gspo train` when the guard pauses the run."""


class GuardPause(RuntimeError):
    """The guard stopped the run; ``checkpoint`` resumes it (``gspo train --resume RUN``)."""

    exit_code = EXIT_PAUSED

    def __init__(self, message: str, checkpoint: Path | None, step: int):
        super().__init__(message)
        self.checkpoint, self.step = checkpoint, step


@dataclass(kw_only=True)
class RunControl:
    """What the guard may do to the run besides its weights (the trainer hands it these)."""
    save_now: Callable[[int], Path]
    """Checkpoint the run as it is after ``step`` RL steps."""
    restore: Callable[[object], None]
    """Weights, optimizer, scheduler, data position and step of a loaded checkpoint."""
    on_main: Callable
    """``on_main(fn)``: ``fn()`` on rank 0, its result on every rank."""
    is_main: bool
    """This process writes the event log (rank 0 under torchrun)."""


class StepGuard(Protocol):
    """The hooks the loop calls around each RL step (gspo.training.stability.StabilityGuard)."""

    def on_start(self, step: int) -> None:
        """Before the first step of this session (a roll-back needs a checkpoint to go to)."""

    def before_step(self, step: int) -> None:
        """Learning rate for ``step``; a snapshot when a rule may undo the step."""

    def after_step(self, row: dict) -> int | None:
        """The verdict on the step's metrics: None to go on, or the step rolled back to."""

    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict | None) -> None: ...


# ----------------------------------------------------------------------------- state copies

def clone_state(obj, device):
    """Deep copy of a (nested) state dict, tensors copied to ``device`` (None: where they are)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(device or obj.device, copy=True)
    if isinstance(obj, dict):
        return {k: clone_state(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_state(v, device) for v in obj)
    return copy.deepcopy(obj)


def clone_into(old, obj, device):
    """``clone_state(obj, device)``, written into the tensors of ``old`` (an earlier clone) wherever
    they match in place, shape and dtype: no new allocation from one step to the next."""
    if isinstance(obj, torch.Tensor):
        target = torch.device(device) if device else obj.device
        if (isinstance(old, torch.Tensor) and old.shape == obj.shape and old.dtype == obj.dtype
                and old.device == target):
            return old.copy_(obj.detach())
        return clone_state(obj, device)
    if isinstance(obj, dict):
        old = old if isinstance(old, dict) else {}
        return {k: clone_into(old.get(k), v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        old = old if isinstance(old, (list, tuple)) and len(old) == len(obj) else [None] * len(obj)
        return type(obj)(clone_into(o, v, device) for o, v in zip(old, obj))
    return copy.deepcopy(obj)


def snapshot(model, optimizer, scheduler, device: str | None = "cpu", into: dict | None = None) -> dict:
    """Copies of the weights, optimizer and scheduler state (restored by ``restore``); ``into``:
    an earlier snapshot whose tensors are overwritten and reused (it is no longer a snapshot)."""
    into = into or {}
    return {"model": clone_into(into.get("model"), model.state_dict(), device),
            "optimizer": clone_into(into.get("optimizer"), optimizer.state_dict(), device),
            "scheduler": copy.deepcopy(scheduler.state_dict())}


def restore(snap: dict, model, optimizer, scheduler) -> None:
    model.load_state_dict(snap["model"])
    optimizer.load_state_dict(clone_state(snap["optimizer"], None))
    scheduler.load_state_dict(copy.deepcopy(snap["scheduler"]))


def set_lr_multiplier(optimizer, scheduler, base_lrs: list[float], multiplier: float) -> None:
    """Make the peak learning rates ``base_lrs × multiplier`` (the schedule's shape is kept)."""
    for i, group in enumerate(optimizer.param_groups):
        target = base_lrs[i] * multiplier
        if scheduler.base_lrs[i] != target:
            group["lr"] *= target / scheduler.base_lrs[i]
            group["initial_lr"] = scheduler.base_lrs[i] = target


def last_good_checkpoint(run_dir: Path, warn=print, before: int | None = None):
    """The newest checkpoint that verifies and was saved by a step that passed the guard (and,
    with ``before``, by a step before that one)."""
    def accept(state: dict) -> bool:
        passed = state.get("guard", {}).get("passed", True)
        return passed and (before is None or state["step"] < before)
    return load_latest(run_dir, warn, accept=accept, who="guard")


def rollback_before(step: int, triggers) -> int:
    """The step a roll-back's checkpoint must precede: ``step`` when the roll-back rules blame
    the update, ``step - 1`` when one blames the batch (drawn by update step - 1's weights)."""
    blames_batch = any(t.action == "rollback" and t.judges == "batch" for t in triggers)
    return step - 1 if blames_batch else step


# ----------------------------------------------------------------------------- the guard

@dataclass(kw_only=True)
class StabilityGuard:
    """Runs the rules after every step and carries out their actions on the run.

    The loop calls ``before_step(step)`` (learning rate, snapshot) and ``after_step(row)``; the
    latter returns the step to continue from after a roll-back (else None) and raises
    ``GuardPause``. ``on_start(step)`` makes sure a roll-back has a checkpoint to go to.
    """
    cfg: object                                   # GuardConfig
    faults: object                                # FaultsConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    run_dir: Path
    metrics: MetricsWriter
    run: RunControl
    log: Callable[[str], None] = print
    base_lrs: list[float] = field(init=False)
    """The schedule's peak learning rates before any scaling."""
    rules: list[Rule] = field(init=False)
    state: dict = field(init=False)
    passed: bool = field(default=True, init=False)
    """False once an update that fired a rule could not be undone (checkpoints say so)."""
    snap: dict | None = field(default=None, init=False, repr=False)
    """The pre-step copy of weights / optimizer / scheduler (skip and pause rules)."""
    missing_warned: set = field(default_factory=set, init=False, repr=False)

    def __post_init__(self):
        self.base_lrs = list(self.scheduler.base_lrs)
        self.rules = resolve_rules(self.cfg)
        self.state = initial_state(self.rules)

    @property
    def needs_snapshot(self) -> bool:
        return any(r.action in ("skip", "pause") for r in self.rules)

    def state_dict(self) -> dict:
        """What a checkpoint keeps: rule state, roll-backs so far, lr scale, and whether it passed."""
        return {**copy.deepcopy(self.state), "passed": self.passed}

    def load_state_dict(self, state: dict | None, *, keep_counters: bool = False) -> None:
        """Restore from a checkpoint; a roll-back keeps the current roll-back count and lr scale."""
        if not state or len(state.get("rules", [])) != len(self.rules):
            return                                  # older checkpoint or other rules: start fresh
        counters = {k: self.state[k] for k in ("rollbacks", "lr_scale", "triggers")}
        self.state = {k: copy.deepcopy(v) for k, v in state.items() if k != "passed"}
        if keep_counters:
            self.state.update(counters)

    def lr_multiplier(self, step: int) -> float:
        """Roll-back scaling times the injected fault factor (``step`` 0-based)."""
        fault = self.faults.lr_factor if step + 1 >= self.faults.lr_from_step else 1.0
        return self.state["lr_scale"] * fault

    # ------------------------------------------------------------------ hooks
    def before_step(self, step: int) -> None:
        set_lr_multiplier(self.optimizer, self.scheduler, self.base_lrs, self.lr_multiplier(step))
        last, self.snap = self.snap, None
        if self.needs_snapshot:   # into the last step's buffers (restore copies out of them)
            device = "cpu" if self.cfg.snapshot_device == "cpu" else None
            self.snap = snapshot(self.model, self.optimizer, self.scheduler, device, into=last)

    def on_start(self, step: int) -> None:
        """With a rollback rule, make sure a checkpoint exists to roll back to (``step``, the start)."""
        if any(r.action == "rollback" for r in self.rules) and self.run.on_main(  # ranks agree
                lambda: last_good_checkpoint(self.run_dir, warn=self.log) is None):
            self.run.save_now(step)

    def after_step(self, row: dict) -> int | None:
        step = row["step"]
        self.warn_missing(row)
        triggers = evaluate(self.rules, row, self.state, step)
        action = decide(triggers)
        self.state["triggers"] += len(triggers)
        for t in triggers:
            self.log(f"guard: step {step}: {t.describe()}")
            self.event("trigger", **asdict(t), metrics=finite_row(row))
        row.update({"guard/triggers": len(triggers), "guard/skipped": 0.0})
        if action == "rollback":
            before = rollback_before(step, triggers)
            if self.state["rollbacks"] < self.cfg.max_rollbacks:
                loaded = self.rollback(step, before=before)
                if loaded is not None:
                    return loaded.state["step"]
            else:
                self.log(f"guard: step {step}: all {self.cfg.max_rollbacks} roll-backs used; "
                         f"pausing at the last checkpoint that passed")
                loaded = self.rollback(step, count=False, before=before)
                if loaded is not None:
                    self.stop(step, loaded.path)
            action = "pause"                         # nothing to roll back to
        if action in ("skip", "pause"):
            self.discard(row)
        if action == "pause":
            self.metrics.write(row)
            self.stop(step, self.run.save_now(step))
        if action != "skip":
            self.state = observe(self.rules, row, self.state)
        row.update({"guard/rollbacks": self.state["rollbacks"],
                    "guard/lr_scale": self.state["lr_scale"]})
        return None

    # ------------------------------------------------------------------ actions
    def discard(self, row: dict) -> None:
        """Undo this step's update from the pre-step snapshot."""
        if self.snap is None:                        # only a rollback rule escalated to pause
            self.passed = False
            self.log(f"guard: step {row['step']}: no snapshot, the update stays (checkpoint "
                     f"marked as not passed)")
            return
        restore(self.snap, self.model, self.optimizer, self.scheduler)
        row["guard/skipped"] = 1.0
        self.event("skip", step=row["step"])
        self.log(f"guard: step {row['step']}: update discarded (weights, optimizer restored)")

    def rollback(self, step: int, count: bool = True, before: int | None = None):
        """Restore the last checkpoint that passed, of a step before ``before``; returns it (None
        when there is none). Later checkpoints belong to the abandoned steps: removed."""
        loaded = last_good_checkpoint(self.run_dir, warn=self.log, before=before)
        if loaded is None:
            self.log("guard: no checkpoint that passed to roll back to"
                     + ("" if before is None else f" before step {before}"))
            return None
        self.run.restore(loaded)
        self.load_state_dict(loaded.state.get("guard"), keep_counters=True)
        back = loaded.state["step"]
        self.metrics.truncate_after(back)
        if self.run.is_main:
            drop_after(self.run_dir, back)
        if count:
            self.state["rollbacks"] += 1
            self.state["lr_scale"] *= self.cfg.rollback_lr_scale
        self.event("rollback", step=step, to_step=back, checkpoint=str(loaded.path),
                   rollbacks=self.state["rollbacks"], lr_scale=self.state["lr_scale"])
        self.log(f"guard: step {step}: rolled back to {loaded.path} (step {back}); "
                 f"roll-backs {self.state['rollbacks']}/{self.cfg.max_rollbacks}, "
                 f"lr scale {self.state['lr_scale']:.3g}")
        return loaded

    def stop(self, step: int, checkpoint: Path) -> None:
        self.event("pause", step=step, checkpoint=str(checkpoint))
        self.metrics.close()
        events = Path(self.run_dir) / EVENTS_FILE
        raise GuardPause(f"guard paused the run at step {step} (see {events}); "
                         f"checkpoint {checkpoint}; resume with: gspo train --resume "
                         f"{self.run_dir} [key=value ...]", checkpoint, step)

    # ------------------------------------------------------------------ records
    def event(self, event: str, **fields) -> None:
        if not self.run.is_main:  # under torchrun rank 0 writes the events
            return
        record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "event": event, **fields}
        with (Path(self.run_dir) / EVENTS_FILE).open("a") as fh:
            fh.write(json.dumps(record, default=str) + "\n")

    def warn_missing(self, row: dict) -> None:
        """Say once when a rule watches a metric this run does not log (the rule never fires)."""
        if "train/skipped" in row:                    # no update this step: nothing to watch
            return
        for rule in self.rules:
            if rule.kind != "nan" and rule.metric not in row and rule.name not in self.missing_warned:
                self.missing_warned.add(rule.name)
                self.log(f"guard: rule {rule.name} watches {rule.metric!r}, which step "
                         f"{row['step']} did not log")
