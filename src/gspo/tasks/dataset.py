"""`dataset`: a task from local data files read with Hugging Face `datasets`; `custom`, its JSONL
form with a required reward function (the same task, its keys and behaviour kept).

`train_file` / `test_file` / `validation_file` are .jsonl, .json, .parquet, .csv or .arrow files
(read with `datasets.Dataset.from_json` / `from_parquet` / `from_csv` / `from_file`; local files
only, nothing is downloaded). Instead of files, `dataset` names a Hugging Face dataset as
`datasets.load_dataset` takes it — a hub id (from the Hugging Face cache first, `gspo.hub`) or a
local dataset folder, with `dataset_config` its configuration and `splits` the dataset's split for
each of train / test / validation. `columns` names the file's column for each field:

* `prompt`: the question as a string, or
* `messages`: a conversation, a list of `{role, content}` (roles system / user / assistant / tool)
  with at least one user turn; rendered with the chat template (needs `task.chat: true`). A final
  assistant turn is the demonstration answer when the row has no answer column;
* `answer`: the reference answer, a string (numbers, as CSV and parquet may store them, are
  written out as text, a whole float as an integer). It is the SFT demonstration and what the `math` verifier compares with.

A field not in `columns` uses its own name. Every other column goes to `Example.data` (reward
functions get them as keywords). A missing column is an error of the whole file; a bad row
(null or empty prompt, wrong type, a conversation without a user turn) raises `TaskDataError`
naming `file:row` (the 1-based row; a JSONL file's line when it has no blank lines), or with
`on_error="skip"` is left out and listed in `skipped`, the same policy as `custom`.

The verifier is `reward` (`module:function`) when given, else math: 1.0 when the completion's
final answer equals the answer by value (`gspo.tasks.verifiers.math_equal`).

`custom` (``Custom``) is this task over JSONL files read line by line (`gspo.tasks.custom`:
errors name `file:line`, a bad line can be skipped, `prompt` and `answer` must be strings, no
`datasets` needed) and scored by a reward `module:function` it requires; `is_correct` is
`reward >= correct_threshold` for both.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable

from gspo import hub
from gspo.optional import require
from gspo.tasks.base import Example, TaskDataError, message_problem, pick_split, register, to_reward
from gspo.tasks.custom import RESERVED, read_jsonl_rows, reward_function
from gspo.tasks.verifiers import math_equal, math_verify

FIELDS = ("prompt", "messages", "answer")
SPLIT_KEYS = ("train", "test", "validation")
DEFAULT_SPLITS = {"train": "train", "test": "test"}
"""A hub dataset's split for each of ours (validation: none unless named in task.splits)."""


def _reader(kind: str):
    datasets = require("datasets", "task.name=dataset")
    return {"json": lambda p: datasets.Dataset.from_json(p, keep_in_memory=True),
            "parquet": lambda p: datasets.Dataset.from_parquet(p, keep_in_memory=True),
            "csv": lambda p: datasets.Dataset.from_csv(p, keep_in_memory=True),
            "arrow": lambda p: datasets.Dataset.from_file(p, in_memory=True)}[kind]


FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


def read_table(path: str):
    """The file as a `datasets.Dataset`; a missing, unknown or unreadable file is a TaskDataError."""
    kind = FORMATS.get(Path(path).suffix.lower())
    if kind is None:
        raise TaskDataError(path, None, f"unknown file type {Path(path).suffix!r}; "
                                        f"valid: {', '.join(FORMATS)}")
    if not Path(path).is_file():
        raise TaskDataError(path, None, "file not found")
    try:
        return _reader(kind)(path)
    except Exception as err:  # pyarrow / datasets parse errors of every kind
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise TaskDataError(path, None, f"cannot read as {kind}: {first[:200]}") from None


