"""Stability rules (pure): which per-step metrics are out of bounds, and the run's event log.

A registry of rule kinds (``nan``, ``clip_frac``, ``approx_kl``, ``kl_ref``, ``grad_norm``,
``entropy``, ``reward_drop``, ``moe_imbalance``, ``metric``); ``evaluate(rules, metrics, state,
step)`` returns the triggers of one step, ``observe(rules, metrics, state)`` advances per-rule state
(the reward moving average) after a step that was kept, ``decide`` picks the most severe action.
Plain floats and dicts, no torch. ``events.jsonl`` (what fired, skips, roll-backs, pauses) is read
and tabulated here for the report.

What it is not: the actions. Undoing a step, rolling back and pausing are
``gspo.training.stability.StabilityGuard``'s; config validation calls ``check_rule``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gspo.registry import Registry

ACTIONS = ("warn", "skip", "rollback", "pause")
"""Actions by increasing severity: a step with several triggers takes the most severe one."""
EVENTS_FILE = "events.jsonl"


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
    judges: str = "update"
    """What a firing rule blames: ``update`` (this step's update) or ``batch`` (this step's
    samples, drawn by the weights of the update before it): where a roll-back goes."""

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
    judges: str = "update"

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
    judges: str = "update"
    """The default of Rule.judges: ``batch`` for a metric of the sampled batch (its reward), which
    re-running the step from the checkpoint before it would draw again."""


_KINDS: Registry[RuleKind] = Registry("guard rule kind")


def register(name: str, *, metric: str | None = None, below: bool = False,
             needs_threshold: bool = True, options: tuple[str, ...] = (), doc: str = "",
             observe: Callable | None = None, judges: str = "update"):
    """Decorator: register a rule kind's check function."""
    def deco(fn: Check) -> Check:
        _KINDS.add(name, RuleKind(name, fn, metric, below, needs_threshold, options, doc, observe,
                                  judges))
        return fn
    return deco


available = _KINDS.names
"""Sorted names of the rule kinds."""
kind = _KINDS.get
"""The `RuleKind` of `name`; ValueError listing the valid names if unknown."""


def number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _threshold(rule: Rule, metrics: dict, state: dict):
    """Fires when metrics[rule.metric] is above (below) rule.threshold; absent/non-finite: no."""
    value = number(metrics.get(rule.metric))
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
    bad = [k for k in keys if (v := number(metrics.get(k))) is not None and not math.isfinite(v)]
    return (", ".join(bad), number(metrics[bad[0]]), None, "not finite") if bad else None


def _observe_reward(rule: Rule, metrics: dict, state: dict) -> dict:
    """EMA_t = ema · EMA_{t-1} + (1 − ema) · reward_t, over the kept steps."""
    value = number(metrics.get(rule.metric))
    if value is None or not math.isfinite(value):
        return state
    prev = state.get("average")
    average = value if prev is None else rule.ema * prev + (1 - rule.ema) * value
    return {"average": average, "seen": state.get("seen", 0) + 1}


@register("reward_drop", metric="reward/mean", options=("ema",), observe=_observe_reward,
          judges="batch",
          doc="reward fell more than `threshold` below its moving average")
def _reward_drop(rule: Rule, metrics: dict, state: dict):
    value, average = number(metrics.get(rule.metric)), state.get("average")
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
                          ema=0.9 if r.ema is None else r.ema, warmup=r.warmup,
                          judges=r.judges or k.judges))
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
            out.append(Trigger(step, rule.name, rule.action, *hit, judges=rule.judges))
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


def read_events(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / EVENTS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def finite_row(row: dict) -> dict:
    """The step's numeric metrics for the event record (NaN/Inf as strings, JSON has neither)."""
    out = {}
    for k, v in row.items():
        if (x := number(v)) is not None:
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
