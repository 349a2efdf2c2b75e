"""Sections for sampling (``gspo.rollout``): the rollout of each RL step, and evaluation."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from gspo.config.base import Section, one_of
from gspo.core.quantize import FORMATS
from gspo.rollout import engines, episodes
from gspo.rollout.generate import SAMPLERS


class RolloutConfig(Section):
    prompts_per_step: int = Field(16, ge=1)
    """P: prompts sampled per RL step."""
    group_size: int = Field(8, ge=2)
    """G: responses per prompt (the group of the group-relative advantage)."""
    max_new_tokens: int = Field(16, ge=1)
    """Longest response; a response without EOS by then is truncated."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; log-probs are taken at the same temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling (1.0: off). Log-probs ignore it, as in the paper."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling (0: off)."""
    sampler: str = "multinomial"
    """hf engine, how a token is drawn: multinomial (generate's) | inverse_cdf (same law, ~5x faster on a CPU at 151k tokens); docs/engines.md."""
    dtype: Literal["model", "float32", "bfloat16", "float16"] = "model"
    """Precision of the sampler: model (the policy itself) or a copy in this dtype, refreshed before every generation (docs/engines.md)."""
    quantize: str | None = None
    """Sample with a copy rounded to int8 | int4 | fp8 (gspo.core.quantize.FORMATS); None: no rounding (docs/engines.md)."""
    episode: str | None = None
    """How prompts become trajectories: single_turn | tool_loop | agent | reset_step (docs/agents.md); None: tool_loop with multiturn.env, else single_turn."""
    engine: str = "hf"
    """Generation engine (gspo.rollout.engines): hf (transformers generate) | vllm (optional package); docs/engines.md."""
    engine_tp: int = Field(1, ge=1)
    """vllm under torchrun: ranks per engine (tensor parallel; divides the process count); 1: an engine per rank (docs/engines.md)."""
    engine_sleep: bool = True
    """Free the engine's memory during the update (vLLM sleep mode on CUDA); a no-op where there is nothing to free (docs/engines.md)."""
    async_: bool = Field(False, alias="async")
    """Sample the next batches in a worker while the trainer trains on this one (docs/engines.md)."""
    async_worker: Literal["process", "thread"] = "process"
    """With rollout.async, where the worker runs: process (a forked child) | thread (in this process); docs/engines.md."""
    max_staleness: int = Field(1, ge=0)
    """With rollout.async: s, RL steps the sampling policy of a batch may lag the trained one (0: lockstep, the synchronous run)."""
    async_ratio: Literal["auto", "behaviour", "decoupled"] = "auto"
    """With rollout.async, what a stale batch's ratio is taken against: behaviour | decoupled | auto (docs/engines.md)."""

    placement: Literal["colocated", "ray"] = "colocated"
    """Where the engine runs: colocated (in the trainer's process) | ray (generator actors on a Ray cluster); docs/distributed.md."""
    generators: int = Field(1, ge=1)
    """With rollout.placement=ray: generator actors, each with its own engine and share of the prompts (docs/distributed.md)."""
    generator_cpus: float = Field(1.0, gt=0)
    """With rollout.placement=ray: CPUs Ray reserves for each generator (its torch threads: run.threads, or this rounded down when run.threads=0)."""
    generator_gpus: float = Field(0.0, ge=0)
    """With rollout.placement=ray: GPUs Ray reserves for each generator (0: it samples on CPU; the weight sync is gloo either way, NCCL is not built)."""
    ray_address: str | None = None
    """With rollout.placement=ray: host:port of a running Ray cluster (None: a local cluster for the run); docs/distributed.md."""

    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)

    @field_validator("episode")
    @classmethod
    def _episode(cls, name: str | None) -> str | None:
        return name if name is None else one_of("episode", name, episodes.names())

    @field_validator("sampler")
    @classmethod
    def _sampler(cls, name: str) -> str:
        return one_of("rollout.sampler", name, list(SAMPLERS))

    @field_validator("engine")
    @classmethod
    def _engine(cls, name: str) -> str:
        return one_of("engine", name, engines.available())

    @field_validator("quantize")
    @classmethod
    def _quantize(cls, name: str | None) -> str | None:
        return None if name is None else one_of("rollout.quantize format", name, FORMATS.names())


class EvalConfig(Section):
    split: Literal["test", "validation"] = "test"
    """Held-out split the evaluations score: test | validation (for choosing hyper-parameters without test)."""
    n: int | None = Field(None, ge=1)
    """Held-out prompts to evaluate (None: the whole split)."""
    k: int = Field(4, ge=1)
    """Samples per prompt for mean pass@1 and pass@k."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature for pass@k (greedy accuracy uses argmax)."""
    batch_size: int = Field(256, ge=1)
    """Prompts per generation batch."""
    keep_best: bool = True
    """Also score the validation split at every evaluation and keep the best weights in <run.dir>/best (docs/reliability.md)."""
