"""Stability guard: rules over the per-step metrics, and what happens when one fires.

Two halves, kept apart:

* **Rules** (pure): a registry of rule kinds; ``evaluate(rules, metrics, state, step)`` returns the
  triggers of one step, ``observe(rules, metrics, state)`` advances per-rule state (the reward
  moving average) after a step that was kept. Plain floats and dicts, no torch, no I/O.
* **Plumbing** (``Guard``): a copy of weights / optimizer / scheduler before each step when a
  ``skip`` or ``pause`` rule exists, the decision (the most severe action of the step's triggers),
  ``events.jsonl`` + console, undoing a step, rolling back to the last checkpoint that passed,
  learning-rate scaling, and pausing with ``GuardPause`` (the CLI exits with ``EXIT_PAUSED``).

Actions, by severity: ``warn`` < ``skip`` (discard this step's update) < ``rollback`` (restore the
last checkpoint that passed, scale the learning rate, continue; at most ``max_rollbacks`` times,
then pause) < ``pause`` (discard this step's update, save a checkpoint, stop).

What it is not: a fix. It stops a run from compounding damage and records what it saw; the
thresholds are the user's (docs/trust.md), and only the NaN/Inf rule is on by default.
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

ACTIONS = ("warn", "skip", "rollback", "pause")
"""Actions by increasing severity: a step with several triggers takes the most severe one."""
EXIT_PAUSED = 3
"""Exit status of `gspo train` when the guard pauses the run."""
EVENTS_FILE = "events.jsonl"


class GuardPause(RuntimeError):
    """The guard stopped the run; ``checkpoint`` resumes it (``gspo train --resume RUN``)."""

    exit_code = EXIT_PAUSED

    def __init__(self, message: str, checkpoint: Path | None, step: int):
        super().__init__(message)
        self.checkpoint, self.step = checkpoint, step


# ----------------------------------------------------------------------------- rules (pure)

@dataclass(frozen=True)
class Rule:
    """One resolved rule: a kind from the registry, its metric, limit and action."""
    kind: str
    action: str
    threshold: float | None = None
    metric: str | None = None
    below: bool = False
    ema: float = 0.9
    warmup: int = 0

    @property
    def name(self) -> str:
        return self.kind if self.kind != "metric" else f"metric:{self.metric}"


@dataclass
class Trigger:
    """A rule that fired at one step: what it watched, the value, the limit crossed."""
    step: int
    rule: str
    action: str
    metric: str
    value: float
    limit: float | None
    op: str  # '>' | '<' | 'not finite'

    def describe(self) -> str:
        if self.limit is None:
            return f"{self.rule}: {self.metric} = {self.value} ({self.op}) -> {self.action}"
        return (f"{self.rule}: {self.metric} = {self.value:.4g} {self.op} {self.limit:.4g} "
                f"-> {self.action}")


Check = Callable[[Rule, dict, dict], "tuple[str, float, float | None, str] | None"]
"""(rule, metrics, rule state) -> (metric, value, limit, op) when the rule fires, else None."""


@dataclass(frozen=True)
class RuleKind:
    name: str
    check: Check
    metric: str | None
    """The metric watched by default (None: the rule must name one, or it scans all)."""
    below: bool
    """Fires when the value is below the threshold (else above)."""
    needs_threshold: bool
    options: tuple[str, ...]
    """Optional GuardRule fields this kind reads besides threshold/action/metric/warmup."""
    doc: str
    observe: Callable[[Rule, dict, dict], dict] | None = None


_KINDS: dict[str, RuleKind] = {}


def register(name: str, *, metric: str | None = None, below: bool = False,
             needs_threshold: bool = True, options: tuple[str, ...] = (), doc: str = "",
             observe: Callable | None = None):
    """Decorator: register a rule kind's check function."""
    def deco(fn: Check) -> Check:
        _KINDS[name] = RuleKind(name, fn, metric, below, needs_threshold, options, doc, observe)
        return fn
    return deco


