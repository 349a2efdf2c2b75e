"""The task interface and the helpers every built-in task shares.

A task is a seeded data generator with a verifier: `split("train" | "test" | "validation")` gives `Example`s,
`reward(completion, example)` scores one completion, `is_correct` decides accuracy. This module
holds the types, the name registry and the split builder; it holds no task of its own.
"""

from __future__ import annotations

import inspect
import math
import numbers
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

from gspo.errors import UserError
from gspo.registry import Registry

SPLITS = ("train", "test", "validation")


@dataclass(frozen=True)
class Example:
    """One prompt with its demonstration answer and extra columns for reward functions."""

    prompt: str  # what the model is conditioned on, e.g. "37+45="
    answer: str  # the SFT demonstration completion (what a perfect model writes, no EOS)
    data: dict = field(default_factory=dict)  # extra columns, passed to reward fns as **row


@runtime_checkable
class Task(Protocol):
    """A verifiable task: data splits plus a verifier."""

    name: str

    def split(self, name: str) -> list[Example]: ...

    def reward(self, completion: str, example: Example) -> float: ...

    def is_correct(self, completion: str, example: Example) -> bool: ...

    # Optional: ``take_counts() -> dict[str, float]``, what the task counted while scoring since the
    # last call (``{"reward/scorer_errors": 2}``), logged with the step and summed over its
    # generation rounds and ranks (``task_counts``).


def task_counts(task) -> dict[str, float]:
    """The task's counts since the last call (``Task.take_counts``; {} for a task without any)."""
    take = getattr(task, "take_counts", None)
    return take() if take is not None else {}


class TaskDataError(UserError, ValueError):
    """Bad task data, located by file and line: `a.jsonl:3: missing 'prompt'`."""

    def __init__(self, file: str, line: int | None, reason: str):
        self.file, self.line, self.reason = file, line, reason
        where = f"{file}:{line}" if line is not None else file
        super().__init__(f"{where}: {reason}")


# ---------------------------------------------------------------------------------------------
# registry

_REGISTRY: Registry[Callable[..., Task]] = Registry("task", valid="valid tasks")


def register(name: str):
    """Class decorator: `@register("arithmetic")` makes the task buildable by name."""
    return _REGISTRY.register(name)


def available() -> list[str]:
    """Names of the registered tasks, sorted."""
    return _REGISTRY.names()


def get(name: str) -> Callable[..., Task]:
    """The task class (factory) registered under `name`."""
    return _REGISTRY.get(name)


def build(name: str, **kwargs: Any) -> Task:
    """Build task `name`; an unknown keyword fails listing the task's valid ones."""
    factory = get(name)
    call_kwargs(factory, kwargs, what=f"task {name!r}")
    return factory(**kwargs)


def call_kwargs(fn: Callable, kwargs: dict, *, what: str, args: tuple = ()) -> None:
    """Raise ValueError (not TypeError) when `fn(*args, **kwargs)` would not bind."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())[len(args) :]
    valid = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    open_kwargs = any(p.kind == p.VAR_KEYWORD for p in params)
    if unknown := [k for k in kwargs if k not in valid and not open_kwargs]:
        reason = f"unexpected argument(s) {', '.join(map(repr, unknown))}"
    else:
        try:
            sig.bind(*args, **kwargs)
            return
        except TypeError as e:
            reason = str(e)
    raise ValueError(f"{what}: {reason}; valid arguments: {', '.join(valid)}")


# ---------------------------------------------------------------------------------------------
# shared helpers


def make_splits(
    task: str, rng: random.Random, sample: Callable[[random.Random], Example], n_train: int, n_test: int,
    n_val: int = 0,
) -> dict[str, list[Example]]:
    """Draw distinct prompts with `sample`: test first, then train, then validation.

    The three splits are disjoint by prompt. Test does not move with n_train, and neither test nor
    train moves with n_val (validation is drawn last), so adding a validation split changes no
    earlier run's data. Fails if the task's prompt space is too small.
    """
    if min(n_train, n_test, n_val) < 0:
        raise ValueError(f"{task}: n_train, n_test and n_val must be >= 0, got {n_train}, {n_test}, {n_val}")
    seen: set[str] = set()
    out: dict[str, list[Example]] = {"train": [], "test": [], "validation": []}
    total = n_train + n_test + n_val
    budget = 50 * total + 1000  # rejection sampling: give up on a tiny prompt space
    for split, n in (("test", n_test), ("train", n_train), ("validation", n_val)):
        while len(out[split]) < n:
            if budget == 0:
                raise ValueError(
                    f"{task}: found only {len(seen)} distinct prompts, {total} requested;"
                    " lower n_train/n_test/n_val or raise the difficulty"
                )
            budget -= 1
            ex = sample(rng)
            if ex.prompt not in seen:
                seen.add(ex.prompt)
                out[split].append(ex)
    return out


def pick_split(task: str, splits: dict[str, list[Example]], name: str) -> list[Example]:
    """`splits[name]` as a fresh list; an unknown split fails listing the valid ones."""
    if name not in splits:
        raise ValueError(f"{task}: unknown split {name!r}; valid splits: {', '.join(splits)}")
    return list(splits[name])


CHAT_ROLES = ("system", "user", "assistant", "tool")


def message_problem(messages) -> str | None:
    """Why ``messages`` is not a usable conversation (None when it is): a list of
    ``{"role": str, "content": str}`` with a known role and at least one user turn."""
    if not isinstance(messages, list) or not messages:
        return f"'messages' must be a non-empty list of {{role, content}} objects, got {messages!r:.60}"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            return f"messages[{i}] must be an object with string 'role' and 'content', got {m!r:.60}"
        if m["role"] not in CHAT_ROLES:
            return f"messages[{i}]: unknown role {m['role']!r}; valid roles: {', '.join(CHAT_ROLES)}"
    if not any(m["role"] == "user" for m in messages):
        return "the conversation has no user message"
    return None


def reward_value(value: Any) -> float:
    """A reward as float if it is a finite real number; else TypeError / ValueError saying what
    came back ("returned str '1.0', expected a number"). The one check every reward path uses."""
    if not isinstance(value, numbers.Real):
        raise TypeError(f"returned {type(value).__name__} {repr(value)[:60]}, expected a number")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"returned a non-finite value {value}")
    return value


def to_reward(value: Any, source: str) -> float:
    """``reward_value``, its errors naming the `source` that produced the value."""
    try:
        return reward_value(value)
    except (TypeError, ValueError) as err:
        raise type(err)(f"reward {source} {err}") from None
