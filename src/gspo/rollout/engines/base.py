"""The engine interface, its capabilities record and the registry (docs/engines.md).

An engine is built once from the policy, samples G responses to each prompt given as token ids
(never re-tokenised) with sampling parameters and a seed, and returns ``rollout.Samples``:
response ids, the mask up to and including EOS, truncation flags and the sampler's own log-probs
at the sampling temperature. Between RL steps ``update_weights(weights, version)`` hands it the
trained weights as named tensors (the policy's ``state_dict`` names) and the version they are:
nothing of the trainer's module crosses, so a sampler in another process or on another machine
can implement the same interface. ``sleep`` / ``wake_up`` free and restore its memory. An
engine's constructor takes only the options it honours (``build`` refuses any other).

What an engine can and cannot do is one ``Capabilities`` record per engine class; every rule that
depends on the engine (the config's refusals, the collector's seeds, the async worker) reads it,
never the engine's name. This module samples nothing itself; it does not score, train or read
configs.
"""

from __future__ import annotations

import importlib.util
import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Mapping

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gspo.errors import UserError
from gspo.registry import Registry
from gspo.rollout.generate import RolloutBatch, Samples, SamplingParams, left_pad, rollout_batch
from gspo.tasks import Example


class EngineUnavailable(UserError):
    """The engine asked for cannot run here (not installed, or cannot serve this model): one line."""


@dataclass(frozen=True)
class Capabilities:
    """What an engine can and cannot do, read by every rule that depends on the engine."""

    always_logprobs: bool = False
    """Its log-probs come with its tokens at no cost, so a rollout always asks for them
    (mismatch/* every step); False: computed only when asked."""
    shared: bool = False
    """One engine per process serves the trainer and a thread worker of rollout.async in turn (each
    side syncs it to its own weights first, under the worker's lock); False: the worker builds its own."""
    own_kernels: bool = False
    """Samples with kernels of its own from its own copy of the weights: no expert routing returned,
    rollout.engine_tp applies, evaluation samples through it."""
    adapters: bool = False
    """Samples a LoRA policy with its adapters as peft applies them (on the policy, or a copy of it);
    False: whole weights only, so a LoRA policy reaches it as its base with the adapters merged
    into the weights (W + B·A·scale, the base's names: gspo.rollout.engine_host)."""
    seeds_per_prompt: bool = False
    """``generate(seed=s)`` seeds prompt p with s + p, independently of the others, so a batch split
    over calls (ranks) with seeds offset by each share's first index is the one-call batch."""
    default_correction: str = "none"
    """train.rollout_correction.mode when the config leaves it unset: none for the policy sampling
    itself; tis where the engine's kernels give other log-probs than the trainer's."""
    joins_process_group: bool = False
    """Under torchrun it builds itself as a collective of the trainers' process group, so a process
    worker of rollout.async cannot build one of its own (a thread worker shares the rank's)."""
    trainer_logprobs: bool = False
    """On the policy in its own dtype, its log-probs are the trainer's own computation (the async
    worker may take them as π_v instead of a log-prob pass)."""
    requires: str | None = None
    """The package it needs (checked before anything is built)."""
    refuses: Mapping[str, str] = field(default_factory=dict)
    """transformers config.model_type -> why this engine cannot serve such a model."""