def available() -> list[str]:
    """Sorted names of the rule kinds."""
    return sorted(_KINDS)


def kind(name: str) -> RuleKind:
    if name not in _KINDS:
        raise ValueError(f"unknown guard rule kind {name!r}; valid: {', '.join(available())}")
    return _KINDS[name]


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _threshold(rule: Rule, metrics: dict, state: dict):
    """Fires when metrics[rule.metric] is above (below) rule.threshold; absent/non-finite: no."""
    value = _number(metrics.get(rule.metric))
    if value is None or not math.isfinite(value):
        return None                                   # absent this step, or the nan rule's job
    crossed = value < rule.threshold if rule.below else value > rule.threshold
    return (rule.metric, value, rule.threshold, "<" if rule.below else ">") if crossed else None


for _name, _metric, _below, _doc in [
    ("clip_frac", "policy/clip_frac_tokens", False, "share of clipped response tokens too high"),
    ("approx_kl", "policy/approx_kl", False, "approximate KL old -> new (k1, mean over minibatches)"),
    ("kl_ref", "policy/kl_ref", False, "KL to the reference policy (needs train.beta > 0)"),
    ("grad_norm", "optim/grad_norm", False, "gradient norm before clipping"),
    ("entropy", "policy/entropy", True, "entropy collapse: policy entropy below the threshold"),
    ("moe_imbalance", "moe/expert_load_max_over_mean", False,
     "MoE load imbalance: busiest expert's load over the mean, averaged over layers"),
]:
    register(_name, metric=_metric, below=_below, doc=_doc)(_threshold)
register("metric", options=("below",), doc="any logged metric against a threshold")(_threshold)


@register("nan", needs_threshold=False, doc="NaN or Inf in any step metric (or in rule.metric)")
def _non_finite(rule: Rule, metrics: dict, state: dict):
    keys = [rule.metric] if rule.metric else sorted(metrics)
    bad = [k for k in keys if (v := _number(metrics.get(k))) is not None and not math.isfinite(v)]
    return (", ".join(bad), _number(metrics[bad[0]]), None, "not finite") if bad else None


def _observe_reward(rule: Rule, metrics: dict, state: dict) -> dict:
    """EMA_t = ema · EMA_{t-1} + (1 − ema) · reward_t, over the kept steps."""
    value = _number(metrics.get(rule.metric))
    if value is None or not math.isfinite(value):
        return state
    prev = state.get("average")
    average = value if prev is None else rule.ema * prev + (1 - rule.ema) * value
    return {"average": average, "seen": state.get("seen", 0) + 1}


@register("reward_drop", metric="reward/mean", options=("ema",), observe=_observe_reward,
          doc="reward fell more than `threshold` below its moving average")
def _reward_drop(rule: Rule, metrics: dict, state: dict):
    value, average = _number(metrics.get(rule.metric)), state.get("average")
    if value is None or average is None or not math.isfinite(value):
        return None
    limit = average - rule.threshold
    return (rule.metric, value, limit, "<") if value < limit else None


def check_rule(spec) -> None:
    """Config-time validation of a GuardRule: known kind, a threshold when needed, no stray field."""
    k = kind(spec.kind)
    if k.needs_threshold and spec.threshold is None:
        raise ValueError(f"guard rule {spec.kind!r} needs a threshold")
    if not k.needs_threshold and spec.threshold is not None:
        raise ValueError(f"guard rule {spec.kind!r} takes no threshold")
    if spec.kind == "metric" and not spec.metric:
        raise ValueError("guard rule 'metric' needs metric: <name>, e.g. optim/grad_norm")
    for option in ("below", "ema"):
        if getattr(spec, option) is not None and option not in k.options:
            raise ValueError(f"guard rule {spec.kind!r} takes no {option!r}")