def column_names(file: str, names: list[str], columns: dict[str, str], chat: bool) -> dict[str, str]:
    """field -> the file's column for it (only fields the file has); errors name the missing one."""
    mapping = {f: columns.get(f, f) for f in FIELDS}
    for field in columns:
        if columns[field] not in names:
            raise TaskDataError(file, None, f"no column {columns[field]!r} (task.columns.{field}); "
                                            f"columns: {', '.join(names)}")
    present = {f: c for f, c in mapping.items() if c in names}
    if "prompt" not in present and "messages" not in present:
        raise TaskDataError(file, None, f"no prompt column {mapping['prompt']!r} and no messages "
                                        f"column {mapping['messages']!r} (set task.columns); "
                                        f"columns: {', '.join(names)}")
    if "answer" not in present and "messages" not in present:
        raise TaskDataError(file, None, f"no answer column {mapping['answer']!r} (set "
                                        f"task.columns.answer); columns: {', '.join(names)}")
    if "messages" in present and not chat:
        raise TaskDataError(file, None, f"column {present['messages']!r} holds conversations: set "
                                        f"task.chat=true to render them with the chat template")
    if reserved := [c for c in RESERVED if c in names]:
        raise TaskDataError(file, None, f"column {reserved[0]!r} is reserved")
    return present


