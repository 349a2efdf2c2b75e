"""What the file tasks (`gspo.tasks.dataset`: `dataset`, and `custom`, its JSONL form) share: the
user's reward function, and the line-by-line JSONL reader of `custom`.

`load_function` imports a reward `module:function` from the working directory or PYTHONPATH;
given `reward_fn` (e.g. the function in a limited worker process, `gspo.rewards.sandbox`, as
`rewards.sandbox` asks) the function is called through it and never imported here. Timeouts and
error policies are the reward layer's business (`gspo.rewards.isolation`).

`read_jsonl_rows`: each line of a file is a JSON object with a string `prompt` (non-empty) and a
string `answer` (the SFT demonstration); every other column goes to `Example.data`. Bad data
raises `TaskDataError` naming file and line, or with `on_error="skip"` is left out and listed
("file:line: reason"). This module registers no task.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import Callable

from gspo.tasks.base import Example, TaskDataError

RESERVED = ("completion",)  # the first argument of reward functions; cannot be a column


def load_module(module_name: str, spec: str | None = None):
    """Import the dotted module a config names, from cwd or PYTHONPATH (ValueError, one line)."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    except Exception as e:  # an import error or any failure while running the module
        raise ValueError(f"cannot import module {module_name!r} for {spec or module_name!r}: "
                         f"{type(e).__name__}: {e}") from e


def load_function(spec: str) -> Callable:
    """Import `module:function` (dotted module; attribute path after the colon) from cwd or PYTHONPATH."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward function must be given as 'module:function', got {spec!r}")
    obj = load_module(module_name, spec)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r} (from {spec!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{spec!r} is not callable ({type(obj).__name__})")
    return obj


def reward_function(spec: str, reward_fn: Callable | None = None) -> Callable:
    """The task's reward `module:function`: imported here, or ``reward_fn`` that stands for it
    (e.g. gspo.rewards.sandbox.SandboxedFunction: a limited worker process; never imported here)."""
    if reward_fn is not None:
        return reward_fn
    try:
        return load_function(spec)
    except ValueError as err:
        raise ValueError(f"task.reward: {err}") from err


def read_jsonl(path: str | os.PathLike) -> list[Example]:
    """Read one JSONL split; errors carry `file:line: reason`."""
    return read_jsonl_rows(path)[0]


def read_jsonl_rows(path: str | os.PathLike, on_error: str = "fail"
                    ) -> tuple[list[Example], list[int], list[str]]:
    """(examples, their line numbers, skipped "file:line: reason"); on_error: fail | skip."""
    file = str(path)
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise TaskDataError(file, None, "file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TaskDataError(file, None, f"cannot read: {e}") from None
    examples, line_numbers, skipped = [], [], []
    for i, line in enumerate(lines, start=1):
        if line.strip():
            try:
                examples.append(_parse_row(file, i, line))
                line_numbers.append(i)
            except TaskDataError as err:
                if on_error != "skip":
                    raise
                skipped.append(str(err))
    if not examples:
        raise TaskDataError(file, None, f"no usable examples ({len(skipped)} skipped)" if skipped
                            else "no examples")
    return examples, line_numbers, skipped


def _parse_row(file: str, line_no: int, line: str) -> Example:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise TaskDataError(file, line_no, f"bad JSON: {e.msg}") from None
    if not isinstance(row, dict):
        raise TaskDataError(file, line_no, f"expected a JSON object, got {type(row).__name__}")
    for key in ("prompt", "answer"):
        if key not in row:
            raise TaskDataError(file, line_no, f"missing {key!r}")
        if not isinstance(row[key], str):
            raise TaskDataError(file, line_no, f"{key!r} must be a string, got {type(row[key]).__name__}")
    if not row["prompt"]:
        raise TaskDataError(file, line_no, "empty 'prompt'")
    for key in RESERVED:
        if key in row:
            raise TaskDataError(file, line_no, f"column {key!r} is reserved")
    data = {k: v for k, v in row.items() if k not in ("prompt", "answer")}
    return Example(prompt=row["prompt"], answer=row["answer"], data=data)
