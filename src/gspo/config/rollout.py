"""Sections for sampling (``gspo.rollout``): the rollout of each RL step, and evaluation."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from gspo.config.base import Section, one_of
from gspo.core.quantize import FORMATS
from gspo.rollout import engines, episodes


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
    dtype: Literal["model", "float32", "bfloat16", "float16"] = "model"
    """Precision of the model that samples: model (the policy itself, model.dtype) or a copy of the policy in this dtype, refreshed from it before every generation (e.g. bfloat16 sampling with float32 training: a real rollout/trainer mismatch, see train.rollout_correction)."""
    quantize: str | None = None
    """Sample with a copy of the policy whose weight matrices are rounded to a format of gspo.core.quantize.FORMATS: int8 or int4 (symmetric, a scale per output channel; int4 the coarsest) or fp8 e4m3 (a scale per matrix), computed in the copy's dtype: a quantised sampler's mismatch, larger than bf16's, on any machine (gspo.core.quantize; embeddings, LM head and MoE routers stay exact). The copy is refreshed, and rounded again, before every generation, and its log-probs are always returned (mismatch/* every step, whatever the correction). Evaluation: hf on the policy itself; vllm through its rounded engine. None: no rounding."""
    episode: str | None = None
    """How prompts become trajectories (gspo.rollout.episodes): single_turn | tool_loop | agent (agent.fn through the recording endpoint, docs/agents.md); None: tool_loop with multiturn.env, else single_turn."""
    engine: str = "hf"
    """Generation engine (gspo.rollout.engines, docs/engines.md): hf (transformers generate on the policy, or on its rollout.dtype copy) | vllm (a vLLM engine in this process built once from the policy after the cold start, weights synced in place before every step's generation; optional package; under torchrun one engine per rank, or per rollout.engine_tp ranks, each sampling its share, docs/distributed.md; no LoRA, no moe.routing_replay=rollout; under rollout.async a thread worker samples through the same engine, a process worker builds its own). With vllm the sampler's log-probs are always returned (mismatch/* every step) and train.rollout_correction defaults to tis."""
    engine_tp: int = Field(1, ge=1)
    """With rollout.engine=vllm under torchrun: ranks per engine (vLLM tensor parallel over consecutive ranks; it must divide the number of processes). 1: every rank holds an engine of its own and samples its share of the step's prompts. > 1: the ranks of a group sample their shares together through one engine split across them (a model too large for one device's engine). Ignored by hf."""
    engine_sleep: bool = True
    """Free the engine's memory for the training update: after a step's generation the engine sleeps (vllm on CUDA: vLLM's sleep mode, level 1: its weights offloaded to host memory, its KV cache dropped), and it wakes before the next generation, before the weight sync. On by default; a no-op where the engine holds nothing to free (hf) or has no sleep mode (vllm on a CPU). false: the engine keeps its memory (vllm is then built without sleep mode)."""
    async_: bool = Field(False, alias="async")
    """rollout.async: generate, score and take π_old of the next batches in a worker (rollout.async_worker) with its own copy of the policy while the trainer trains on this one (gspo.async_rollout, docs/performance.md). The batch of step k is sampled by the weights after step k - max_staleness, always (so runs are reproducible and resume exactly); run.threads torch threads per side on CPU. Under torchrun (ddp) a worker per rank samples its rank's share; with vllm a thread (derived), through the rank's engine (docs/distributed.md)."""
    async_worker: Literal["process", "thread"] = "process"
    """With rollout.async, where the worker runs: process (a child process of its own, started once from a fork server: no interpreter lock or RNG shared with the trainer; weights go to it after every step as safetensors bytes, batches come back pickled, over its own pipes; a script that trains must start under `if __name__ == "__main__":`) | thread (a thread of this process: no start-up, but both sides contend for the interpreter lock; docs/performance.md). With rollout.engine=vllm a thread worker samples through the trainer's engine, a process worker builds its own (docs/engines.md)."""
    max_staleness: int = Field(1, ge=0)
    """With rollout.async: s, how many RL steps the sampling policy of a batch may lag the policy trained on it (its ratio is taken against that behaviour policy, docs/math.md). 0 runs in lockstep and reproduces the synchronous run exactly."""
    async_ratio: Literal["auto", "behaviour", "decoupled"] = "auto"
    """With rollout.async, what a stale batch's ratio is taken against (docs/math.md, Asynchronous rollouts): behaviour (π_old = the policy v that sampled it; the clip acts on π_θ/π_v) | decoupled (π_old = the trainer's weights before this step, the proximal policy: the first minibatch's own forward, the others' from the worker beside it; the clip acts on π_θ/π_prox and train.rollout_correction, which it needs, weighs each token or response by π_prox/π_v: seq_tis for sequence-level objectives such as gspo) | auto (the default: decoupled when max_staleness > 0 and train.old_logprobs=recompute, with rollout_correction.mode seq_tis for a sequence-level objective or tis for a token-level one unless a mode is set; else behaviour; docs/performance.md compares the two)."""

    placement: Literal["colocated", "ray"] = "colocated"
    """Where the rollout engine runs: colocated (in the trainer's process) | ray (rollout.generators actors on a Ray cluster, each owning a rollout.engine built from the policy's architecture; after each step the trainer's weights go to every generator over a gloo group of its own, versioned, and the prompts of a batch are split across them; scoring and π_old stay on the trainer; under torchrun (ddp) rank 0 talks to the generators for every rank; optional package: pip install 'gspo[ray]'; docs/distributed.md, Ray). With rollout.async the worker is a thread whose sampler is the generators."""
    generators: int = Field(1, ge=1)
    """With rollout.placement=ray: how many generator actors (each its own engine and share of the prompts). One hf generator samples exactly the colocated batch; several split the prompts, generator j's seed offset by its first prompt's index (vllm: the one-call batch again; hf: another, reproducible batch)."""
    generator_cpus: float = Field(1.0, gt=0)
    """With rollout.placement=ray: CPUs Ray reserves for each generator (its torch threads: run.threads, or this rounded down when run.threads=0)."""
    generator_gpus: float = Field(0.0, ge=0)
    """With rollout.placement=ray: GPUs Ray reserves for each generator (0: it samples on CPU; the weight sync is gloo either way, NCCL is not built)."""
    ray_address: str | None = None
    """With rollout.placement=ray: the address of a running Ray cluster (host:port of `ray start --head`), or None: a local cluster started for the run with rollout.generators x generator_cpus CPUs, stopped with it (also when the trainer is killed)."""

    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)

    @field_validator("episode")
    @classmethod
    def _episode(cls, name: str | None) -> str | None:
        return name if name is None else one_of("episode", name, episodes.names())

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
    """Held-out split the evaluations score: test (what results report) | validation (for choosing hyper-parameters without looking at test, e.g. the `gspo compare` grid)."""
    n: int | None = Field(None, ge=1)
    """Held-out prompts to evaluate (None: the whole split)."""
    k: int = Field(4, ge=1)
    """Samples per prompt for mean pass@1 and pass@k."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature for pass@k (greedy accuracy uses argmax)."""
    batch_size: int = Field(256, ge=1)
    """Prompts per generation batch."""
    keep_best: bool = True
    """When the task has a validation split and eval.split=test: at every evaluation (the cold start's included) also score the validation split (eval.n prompts), and keep the weights that scored best there in <run.dir>/best (summary.json: best_validation). The test split never chooses. Not under torchrun with dist.strategy=fsdp (the sharded weights are not gathered for it)."""