def resolve_rules(guard_cfg) -> list[Rule]:
    """The GuardConfig's rules with the kinds' defaults filled in; the nan rule first."""
    rules = [] if guard_cfg.nan == "off" else [Rule("nan", guard_cfg.nan)]
    for r in guard_cfg.rules:
        k = kind(r.kind)
        rules.append(Rule(kind=r.kind, action=r.action, threshold=r.threshold,
                          metric=r.metric or k.metric, below=bool(r.below) or k.below,
                          ema=0.9 if r.ema is None else r.ema, warmup=r.warmup))
    return rules


def initial_state(rules: list[Rule]) -> dict:
    return {"rules": [{} for _ in rules], "rollbacks": 0, "lr_scale": 1.0, "triggers": 0}


def evaluate(rules: list[Rule], metrics: dict, state: dict, step: int) -> list[Trigger]:
    """The triggers of one step (``step`` 1-based, as logged). Pure."""
    out = []
    for rule, rule_state in zip(rules, state["rules"]):
        if step <= rule.warmup:
            continue
        hit = kind(rule.kind).check(rule, metrics, rule_state)
        if hit is not None:
            out.append(Trigger(step, rule.name, rule.action, *hit))
    return out


def observe(rules: list[Rule], metrics: dict, state: dict) -> dict:
    """State after a kept step (moving averages advance). Pure: returns a new state."""
    new = {**state, "rules": []}
    for rule, rule_state in zip(rules, state["rules"]):
        fn = kind(rule.kind).observe
        new["rules"].append(fn(rule, metrics, rule_state) if fn else rule_state)
    return new


def decide(triggers: list[Trigger]) -> str | None:
    """The most severe action among the triggers (None: nothing fired)."""
    return max((t.action for t in triggers), key=ACTIONS.index, default=None)


# ----------------------------------------------------------------------------- plumbing

def _clone(obj, device):
    """Deep copy of a (nested) state dict, tensors copied to ``device`` (None: where they are)."""
    import torch
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(device or obj.device, copy=True)
    if isinstance(obj, dict):
        return {k: _clone(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v, device) for v in obj)
    return copy.deepcopy(obj)