class Engine(ABC):
    """A sampler built from a policy: ``generate`` and ``update_weights``; ``sleep`` / ``wake_up``
    free and restore its memory between generation and training (no-ops where nothing is held)."""

    module: torch.nn.Module | None = None
    """The transformers model that samples when it is one (hf: routing capture and FSDP's gathered
    weights work on it); None for an engine with its own kernels (vllm)."""
    capabilities: "Capabilities"
    """What the engine can and cannot do (each engine class sets its own record)."""

    @abstractmethod
    def generate(self, prompt_ids: list[list[int]], group_size: int, params: SamplingParams,
                 seed: int | None = None, with_logprobs: bool = True) -> Samples:
        """G = ``group_size`` responses to each prompt, rows grouped by prompt (N = P·G)."""

    version: int | None = None
    """The weights version (RL steps done) it samples from, as its last update said."""

    @property
    def device(self) -> torch.device:
        """Where its samples' tensors are (the prompts of a batch are laid out there)."""
        return torch.device("cpu")

    def samples_on(self, module: torch.nn.Module) -> bool:
        """Whether it samples on ``module`` itself (hf on the policy): its weights are then always
        the module's, and there is nothing to update."""
        return self.module is module

    @abstractmethod
    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int | None) -> None:
        """Sample from ``weights`` (name -> tensor, the policy's ``state_dict`` names) from now
        on, the weights of ``version`` (None: not a training version, e.g. a test's)."""

    def sleep(self) -> None:
        """Release what the engine holds between generations (GPU memory); default: nothing."""

    def wake_up(self) -> None:
        """Undo ``sleep``."""

    def close(self) -> None:
        """Release the engine for good (vllm: its engine core and process group); default: nothing."""

    def metrics(self) -> dict:
        """What the engine measured since the last call, as metrics (generators on Ray: their
        weight syncs and restarts, engines.ray_generators); default: nothing."""
        return {}


ENGINES: Registry[type[Engine]] = Registry("engine", error=EngineUnavailable)


def register(name: str):
    """Class decorator: ``@register("name")`` makes the engine class buildable by name."""
    return ENGINES.register(name)


def available() -> list[str]:
    """Sorted names of the registered engines (installed or not)."""
    return ENGINES.names()


def capabilities(name: str) -> Capabilities:
    """The capabilities of the engine registered as ``name``."""
    return ENGINES.get(name).capabilities


def check(name: str, model_type: str | None = None) -> None:
    """EngineUnavailable (one line) unless engine ``name`` is known, installed and can serve a model
    of ``model_type`` (its transformers ``config.model_type``); before anything is built."""
    can = capabilities(name)
    if refuse := can.refuses.get(model_type):
        raise EngineUnavailable(f"engine {name!r} cannot serve a {model_type} model: {refuse}")
    if can.requires and importlib.util.find_spec(can.requires) is None:
        raise EngineUnavailable(f"engine {name!r} needs the {can.requires!r} package, which is not "
                                f"installed (GPU: pip install 'gspo[{can.requires}]'; this CPU: "
                                f"make test-vllm builds .venv-vllm)")


def options_for(name: str, settings: dict) -> dict:
    """The ``settings`` (option -> value) that engine ``name``'s constructor takes: a run offers
    each engine only what it honours (hf: no seed of its own, nothing to put to sleep)."""
    takes = inspect.signature(ENGINES.get(name).__init__).parameters
    return {k: v for k, v in settings.items() if k in takes}


def build(name: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, **options) -> Engine:
    """The engine ``name`` built from ``model`` (checked first); ``options`` go to its
    constructor, which refuses any it does not take (TypeError)."""
    check(name, getattr(model.config, "model_type", None))
    return ENGINES.get(name)(model, tokenizer, **options)


def generate_batch(engine: Engine, tokenizer: PreTrainedTokenizerBase, examples: list[Example],
                   params: SamplingParams, *, group_size: int = 1, with_logprobs: bool = False,
                   seed: int | None = None) -> RolloutBatch:
    """``rollout.generate`` through ``engine``: the prompts' token ids (tokenised once, as the
    trainer scores them) to the engine, its samples to a ``RolloutBatch`` (N = P·G rows)."""
    prompt_ids = [tokenizer(ex.prompt)["input_ids"] for ex in examples]
    samples = engine.generate(prompt_ids, group_size, params, seed=seed, with_logprobs=with_logprobs)
    ids, mask = left_pad(prompt_ids, tokenizer.pad_token_id, engine.device)     # [P, Lp]
    return rollout_batch(tokenizer, ids, mask, samples, examples, group_size)
