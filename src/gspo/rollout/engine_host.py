"""The rollout engine's life in a run: built from the policy after the cold start, handed the
policy's weights before every generation, put to sleep during the update, closed at the end; and
the engine evaluation samples through (``EngineHost``). A LoRA policy reaches an engine that
samples whole weights only (``Capabilities.adapters`` False: vllm, generators on Ray) as its base
model with the adapters merged into the weights (``engines.weights.merged_adapters``), built from
and synced with those; one that samples adapters (hf) gets the policy as it is.

It owns no sampling logic (``gspo.rollout.engines``) and no batch (``gspo.rollout.collect``):
only which engine exists, with which weights, when.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from typing import ContextManager, Mapping

import torch

from gspo.models.presets import DTYPES
from gspo.rollout import engines
from gspo.rollout.engines import ray_cluster, ray_generators
from gspo.rollout.engines.weights import adapted, architecture, merged_adapters
from gspo.rollout.shares import Shards


@dataclass
class EngineHost:
    """The run's rollout.engine over ``model`` (the policy), built on first use (``sampler``)."""

    cfg: object                        # TrainConfig: rollout, seed, run.threads
    model: torch.nn.Module
    tokenizer: object
    shards: Shards
    share_prompts: bool = True
    """Prefill each prompt once for its G rows (False: a routing capture sees every row)."""
    engine: engines.Engine | None = None
    evaluator: engines.Engine | None = None
    """hf: the engine on the policy itself that evaluation samples through (``eval_engine``)."""
    sync_s: float = 0.0
    """Seconds spent handing the policy's weights to the engine since the last reset
    (time/weight_sync_s: a part of time/generate_s)."""

    def sampler(self, version: int | None = None) -> engines.Engine:
        """The rollout.engine, built from the policy on first use (after the cold start), else
        woken (rollout.engine_sleep) and handed the policy's current weights as those of
        ``version`` (in place; nothing to hand to hf sampling on the policy itself). Called before
        each generation, so the weights after every optimizer step, a guard's skip or roll-back,
        or a resume are the ones sampled from."""
        if self.engine is None:
            self.engine = self.build()
        else:
            if self.cfg.rollout.engine_sleep:   # woken before its weights are written
                self.engine.wake_up()
            if not self.engine.samples_on(self.model):   # (hf on the policy: its own weights)
                t0 = time.perf_counter()
                self.engine.update_weights(self.weights(), version)
                self.sync_s += time.perf_counter() - t0
        self.engine.version = version
        return self.engine

    def build(self) -> engines.Engine:
        """The rollout.engine from the policy (a LoRA policy's merged base, ``merges``): in this
        process, or generators on Ray."""
        r = self.cfg.rollout
        model = architecture(self.model) if self.merges() else self.model
        settings = {"dtype": None if r.dtype == "model" else DTYPES[r.dtype],
                    "seed": self.cfg.seed, "enable_sleep_mode": r.engine_sleep,
                    "share_prompts": self.share_prompts, "quantize": r.quantize,
                    "weights": self.weights(), "tensor_parallel": r.engine_tp, "sampler": r.sampler}
        options = engines.options_for(r.engine, settings)
        if r.placement == "ray":          # generators of their own (engines.ray_generators)
            spec = ray_cluster.RaySpec.of(r, self.cfg.run.threads)
            options["weights"] = settings["weights"]
            return ray_generators.build(r.engine, model, self.tokenizer, spec,
                                        ranks=self.shards, **options)
        return engines.build(r.engine, model, self.tokenizer, **options)

    def capabilities(self) -> engines.Capabilities:
        """The rollout engine's capabilities as this run places it (generators on Ray: their own)."""
        r = self.cfg.rollout
        return (ray_generators.on_generators(r.engine) if r.placement == "ray"
                else engines.capabilities(r.engine))

    def merges(self) -> bool:
        """Whether the engine gets the policy's LoRA adapters merged into whole weights: a LoRA
        policy, and an engine that samples whole weights only (``Capabilities.adapters``)."""
        return adapted(self.model) and not self.capabilities().adapters

    def weights(self) -> Mapping[str, torch.Tensor]:
        """The policy's weights as the engine takes them: its own (``Shards.weights``), or a LoRA
        policy's merged under its base's names (``merges``), computed as each is read."""
        own = self.shards.weights(self.model)
        return merged_adapters(self.model, own) if self.merges() else own

    def for_worker(self, model: torch.nn.Module) -> "EngineHost":
        """The host of a thread worker of rollout.async sampling from ``model`` (its copy of the
        policy): this engine, built now if need be, when the engine is shared (vllm: one per
        process; each side syncs it to its own weights before it generates, evaluation and the
        worker's generation under one lock; generators on Ray), else none yet (the worker builds
        its own on its copy)."""
        r = self.cfg.rollout
        shared = engines.capabilities(r.engine).shared or r.placement == "ray"
        return replace(self, model=model, engine=self.sampler() if shared else None,
                       evaluator=None, sync_s=0.0)

    def sleep(self) -> None:
        """After a step's generation, before its update: put the engine to sleep
        (rollout.engine_sleep; a no-op for an engine with nothing to free)."""
        if self.engine is not None and self.cfg.rollout.engine_sleep:
            self.engine.sleep()

    def close(self) -> None:
        """Release the engine (end of the run)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def eval_engine(self) -> engines.Engine:
        """The engine evaluation samples through, with the policy's current weights: the rollout
        engine when it has its own kernels (vllm: the fast sampler for greedy and pass@k too);
        for hf an engine on the policy itself, so that evaluation stays transformers on the
        policy in its own dtype whatever rollout.dtype is (hf generators on Ray too: no sync)."""
        r = self.cfg.rollout
        if r.placement != "ray" or engines.capabilities(r.engine).own_kernels:
            engine = self.sampler()
            if engine.module is None:
                return engine
        if self.evaluator is None:
            self.evaluator = engines.build("hf", self.model, self.tokenizer, sampler=self.cfg.rollout.sampler)
        return self.evaluator

    def gathered(self, engine: engines.Engine) -> ContextManager:
        """Around a generation through ``engine``: fsdp's parameters gathered on every rank when
        the engine samples on the policy's module (hf), so that its forwards run without
        collectives; an engine with its own copy of the weights (vllm) needs nothing."""
        return self.shards.full_params() if engine.module is not None else contextlib.nullcontext()

    def without_engines(self) -> "EngineHost":
        """A copy holding no engine (what a worker process is sent: it builds its own)."""
        return replace(self, engine=None, evaluator=None, sync_s=0.0)