def _clone_into(old, obj, device):
    """``_clone(obj, device)``, written into the tensors of ``old`` (an earlier clone) wherever
    they match in place, shape and dtype: no new allocation from one step to the next."""
    import torch
    if isinstance(obj, torch.Tensor):
        target = torch.device(device) if device else obj.device
        if (isinstance(old, torch.Tensor) and old.shape == obj.shape and old.dtype == obj.dtype
                and old.device == target):
            return old.copy_(obj.detach())
        return _clone(obj, device)
    if isinstance(obj, dict):
        old = old if isinstance(old, dict) else {}
        return {k: _clone_into(old.get(k), v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        old = old if isinstance(old, (list, tuple)) and len(old) == len(obj) else [None] * len(obj)
        return type(obj)(_clone_into(o, v, device) for o, v in zip(old, obj))
    return copy.deepcopy(obj)


def snapshot(model, optimizer, scheduler, device: str | None = "cpu", into: dict | None = None) -> dict:
    """Copies of the weights, optimizer and scheduler state (restored by ``restore``); ``into``:
    an earlier snapshot whose tensors are overwritten and reused (it is no longer a snapshot)."""
    into = into or {}
    return {"model": _clone_into(into.get("model"), model.state_dict(), device),
            "optimizer": _clone_into(into.get("optimizer"), optimizer.state_dict(), device),
            "scheduler": copy.deepcopy(scheduler.state_dict())}


def restore(snap: dict, model, optimizer, scheduler) -> None:
    model.load_state_dict(snap["model"])
    optimizer.load_state_dict(_clone(snap["optimizer"], None))
    scheduler.load_state_dict(copy.deepcopy(snap["scheduler"]))


def set_lr_multiplier(optimizer, scheduler, base_lrs: list[float], multiplier: float) -> None:
    """Make the peak learning rates ``base_lrs × multiplier`` (the schedule's shape is kept)."""
    for i, group in enumerate(optimizer.param_groups):
        target = base_lrs[i] * multiplier
        if scheduler.base_lrs[i] != target:
            group["lr"] *= target / scheduler.base_lrs[i]
            group["initial_lr"] = scheduler.base_lrs[i] = target


def last_good_checkpoint(run_dir: Path, warn=print):
    """The newest checkpoint that verifies and was saved by a step that passed the guard."""
    from gspo.training.checkpoint import load_latest
    return load_latest(run_dir, warn, accept=lambda state: state.get("guard", {}).get("passed", True),
                       who="guard")


def read_events(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / EVENTS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class Guard:
    """Runs the rules after every step and carries out their actions on a trainer.

    The trainer calls ``before_step(trainer, step)`` and ``after_step(trainer, row)``; the latter
    returns the step to continue from after a roll-back (else None) and raises ``GuardPause``.
    Of the trainer it uses: model, optimizer, scheduler, run_dir, log, metrics, start_step,
    save(step, wall), wall(), load_checkpoint(loaded), dist (ranks decide together).
    """
    cfg: object                                   # GuardConfig
    faults: object                                # FaultsConfig
    base_lrs: list[float]
    rules: list[Rule] = field(init=False)
    state: dict = field(init=False)
    passed: bool = field(default=True, init=False)
    """False once an update that fired a rule could not be undone (checkpoints say so)."""
    _snap: dict | None = field(default=None, init=False, repr=False)
    _missing_warned: set = field(default_factory=set, init=False, repr=False)

    def __post_init__(self):
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
    def before_step(self, trainer, step: int) -> None:
        set_lr_multiplier(trainer.optimizer, trainer.scheduler, self.base_lrs,
                          self.lr_multiplier(step))
        last, self._snap = self._snap, None
        if self.needs_snapshot:   # into the last step's buffers (restore copies out of them)
            device = "cpu" if self.cfg.snapshot_device == "cpu" else None
            self._snap = snapshot(trainer.model, trainer.optimizer, trainer.scheduler, device, into=last)

    def on_start(self, trainer) -> None:
        """With a rollback rule, make sure a checkpoint exists to roll back to (the start)."""
        if any(r.action == "rollback" for r in self.rules) and trainer.dist.on_main(  # ranks agree
                lambda: last_good_checkpoint(trainer.run_dir, warn=trainer.log) is None):
            trainer.save(trainer.start_step, trainer.wall())

    def after_step(self, trainer, row: dict) -> int | None:
        step = row["step"]
        self._warn_missing(trainer, row)
        triggers = evaluate(self.rules, row, self.state, step)
        action = decide(triggers)
        self.state["triggers"] += len(triggers)
        for t in triggers:
            trainer.log(f"guard: step {step}: {t.describe()}")
            self.event(trainer.run_dir, "trigger", **asdict(t), metrics=_finite_row(row))
        row.update({"guard/triggers": len(triggers), "guard/skipped": 0.0})
        if action == "rollback":
            if self.state["rollbacks"] < self.cfg.max_rollbacks:
                loaded = self._rollback(trainer, step)
                if loaded is not None:
                    return loaded.state["step"]
            else:
                trainer.log(f"guard: step {step}: all {self.cfg.max_rollbacks} roll-backs used; "
                            f"pausing at the last checkpoint that passed")
                loaded = self._rollback(trainer, step, count=False)
                if loaded is not None:
                    self._stop(trainer, step, loaded.path)
            action = "pause"                         # nothing to roll back to
        if action in ("skip", "pause"):
            self._discard(trainer, row)
        if action == "pause":
            trainer.metrics.write(row)
            self._stop(trainer, step, trainer.save(step, trainer.wall()))
        if action != "skip":
            self.state = observe(self.rules, row, self.state)
        row.update({"guard/rollbacks": self.state["rollbacks"],
                    "guard/lr_scale": self.state["lr_scale"]})
        return None

    # ------------------------------------------------------------------ actions
    def _discard(self, trainer, row: dict) -> None:
        """Undo this step's update from the pre-step snapshot."""
        if self._snap is None:                       # only a rollback rule escalated to pause
            self.passed = False
            trainer.log(f"guard: step {row['step']}: no snapshot, the update stays (checkpoint "
                        f"marked as not passed)")
            return
        restore(self._snap, trainer.model, trainer.optimizer, trainer.scheduler)
        row["guard/skipped"] = 1.0
        self.event(trainer.run_dir, "skip", step=row["step"])
        trainer.log(f"guard: step {row['step']}: update discarded (weights, optimizer restored)")

    def _rollback(self, trainer, step: int, count: bool = True):
        """Restore the last checkpoint that passed; returns it (None when there is none)."""
        loaded = last_good_checkpoint(trainer.run_dir, warn=trainer.log)
        if loaded is None:
            trainer.log("guard: no checkpoint that passed to roll back to")
            return None
        trainer.load_checkpoint(loaded)
        self.load_state_dict(loaded.state.get("guard"), keep_counters=True)
        back = loaded.state["step"]
        trainer.metrics.truncate_after(back)
        if count:
            self.state["rollbacks"] += 1
            self.state["lr_scale"] *= self.cfg.rollback_lr_scale
        self.event(trainer.run_dir, "rollback", step=step, to_step=back, checkpoint=str(loaded.path),
                   rollbacks=self.state["rollbacks"], lr_scale=self.state["lr_scale"])
        trainer.log(f"guard: step {step}: rolled back to {loaded.path} (step {back}); "
                    f"roll-backs {self.state['rollbacks']}/{self.cfg.max_rollbacks}, "
                    f"lr scale {self.state['lr_scale']:.3g}")
        return loaded

    def _stop(self, trainer, step: int, checkpoint: Path) -> None:
        self.event(trainer.run_dir, "pause", step=step, checkpoint=str(checkpoint))
        trainer.metrics.close()
        events = Path(trainer.run_dir) / EVENTS_FILE
        raise GuardPause(f"guard paused the run at step {step} (see {events}); "
                         f"checkpoint {checkpoint}; resume with: gspo train --resume "
                         f"{trainer.run_dir} [key=value ...]", checkpoint, step)

    # ------------------------------------------------------------------ records
    @staticmethod
    def event(run_dir, event: str, **fields) -> None:
        from gspo.training.distributed import is_main
        if not is_main():  # under torchrun rank 0 writes the events
            return
        record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "event": event, **fields}
        with (Path(run_dir) / EVENTS_FILE).open("a") as fh:
            fh.write(json.dumps(record, default=str) + "\n")

    def _warn_missing(self, trainer, row: dict) -> None:
        """Say once when a rule watches a metric this run does not log (the rule never fires)."""
        if "train/skipped" in row:                    # no update this step: nothing to watch
            return
        for rule in self.rules:
            if rule.kind != "nan" and rule.metric not in row and rule.name not in self._missing_warned:
                self._missing_warned.add(rule.name)
                trainer.log(f"guard: rule {rule.name} watches {rule.metric!r}, which step "
                            f"{row['step']} did not log")


def _finite_row(row: dict) -> dict:
    """The step's numeric metrics for the event record (NaN/Inf as strings, JSON has neither)."""
    out = {}
    for k, v in row.items():
        if (x := _number(v)) is not None:
            out[k] = x if math.isfinite(x) else str(x)
    return out


def event_table(events: list[dict]) -> list[str]:
    """Markdown lines listing guard events (for report.md)."""
    if not events:
        return ["No guard triggers."]
    lines = ["| step | event | rule | metric | value | limit | action / detail |",
             "|---|---|---|---|---|---|---|"]
    for e in events:
        if e["event"] == "trigger":
            value = e["value"] if isinstance(e["value"], str) else f"{e['value']:.4g}"
            limit = "" if e.get("limit") is None else f"{e['op']} {e['limit']:.4g}"
            lines.append(f"| {e['step']} | trigger | {e['rule']} | {e['metric']} | {value} | "
                         f"{limit} | {e['action']} |")
        else:
            detail = ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("time", "event", "step"))
            lines.append(f"| {e['step']} | {e['event']} | | | | | {detail} |")
    return lines
