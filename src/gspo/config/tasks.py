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
    """Task from the registry (gspo.tasks.available()), or 'custom' for JSONL + reward function, or 'dataset' for JSONL / JSON / parquet / CSV / arrow files read with Hugging Face datasets (docs/real-models.md)."""
    n_train: int | None = Field(None, ge=1)
    """Training prompts to generate (built-in tasks; None: the task's default)."""
    n_test: int | None = Field(None, ge=1)
    """Held-out prompts to generate (built-in tasks; None: the task's default)."""
    n_val: int | None = Field(None, ge=1)
    """Validation prompts to generate, drawn after train and test and disjoint from both (built-in tasks; None: 200 when eval.split=validation, else none). For choosing hyper-parameters without the test split."""
    params: dict[str, Any] = {}
    """Task-specific generator options (e.g. {max_digits: 2} for arithmetic)."""
    train_file: str | None = None
    """custom task: JSONL file with 'prompt' and 'answer' per row (and any other columns). dataset task: a .jsonl / .json / .parquet / .csv / .arrow file, columns named by task.columns."""
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
    """custom task: reward function as 'module:function', called fn(completion, **row) -> float. dataset task: the same, optional (default: 1 when the final answer equals the answer column by value, math-verify)."""
    correct_threshold: float = 1.0
    """custom task: a completion counts as correct when its reward is at least this."""
    columns: dict[str, str] = {}
    """dataset task: which column of the files holds each field, e.g. {prompt: question, answer: solution} (fields: prompt, messages, answer; unset fields use their own name)."""
    chat: bool = False
    """Render prompts with the tokenizer's chat template (add_generation_prompt): the row's messages, or its prompt as one user turn. The template's end-of-turn token (e.g. <|im_end|>) becomes EOS for generation, the response mask and decoding. Needs a tokenizer with a chat template (model.tokenizer=bpe, or a model.path that has one)."""
    system_prompt: str | None = None
    """chat: a system turn put before every conversation that has none."""
    chat_template_kwargs: dict[str, Any] = {}
    """chat: extra variables of the chat template in every rendering (rollouts, SFT, evaluation, tool turns), e.g. {enable_thinking: false} for Qwen3."""

    @field_validator("columns")
    @classmethod
    def _columns(cls, columns: dict) -> dict:
        for key in columns:
            one_of("task.columns field", key, list(FIELDS))
        return columns

    @field_validator("splits")
    @classmethod
    def _splits(cls, splits: dict) -> dict:
        for key in splits:
            one_of("task.splits key", key, list(SPLIT_KEYS))
        return splits

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        return one_of("task", name, tasks.available())


class RewardSpec(Section):
    type: str = "verifier"
    """Reward source: verifier (the task's) | function (module:function) | model (local reward model) | math (final answer equal by value, math-verify) | think_format (<think>...</think> answer layout)."""
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
    """A bad example (bad JSON, missing or empty prompt, wrong type, characters the tokenizer cannot encode, longer than the context): fail names it (file:line); skip drops it and counts it (log, summary.json)."""


class RewardsConfig(Section):
    sources: list[RewardSpec] = [RewardSpec()]
    """Reward sources, summed with their weights."""
    on_error: Literal["fail", "zero", "drop"] = "fail"
    """A reward source that raises, hangs, or returns None / a non-number / NaN / Inf on a sample: fail stops naming the sample; zero scores it 0; drop masks the sample out of the advantages and the loss. Counted in reward/errors."""
    timeout_s: float = Field(30.0, gt=0)
    """Wall-clock limit of one reward call on one sample (a hung call counts as an error)."""
    max_hung: int = Field(8, ge=0)
    """Hung in-process calls tolerated per run (each leaves a thread behind); beyond, the run stops. Use sandbox for code that may hang."""
    sandbox: bool = False
    """Run 'function' rewards (and a custom task's reward) in a separate process with CPU, memory and wall limits and no network: for rewards that execute model-written code."""
    sandbox_cpu_s: float = Field(10.0, gt=0)
    """sandbox: CPU seconds per call (rounded up to whole seconds)."""
    sandbox_memory_mb: int = Field(1024, ge=64)
    """sandbox: address-space limit of the worker process."""