def _text(value: Any, field: str) -> str:
    """A string field; a number (CSV and parquet columns are typed) written out, a whole float
    as an integer (a column of 4 and 0.5 is read as 4.0 and 0.5)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise ValueError(f"{field!r} must be a string, got {type(value).__name__}")
    return value


def parse_row(row: dict, present: dict[str, str]) -> Example:
    """One row -> Example; ValueError says what is wrong with it."""
    messages = row.get(present["messages"]) if "messages" in present else None
    answer = row.get(present["answer"]) if "answer" in present else None
    if messages is not None:
        if (problem := message_problem(messages)) is not None:
            raise ValueError(problem)
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        if messages[-1]["role"] == "assistant" and answer is None:
            answer, messages = messages[-1]["content"], messages[:-1]
        prompt = [m["content"] for m in messages if m["role"] == "user"][-1]
    else:
        prompt = row.get(present["prompt"]) if "prompt" in present else None
        if prompt is None:
            raise ValueError(f"missing {present.get('prompt', 'prompt')!r} (null)")
        prompt = _text(prompt, present["prompt"])
        if not prompt:
            raise ValueError(f"empty {present['prompt']!r}")
    if answer is None:
        raise ValueError(f"missing {present.get('answer', 'answer')!r} (null)")
    answer = _text(answer, present.get("answer", "answer"))
    used = set(present.values())
    data = {k: v for k, v in row.items() if k not in used}
    if messages is not None:
        data["messages"] = messages
    return Example(prompt=prompt, answer=answer, data=data)


def hub_table(name: str, config: str | None, split: str, label: str):
    """One split of a Hugging Face dataset (hub id or local folder) as a `datasets.Dataset`."""
    datasets = require("datasets", "task.dataset")
    folder = hub.local_path(name, "task.dataset", repo_type="dataset")
    try:
        return datasets.load_dataset(folder, config, split=split, keep_in_memory=True)
    except Exception as err:  # datasets' errors of every kind: unknown split, config, format
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise TaskDataError(label, None, f"cannot load split {split!r}: {first[:200]}") from None


def read_rows(path: str, columns: dict[str, str], chat: bool, on_error: str = "fail",
              table=None) -> tuple[list[Example], list[int], list[str]]:
    """(examples, their 1-based row numbers, skipped "file:row: reason"); on_error: fail | skip.
    ``table``: the rows already read (a hub split), ``path`` then only names them."""
    table = read_table(path) if table is None else table
    present = column_names(path, table.column_names, columns, chat)
    examples, rows, skipped = [], [], []
    for i, row in enumerate(table, start=1):
        try:
            examples.append(parse_row(row, present))
            rows.append(i)
        except ValueError as err:
            bad = TaskDataError(path, i, str(err))
            if on_error != "skip":
                raise bad from None
            skipped.append(str(bad))
    if not examples:
        raise TaskDataError(path, None, f"no usable examples ({len(skipped)} skipped)" if skipped
                            else "no examples")
    return examples, rows, skipped


@register("dataset")
class FileDataset:
    """Examples from local data files (Hugging Face datasets), scored by math or a user function."""

    name = "dataset"

    def __init__(self, train_file: str | None = None, test_file: str | None = None,
                 validation_file: str | None = None, columns: dict[str, str] | None = None,
                 chat: bool = False, reward: str | None = None, correct_threshold: float = 1.0,
                 on_error: str = "fail", reward_fn=None, dataset: str | None = None,
                 dataset_config: str | None = None, splits: dict[str, str] | None = None):
        """
        train_file, test_file, validation_file: .jsonl / .json / .parquet / .csv / .arrow paths.
        columns: field (prompt | messages | answer) -> the files' column holding it.
        chat: prompts will be rendered with a chat template (rows may then hold messages).
        reward: "module:function", fn(completion, **row) -> float; None: math (1 if equal by value).
        correct_threshold: a completion counts as correct when its reward is >= this.
        on_error: a bad row fails (TaskDataError) or is skipped (listed in `skipped`).
        reward_fn: None (import `reward` in-process) or a callable standing for it (the sandbox).
        dataset, dataset_config: a Hugging Face dataset (hub id or folder) and its configuration,
            read instead of the files; splits: split (train | test | validation) -> its split name.
        """
        columns = dict(columns or {})
        if dataset is not None:
            names = {**DEFAULT_SPLITS, **(splits or {})}
            labels = {f"{dataset}[{names[k]}]": names[k] for k in names}
            self.read(lambda label: read_rows(label, columns, chat, on_error, table=hub_table(
                dataset, dataset_config, labels[label], label)),
                *[f"{dataset}[{names[k]}]" if k in names else None for k in SPLIT_KEYS])
        elif train_file is None or test_file is None:
            raise ValueError("task.name=dataset needs task.train_file and task.test_file, or task.dataset")
        else:
            self.read(lambda file: read_rows(file, columns, chat, on_error),
                      train_file, test_file, validation_file)
        if reward is None:
            math_verify()  # installed, or a one-line error now
        self.reward_spec = reward or "math (final answer equal by value)"
        self._fn = reward_function(reward, reward_fn) if reward else None
        self.correct_threshold = correct_threshold

    def read(self, rows: Callable, train_file: str, test_file: str,
             validation_file: str | None) -> None:
        """Each split's examples, where they came from, and what was skipped; ``rows(file)``
        -> (examples, row or line numbers, skipped)."""
        self._splits, self.locations, self.skipped = {"validation": []}, {"validation": []}, []
        files = {"train": train_file, "test": test_file, "validation": validation_file}
        for split, file in ((k, v) for k, v in files.items() if v is not None):
            examples, rows_read, skipped = rows(str(file))
            self._splits[split] = examples
            self.locations[split] = [(str(file), n) for n in rows_read]
            self.skipped += skipped
        overlap = {e.prompt for e in self._splits["train"]} & {e.prompt for e in self._splits["test"]}
        if overlap:
            warnings.warn(f"{self.name} task: {len(overlap)} prompt(s) appear in both {train_file} "
                          f"and {test_file}")

    def split(self, name: str) -> list[Example]:
        return pick_split(self.name, self._splits, name)

    def reward(self, completion: str, example: Example) -> float:
        if self._fn is None:
            return float(math_equal(completion, example.answer))
        value = self._fn(completion, prompt=example.prompt, answer=example.answer, **example.data)
        return to_reward(value, self.reward_spec)

    def is_correct(self, completion: str, example: Example) -> bool:
        return self.reward(completion, example) >= self.correct_threshold


@register("custom")
class Custom(FileDataset):
    """The dataset task over JSONL files read line by line, scored by a user `module:function`."""

    name = "custom"

    def __init__(self, train_file: str, test_file: str, reward: str, correct_threshold: float = 1.0,
                 on_error: str = "fail", reward_fn=None, validation_file: str | None = None):
        """
        train_file, test_file: JSONL paths, one {"prompt": ..., "answer": ..., ...} object a line.
        validation_file: optional JSONL path of the same format, for choosing hyper-parameters
            (eval.split=validation); without it the validation split is empty.
        reward: "module:function", called as fn(completion, **row) -> float.
        correct_threshold: a completion counts as correct when its reward is >= this.
        on_error: a bad row fails (TaskDataError) or is skipped (listed in `skipped`).
        reward_fn: None (import `reward` and call it in-process) or a callable that stands for it
            (e.g. gspo.rewards.sandbox.SandboxedFunction(reward, limits): a worker process).
        """
        self.read(lambda file: read_jsonl_rows(file, on_error), train_file, test_file,
                  validation_file)
        self.reward_spec = reward
        self._fn = reward_function(reward, reward_fn)
        self.correct_threshold = correct_threshold
