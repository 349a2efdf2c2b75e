"""Reward composition: verifiers, user functions (`module:function`), reward models and the
environment's own reward, weighted.

A `RewardSource` maps (completions, examples) to one float per completion; a source that reads
whole episodes (`reads_records`) also gets each row's `EpisodeRecord` (gspo.tasks.record: the
transcript, the tool calls, the environment's info and reward) as `records`. `CombinedReward`
sums weighted sources into `RewardResult(total [N], per_source {name: [N]})`, the per-source
values unweighted so they can be logged as `reward/<name>`. `build_rewards(specs, task)` builds
one from config dicts through a registry of source types (function sources optionally in the
sandbox). Per-sample timeouts and the error policy wrap it in `gspo.rewards.isolation`. This
module does not normalise rewards (advantages do that).
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch

from gspo.hub import local_path
from gspo.models.presets import reading_checkpoint
from gspo.registry import Registry
from gspo.tasks import Example, Task
from gspo.tasks.base import call_kwargs, to_reward
from gspo.rewards.sandbox import Limits, SandboxedFunction
from gspo.tasks.custom import load_function
from gspo.tasks.record import EpisodeRecord, keywords_for
from gspo.tasks.verifiers import math_equal, math_verify, think_format


@runtime_checkable
class RewardSource(Protocol):
    """One named reward: a float per completion."""

    name: str

    def __call__(self, completions: list[str], examples: list[Example]) -> list[float]: ...


def records_or_single(completions: list[str], records: list[EpisodeRecord] | None
                      ) -> list[EpisodeRecord]:
    """The rows' episode records; single-turn rows (None) as their one assistant turn."""
    return records if records is not None else [EpisodeRecord.single(c) for c in completions]


def score(source, completions: list[str], examples: list[Example],
          records: list[EpisodeRecord] | None) -> list[float]:
    """``source``'s values, handing it the records when it reads them (``reads_records``)."""
    if getattr(source, "reads_records", False):
        return source(completions, examples, records)
    return source(completions, examples)


@dataclass
class RewardResult:
    """Combined rewards of a batch of N completions."""

    total: torch.Tensor  # [N] float32, sum_k weight_k * per_source[k]
    per_source: dict[str, torch.Tensor]  # name -> [N] float32, unweighted
    errors: torch.Tensor | None = None  # [N] bool: a source failed on this sample (IsolatedReward)


class VerifierReward:
    """The task's own verifier, `task.reward(completion, example)`."""

    per_sample = True  # IsolatedReward may call it one completion at a time

    def __init__(self, task: Task, *, name: str = "verifier"):
        self.task, self.name = task, name
        spec = getattr(task, "reward_spec", None)   # a custom task: the user's module:function
        self.label = f"task.reward {spec!r}" if spec else repr(name)   # as the config names it

    def __call__(self, completions: list[str], examples: list[Example]) -> list[float]:
        src = f"{self.name} ({self.task.name}.reward)"
        return [to_reward(self.task.reward(c, ex), src) for c, ex in zip(completions, examples)]


class FunctionReward:
    """A user function `fn(completion, prompt=..., answer=..., **data) -> float`; one that names
    `transcript`, `tool_calls` or `info` as parameters gets them from the row's episode record."""

    per_sample = True
    reads_records = True

    def __init__(self, fn: str | Callable, *, name: str | None = None):
        self.spec = fn if isinstance(fn, str) else getattr(fn, "__qualname__", repr(fn))
        self.fn = load_function(fn) if isinstance(fn, str) else fn
        self.name = name or self.spec.replace(":", ".")

    def __call__(self, completions: list[str], examples: list[Example],
                 records: list[EpisodeRecord] | None = None) -> list[float]:
        return [to_reward(self.call(c, ex, rec), f"function {self.spec!r}")
                for c, ex, rec in zip(completions, examples, records_or_single(completions, records))]

    def call(self, completion: str, example: Example, record: EpisodeRecord):
        """The function on one row: in a sandbox worker, which picks the record's fields the
        function names, or here with the same choice (``keywords_for``)."""
        row = {"prompt": example.prompt, "answer": example.answer, **example.data}
        if isinstance(self.fn, SandboxedFunction):
            return self.fn.score(completion, row, record.keywords())
        return self.fn(completion, **keywords_for(self.fn, row, record.keywords()))


