"""Sections for the data (``gspo.tasks``, ``gspo.rewards``): the task, what a bad example does,
and the reward sources."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from gspo import tasks
from gspo.config.base import Section, one_of
from gspo.rewards.sources import source_types
from gspo.tasks.dataset import FIELDS, SPLIT_KEYS


class TaskConfig(Section):
    name: str = "arithmetic"
    """Task from the registry (gspo.tasks.available()), custom (JSONL + reward function) or dataset (files); docs/real-models.md."""
    n_train: int | None = Field(None, ge=1)
    """Training prompts to generate (built-in tasks; None: the task's default)."""
    n_test: int | None = Field(None, ge=1)
    """Held-out prompts to generate (built-in tasks; None: the task's default)."""
    n_val: int | None = Field(None, ge=1)
    """Validation prompts to generate, disjoint from train and test (built-in tasks; None: 200 under eval.split=validation, else none)."""
    params: dict[str, Any] = {}
    """Task-specific generator options (e.g. {max_digits: 2} for arithmetic)."""
    train_file: str | None = None
    """custom / dataset task: the training file (custom: JSONL with prompt and answer; dataset: see task.columns); docs/real-models.md."""
    test_file: str | None = None
    """custom / dataset task: held-out file, same format."""
    validation_file: str | None = None
    """custom / dataset task: optional validation file, same format (needed for eval.split=validation)."""
    dataset: str | None = None
    """dataset task: a Hugging Face dataset read with datasets.load_dataset instead of files: a hub id (cache first, HF_HUB_OFFLINE honoured) or a local folder."""
    dataset_config: str | None = None
    """dataset task with task.dataset: its configuration (load_dataset's name argument)."""
    splits: dict[str, str] = {}
    """dataset task with task.dataset: the dataset's split for train / test / validation (default {train: train, test: test})."""
    reward: str | None = None
    """custom / dataset task: reward function 'module:function', called fn(completion, **row) -> float (docs/real-models.md)."""
    correct_threshold: float = 1.0
    """custom task: a completion counts as correct when its reward is at least this."""
    columns: dict[str, str] = {}
    """dataset task: the file column of each field, e.g. {prompt: question, answer: solution} (unset fields: their own name)."""
    chat: bool = False
    """Render prompts with the tokenizer's chat template; its end-of-turn token becomes EOS (docs/real-models.md)."""
    system_prompt: str | None = None
    """chat: a system turn put before every conversation that has none."""
    chat_template_kwargs: dict[str, Any] = {}
    """chat: extra variables of the chat template in every rendering (rollouts, SFT, evaluation, tool turns), e.g. {enable_thinking: false} for Qwen3."""

    @field_validator("columns")
    @classmethod
    def _columns(cls, columns: dict) -> dict:
        return keys_among("task.columns field", columns, FIELDS)

    @field_validator("splits")
    @classmethod
    def _splits(cls, splits: dict) -> dict:
        return keys_among("task.splits key", splits, SPLIT_KEYS)

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        return one_of("task", name, tasks.available())


class RewardSpec(Section):
    type: str = "verifier"
    """Reward source: verifier | function | model | math | think_format | env (the environment's reward); docs/real-models.md."""
    weight: float = 1.0
    """Weight of this source in the summed reward."""
    fn: str | None = None
    """function: 'module:function' with signature fn(completion, **row) -> float."""
    path: str | None = None
    """model: local AutoModelForSequenceClassification directory."""

    @field_validator("type")
    @classmethod
    def _type(cls, name: str) -> str:
        return one_of("reward type", name, source_types())

    @model_validator(mode="after")
    def _needs(self) -> "RewardSpec":
        needs = {"function": "fn", "model": "path"}.get(self.type)
        if needs and getattr(self, needs) is None:
            raise ValueError(f"a reward of type {self.type!r} needs {needs!r}")
        return self


class DataConfig(Section):
    on_error: Literal["fail", "skip"] = "fail"
    """A bad training or test example: fail (name it, file:line) | skip (drop and count it); docs/reliability.md."""


class RewardsConfig(Section):
    sources: list[RewardSpec] = [RewardSpec()]
    """Reward sources, summed with their weights."""
    on_error: Literal["fail", "zero", "drop"] = "fail"
    """A reward call that fails on a sample: fail (stop, naming it) | zero (score 0) | drop (mask it out); docs/reliability.md."""
    timeout_s: float = Field(30.0, gt=0)
    """Wall-clock limit of one reward call on one sample (a hung call counts as an error)."""
    max_hung: int = Field(8, ge=0)
    """Hung in-process calls tolerated per run (each leaves a thread behind); beyond, the run stops. Use sandbox for code that may hang."""
    sandbox: bool = False
    """Run function rewards in a limited worker process (CPU, memory, wall clock; no network); docs/reliability.md."""
    sandbox_cpu_s: float = Field(10.0, gt=0)
    """sandbox: CPU seconds per call (rounded up to whole seconds)."""
    sandbox_memory_mb: int = Field(1024, ge=64)
    """sandbox: address-space limit of the worker process."""


def keys_among(what: str, mapping: dict, valid) -> dict:
    """``mapping`` unchanged when every key is one of ``valid`` (else one_of's one line)."""
    for key in mapping:
        one_of(what, key, list(valid))
    return mapping