class ModelReward:
    """A local `AutoModelForSequenceClassification` scoring `prompt + completion` (logit `label`)."""

    def __init__(
        self,
        path: str,
        *,
        name: str | None = None,
        batch_size: int = 16,
        device: str = "cpu",
        label: int = 0,
        max_length: int | None = None,
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = local_path(path, "reward model")
        if not os.path.isdir(path):
            raise ValueError(f"reward model: {path!r} is not a local directory")
        self.name = name or "model_" + os.path.basename(os.path.normpath(path))
        self.batch_size, self.device, self.label, self.max_length = batch_size, device, label, max_length
        with reading_checkpoint(f"reward model {self.name!r}", path):
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            self.model = AutoModelForSequenceClassification.from_pretrained(
                path, local_files_only=True, use_safetensors=True)  # never unpickle weights
        self.model.to(device).eval()
        if self.tokenizer.pad_token is None:
            if self.tokenizer.eos_token is None:
                raise ValueError(f"reward model {path!r}: tokenizer has neither a pad nor an eos token")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:  # sequence classifiers find the last token by it
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        if not 0 <= label < self.model.config.num_labels:
            n = self.model.config.num_labels
            raise ValueError(f"reward model {path!r}: label {label} out of range (num_labels={n})")

    @torch.no_grad()
    def __call__(self, completions: list[str], examples: list[Example]) -> list[float]:
        texts = [ex.prompt + c for c, ex in zip(completions, examples)]
        scores: list[float] = []
        for i in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(
                texts[i : i + self.batch_size],
                return_tensors="pt",
                padding=True,
                truncation=self.max_length is not None,
                max_length=self.max_length,
            ).to(self.device)
            logits = self.model(**enc).logits.float()  # [B, num_labels]
            scores.extend(logits[:, self.label].tolist())
        return scores


class MathReward:
    """1.0 when the completion's final answer equals the example's answer by value (math-verify:
    ``\\boxed{1/2}``, ``0.5``, ``1/2`` and ``#### 0.5`` alike; see ``gspo.tasks.verifiers``), else 0.0."""

    per_sample = True

    def __init__(self, *, name: str = "math"):
        math_verify()  # installed, or a one-line error now rather than at the first reward
        self.name = name

    def __call__(self, completions: list[str], examples: list[Example]) -> list[float]:
        return [float(math_equal(c, ex.answer)) for c, ex in zip(completions, examples)]


class ThinkFormatReward:
    """1.0 when the completion is laid out as ``<think>reasoning</think> answer``, else 0.0."""

    per_sample = True

    def __init__(self, *, name: str = "think_format"):
        self.name = name

    def __call__(self, completions: list[str], examples: list[Example]) -> list[float]:
        return [think_format(c) for c in completions]


class EnvReward:
    """The environment's own reward of each finished episode (``Environment.reward()``)."""

    per_sample = True
    reads_records = True
    needs_episode = True
    """Scores only rows that ran an episode (nothing to probe on demonstrations)."""

    def __init__(self, *, name: str = "env"):
        self.name = name

    def __call__(self, completions: list[str], examples: list[Example],
                 records: list[EpisodeRecord] | None = None) -> list[float | None]:
        if records is None:
            raise ValueError("reward type 'env' needs a multi-turn episode (multiturn.env)")
        return [rec.reward for rec in records]   # None: the environment gave none (a failure)


class CombinedReward:
    """Weighted sum of reward sources."""

    def __init__(self, sources: list[tuple[RewardSource, float]]):
        if not sources:
            raise ValueError("CombinedReward needs at least one reward source")
        names = [s.name for s, _ in sources]
        if dupes := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"reward source names must be unique, repeated: {', '.join(dupes)} (set 'name')")
        for s, w in sources:
            if not isinstance(w, numbers.Real) or not math.isfinite(w):
                raise ValueError(f"reward source {s.name!r}: weight must be a finite number, got {w!r}")
        self.sources = [(s, float(w)) for s, w in sources]

    @property
    def weights(self) -> dict[str, float]:
        return {s.name: w for s, w in self.sources}

    def __call__(self, completions: list[str], examples: list[Example],
                 records: list[EpisodeRecord] | None = None) -> RewardResult:
        n = len(completions)
        if len(examples) != n:
            raise ValueError(f"got {n} completions but {len(examples)} examples")
        total = torch.zeros(n, dtype=torch.float32)  # [N]
        per_source = {}
        for source, weight in self.sources:
            values = score(source, completions, examples, records)
            if len(values) != n:
                raise ValueError(f"reward source {source.name!r} returned {len(values)} values for {n} completions")
            r = torch.tensor(values, dtype=torch.float32)  # [N]
            per_source[source.name] = r
            total += weight * r
        return RewardResult(total=total, per_source=per_source)


# ---------------------------------------------------------------------------------------------
# config: {"type": ..., "weight": ..., <type-specific keys>} -> source, through a registry

_SOURCE_TYPES: Registry[Callable[..., RewardSource]] = Registry("reward type", valid="valid types")


register_source = _SOURCE_TYPES.register
"""Decorator: `@register_source(type_name)` on `builder(task, **spec_keys) -> RewardSource`, for
`{"type": type_name}`."""
source_types = _SOURCE_TYPES.names
"""Registered reward source types, sorted."""


@register_source("verifier")
def _verifier(task: Task | None, *, name: str = "verifier") -> RewardSource:
    if task is None:
        raise ValueError("reward type 'verifier' needs a task")
    while hasattr(task, "inner"):  # the raw task: failures must reach IsolatedReward, not be absorbed
        task = task.inner
    return VerifierReward(task, name=name)


@register_source("function")
def _function(task: Task | None, *, fn: str, name: str | None = None) -> RewardSource:
    return FunctionReward(fn, name=name)


@register_source("model")
def _model(
    task: Task | None,
    *,
    path: str,
    name: str | None = None,
    batch_size: int = 16,
    device: str = "cpu",
    label: int = 0,
    max_length: int | None = None,
) -> RewardSource:
    return ModelReward(path, name=name, batch_size=batch_size, device=device, label=label, max_length=max_length)


@register_source("math")
def _math(task: Task | None, *, name: str = "math") -> RewardSource:
    return MathReward(name=name)


@register_source("env")
def _env(task: Task | None, *, name: str = "env") -> RewardSource:
    return EnvReward(name=name)


@register_source("think_format")
def _think_format(task: Task | None, *, name: str = "think_format") -> RewardSource:
    return ThinkFormatReward(name=name)


def build_rewards(specs: list[dict], task: Task | None = None, sandbox: Limits | None = None
                  ) -> CombinedReward:
    """Build a `CombinedReward` from dicts like `{"type": "function", "fn": "m:f", "weight": 0.5}`.

    `sandbox` (`rewards.sandbox`): function sources run in a `gspo.rewards.sandbox` worker with
    these limits and are never imported here. Per-sample isolation (timeouts, the on_error
    policy) is `gspo.rewards.isolation.IsolatedReward`'s, around the result.
    """
    sources = []
    for i, spec in enumerate(specs):
        spec = {k: v for k, v in spec.items() if v is not None}  # None: unset (a config's blank field)
        kind, weight = spec.pop("type", None), spec.pop("weight", 1.0)
        if kind not in _SOURCE_TYPES:
            raise ValueError(f"rewards.sources[{i}]: {_SOURCE_TYPES.unknown(kind)}")
        builder = _SOURCE_TYPES.get(kind)
        call_kwargs(builder, spec, what=f"rewards.sources[{i}] (type {kind!r})", args=(task,))
        try:
            if kind == "function" and sandbox is not None:
                spec["fn"] = SandboxedFunction(spec["fn"], sandbox)
            sources.append((builder(task, **spec), weight))
        except ValueError as err:
            raise ValueError(f"rewards.sources[{i}] (type {kind!r}): {err}") from err
    return CombinedReward(sources)
