"""Collecting one RL step's rollout batch: P prompts in data order, G sampled responses each, scored.

``Collector.collect(step)`` takes the next P training prompts (``DataCursor``), samples G
responses per prompt with the policy (``generate``; under ``moe.routing_replay=rollout`` the
experts used are kept in ``batch.routing``), scores them with the run's rewards and
returns the batch, its rewards [N] and the step's reward / response metrics. With
``train.dynamic_sampling`` groups whose rewards are all equal are dropped and fresh prompts drawn
until the batch is full again (at most ``train.max_refill_rounds`` more rounds).

Data parallel runs hand it a ``Shards`` (gspo.training.distributed.Dist): each rank samples its
share of the prompts with its own seed and ranks refill in step. This module samples and scores;
it computes no advantages and never trains.
Shapes: P prompts, G responses per prompt, N = P·G rows, T response positions.
"""

from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Mapping, Protocol

import torch

from gspo.models import moe
from gspo.models.presets import DTYPES
from gspo.rewards.isolation import correct_all
from gspo.rollout import engines, remote
from gspo.rollout.episodes import Episode, SingleTurn
from gspo.rollout.generate import RolloutBatch, SamplingParams


@dataclass
class DataCursor:
    """Position in the shuffled training prompts (epoch-seeded permutations): resumable."""
    size: int
    seed: int
    epoch: int = 0
    index: int = 0
    order: list[int] = field(default_factory=list, repr=False)
    """The current epoch's permutation (drawn again on load)."""

    def permutation(self) -> list[int]:
        order = list(range(self.size))
        random.Random(self.seed * 7919 + self.epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            if not self.order:
                self.order = self.permutation()
            if self.index >= self.size:
                self.epoch, self.index = self.epoch + 1, 0
                self.order = self.permutation()
            take = min(n - len(out), self.size - self.index)
            out += self.order[self.index:self.index + take]
            self.index += take
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load(self, state: dict) -> None:
        self.epoch, self.index, self.order = state["epoch"], state["index"], []


def split_minibatches(n: int, m: int, generator: torch.Generator, group_size: int = 1
                      ) -> list[torch.Tensor]:
    """A shuffled partition of range(n) into m nearly equal index sets. ``group_size`` G > 1: the
    units dealt are the n / G groups of G consecutive rows (a prompt's responses), kept whole,
    so that each prompt is in one minibatch (train.minibatch_by=groups)."""
    if group_size == 1:
        return list(torch.randperm(n, generator=generator).tensor_split(min(m, n)))
    if n % group_size:
        raise ValueError(f"{n} rows are not whole groups of {group_size}")
    groups = torch.randperm(n // group_size, generator=generator)                 # [n / G]
    within = torch.arange(group_size)                                              # [G]
    return [(part[:, None] * group_size + within).reshape(-1)                      # [|part| * G]
            for part in groups.tensor_split(min(m, n // group_size))]


def rollout_seed(run_seed: int, step: int, rnd: int = 0) -> int:
    """Sampling seed of generation round ``rnd`` of ``step`` (before a rank's own offset)."""
    return run_seed * 1_000_003 + step * 101 + rnd


def minibatch_seed(run_seed: int, step: int) -> int:
    """Seed of the minibatch split of ``step`` (the policy's and PPO's critic's)."""
    return run_seed * 7 + step


class Shards(Protocol):
    """What collection asks of the ranks (gspo.training.distributed.Dist; one process: trivial)."""

    world: int
    """Processes in the torchrun group (1 in one process)."""

    def share(self, n: int) -> slice: ...
    def group_share(self, n: int, size: int) -> slice: ...
    def shard(self, items: list) -> list: ...
    def seed(self, base: int) -> int: ...
    def all(self, flag: bool) -> bool: ...
    def full_params(self) -> ContextManager: ...
    def weights(self, model: torch.nn.Module) -> Mapping[str, torch.Tensor]: ...


def reward_stats(task, batch: RolloutBatch, rewards: torch.Tensor, per_source: dict,
                 group_size: int) -> dict:
    """reward/* and response/* of a scored batch; sets ``batch.correct`` [N] (task.is_correct)."""
    correct = correct_all(task, batch.completions, batch.examples)  # one hand-off
    batch.correct = torch.tensor(correct, dtype=torch.bool)   # [N], reused by the length slices
    rewards, lengths = rewards.cpu(), batch.lengths.cpu()     # host copies: no sync per .item()
    scored = rewards[rewards.isfinite()]  # rewards.on_error=drop marks dropped samples NaN
    stats = {
        "reward/mean": scored.mean().item(), "reward/std": scored.std().item(),
        "reward/accuracy": sum(correct) / len(correct),
        "reward/frac_zero_std_groups": (rewards.view(-1, group_size).std(-1) == 0).float().mean().item(),
        "response/length_mean": lengths.float().mean().item(),
        "response/length_max": lengths.max().item(),
        "response/truncated_frac": batch.truncated.cpu().float().mean().item(),
    }
    if len(per_source) > 1:
        stats.update({f"reward/{k}": v.nanmean().item() for k, v in per_source.items()})
    return stats


@dataclass
class Collector:
    """Draws, samples and scores the rollout batch of each RL step (``collect``)."""
    cfg: object                        # TrainConfig: rollout, train (refills, log-probs), moe, seed
    model: torch.nn.Module
    tokenizer: object
    task: object                       # is_correct for reward/accuracy
    train_set: list
    cursor: DataCursor
    rewards: Callable                  # (completions, examples) -> RewardResult
    shards: Shards
    device: torch.device
    engine: engines.Engine | None = None   # rollout.engine, built on first use (``sampler``)
    episode: Episode = field(default_factory=SingleTurn)
    """How the prompts become trajectories through the engine (gspo.rollout.episodes)."""
    evaluator: engines.Engine | None = None
    """hf: the engine on the policy itself that evaluation samples through (``eval_engine``)."""
    routing_stats: dict = field(default_factory=dict)
    """The last generation's moe/sampler_trainer_disagreement (a MoE sampler copy; else empty)."""
    sync_s: float = 0.0
    """Seconds spent handing the policy's weights to the engine since the last ``collect``
    (time/weight_sync_s: a part of time/generate_s)."""
    keep_logprobs: bool = False
    """Ask the sampler for its log-probs even when the config does not (the async worker takes
    them as the behaviour policy's, gspo.training.async_rollout.sampler_is_behaviour)."""

    @property
    def sampling(self) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(r.max_new_tokens, r.temperature, r.top_p, r.top_k)

    def seed(self, step: int, rnd: int = 0) -> int:
        """This rank's sampling seed of round ``rnd`` of ``step`` (recorded for audits). An engine
        that seeds each prompt on its own (``Engine.seeds_per_prompt``: vllm) gets the round's
        seed offset by the index of this rank's first prompt, so that K ranks sample exactly the
        batch of one process; generators on Ray sample every rank's prompts with rank 0's seed;
        else each rank its own seed (``Shards.seed``)."""
        base = rollout_seed(self.cfg.seed, step, rnd)
        r = self.cfg.rollout
        if engines.spec(r.engine).seeds_per_prompt or r.placement == "ray":
            return base + self.engine_share().start
        return self.shards.seed(base)

    def engine_group(self) -> int:
        """Ranks per engine: every rank for generators on Ray (rank 0 samples for them all),
        rollout.engine_tp for an engine with its own kernels (vllm), else 1."""
        r = self.cfg.rollout
        if r.placement == "ray":
            return self.shards.world
        return r.engine_tp if engines.spec(r.engine).own_kernels else 1

    def engine_share(self) -> slice:
        """The step's prompts this rank's engine samples: its own share, or with
        rollout.engine_tp > 1 its tensor-parallel group's (each rank then keeps its own rows)."""
        return self.shards.group_share(self.cfg.rollout.prompts_per_step, self.engine_group())

    def sampler(self, version: int | None = None) -> engines.Engine:
        """The rollout.engine, built from the policy on first use (after the cold start), else
        woken (rollout.engine_sleep) and handed the policy's current weights as those of
        ``version`` (in place; nothing to hand to hf sampling on the policy itself). Called before each
        generation, so the weights after every optimizer step, a guard's skip or roll-back, or a
        resume are the ones sampled from."""
        if self.engine is None:
            r = self.cfg.rollout
            settings = {"dtype": None if r.dtype == "model" else DTYPES[r.dtype],
                        "seed": self.cfg.seed, "enable_sleep_mode": r.engine_sleep,
                        "share_prompts": not self.captures_at_generation(),  # a capture sees all rows
                        "quantize": r.quantize, "weights": self.shards.weights(self.model),
                        "tensor_parallel": r.engine_tp}
            options = engines.options_for(r.engine, settings)
            if r.placement == "ray":          # generators of their own (gspo.rollout.remote)
                spec = remote.RaySpec.of(r, self.cfg.run.threads)
                self.engine = remote.build(r.engine, self.model, self.tokenizer, spec,
                                           ranks=self.shards, **options)
            else:
                self.engine = engines.build(r.engine, self.model, self.tokenizer, **options)
        else:
            if self.cfg.rollout.engine_sleep:   # woken before its weights are written
                self.engine.wake_up()
            if not self.engine.samples_on(self.model):   # (hf on the policy: its own weights)
                t0 = time.perf_counter()
                self.engine.update_weights(self.shards.weights(self.model), version)
                self.sync_s += time.perf_counter() - t0
        self.engine.version = version
        return self.engine

    def worker_engine(self) -> engines.Engine | None:
        """The engine a thread worker of rollout.async samples through: this one, built now if
        need be, when the engine is shared (vllm: one per process; each side syncs it to its own
        weights before it generates, evaluation and the worker's generation under one lock), else
        None: the worker builds its own from its copy of the policy."""
        r = self.cfg.rollout
        shared = engines.is_shared(r.engine) or r.placement == "ray"   # one set of generators
        return self.sampler() if shared else None

    def sleep_engine(self) -> None:
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
        if r.placement != "ray" or engines.spec(r.engine).own_kernels:
            engine = self.sampler()
            if engine.module is None:
                return engine
        if self.evaluator is None:
            self.evaluator = engines.build("hf", self.model, self.tokenizer)
        return self.evaluator

    def generate(self, examples, seed: int, version: int | None = None) -> RolloutBatch:
        """G responses to each example through the engine (the ``episode``); under
        moe.routing_replay=rollout the experts the sampler routed to are kept (``batch.routing``)."""
        cfg, engine = self.cfg, self.sampler(version)
        with_logprobs = (cfg.train.old_logprobs == "rollout" or cfg.train.log_rollout_logprobs
                         or cfg.train.rollout_correction.mode != "none" or engine.always_logprobs
                         or self.keep_logprobs or cfg.rollout.quantize is not None)  # its mismatch

        replay = cfg.moe.routing_replay == "rollout"          # (an engine with a module: hf)
        measure = self.measures_routing(engine)
        capture = replay or measure
        with moe.capture_routing(engine.module) if capture else contextlib.nullcontext() as cap, \
                self.gathered(engine):          # fsdp + hf: ranks may generate unequal lengths
            batch = self.episode(engine, self.tokenizer, examples, self.sampling,
                                 group_size=cfg.rollout.group_size, seed=seed,
                                 with_logprobs=with_logprobs)
        if capture:
            sampled = cap.generated_routing(batch.input_ids.shape[1])     # [N, L, layers, k]
            if replay:
                batch.routing = sampled
            if measure:
                self.routing_stats = self.routing_disagreement(batch, sampled)
        return batch

    def gathered(self, engine: engines.Engine) -> ContextManager:
        """Around a generation through ``engine``: fsdp's parameters gathered on every rank when
        the engine samples on the policy's module (hf), so that its forwards run without
        collectives; an engine with its own copy of the weights (vllm) needs nothing."""
        return self.shards.full_params() if engine.module is not None else contextlib.nullcontext()

    def captures_at_generation(self) -> bool:
        """Experts captured while sampling: R3 (moe.routing_replay=rollout), or a MoE policy
        sampled by a copy (its disagreement with the trainer measured)."""
        r = self.cfg.rollout
        copy = r.quantize is not None or r.dtype not in ("model", self.cfg.model.dtype)
        return self.cfg.moe.routing_replay == "rollout" or (copy and moe.supports_moe(self.model))

    def measures_routing(self, engine: engines.Engine) -> bool:
        """A MoE policy sampled by a copy of its own (rollout.dtype, rollout.quantize) on hf: the
        copy's experts are captured and compared with the trainer's (``routing_disagreement``)."""
        return (engine.module is not None and engine.module is not self.model
                and moe.supports_moe(self.model))

    @torch.no_grad()
    def routing_disagreement(self, batch: RolloutBatch, sampled: torch.Tensor) -> dict:
        """moe/sampler_trainer_disagreement: the share of (response token, layer) pairs whose
        top-k experts differ between the sampler copy and the trainer's own router on the same
        tokens (one forward of the trainer, no replay); the R3 paper's "routers that differ"."""
        with moe.capture_routing(self.model) as own:
            self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        T = batch.response_mask.shape[1]
        rate, _ = moe.routing_change_rate(moe.response_routing(sampled, T),
                                          moe.response_routing(own.routing, T), batch.response_mask)
        return {"moe/sampler_trainer_disagreement": rate.item()}

    def collect(self, step: int, version: int | None = None
                ) -> tuple[RolloutBatch | None, torch.Tensor, dict]:
        """Generate and score P groups; with dynamic sampling, drop zero-variance groups and refill.
        The engine sleeps once the step's generation is done (``sleep_engine``)."""
        self.sync_s = 0.0
        batch, rewards, metrics = self.collect_groups(step, version)
        if self.sync_s:
            metrics["time/weight_sync_s"] = self.sync_s
        self.sleep_engine()
        if batch is not None:
            batch.version = version
        return batch, rewards, metrics

    def collect_groups(self, step: int, version: int | None = None
                       ) -> tuple[RolloutBatch | None, torch.Tensor, dict]:
        """``collect`` without the engine's sleep."""
        cfg, G, P = self.cfg, self.cfg.rollout.group_size, self.cfg.rollout.prompts_per_step
        rounds = 1 + (cfg.train.max_refill_rounds if cfg.train.dynamic_sampling else 0)
        limit = len(range(P)[self.shards.share(P)]) * G        # this rank's rows (P·G in one process)
        kept_batches, kept_rewards, extra, first_stats = [], [], {}, None
        sampled, mine = self.engine_share(), self.shards.share(P)
        own_rows = torch.arange((mine.start - sampled.start) * G, (mine.stop - sampled.start) * G)
        for rnd in range(rounds):
            examples = [self.train_set[i] for i in self.cursor.take(P)[sampled]]
            t0 = time.perf_counter()
            batch = self.generate(examples, seed=self.seed(step, rnd), version=version)
            if sampled != mine:      # a tensor-parallel group sampled its ranks' prompts together
                batch = batch.select(own_rows)
            extra["time/generate_s"] = extra.get("time/generate_s", 0.0) + time.perf_counter() - t0
            for key, value in self.engine.metrics().items():              # ray/*: its syncs
                extra[key] = extra.get(key, 0.0) + value
            t0 = time.perf_counter()
            result = self.rewards(batch.completions, batch.examples, batch.records)
            extra["time/reward_s"] = extra.get("time/reward_s", 0.0) + time.perf_counter() - t0
            errors = 0 if result.errors is None else int(result.errors.sum())   # rewards.on_error
            extra["reward/errors"] = extra.get("reward/errors", 0) + errors
            rewards = result.total.to(self.device)                         # [N]
            if first_stats is None:
                first_stats = reward_stats(self.task, batch, rewards, result.per_source, G)
                first_stats.update(getattr(self.episode, "metrics", {}))   # multiturn/*
                first_stats.update(self.routing_stats)                    # a MoE sampler copy
            if not cfg.train.dynamic_sampling:
                return batch, rewards, {**first_stats, **extra}
            keep = rewards.view(-1, G).std(-1) > 0                          # [P]
            rows = keep.repeat_interleave(G).nonzero().squeeze(-1)
            kept_batches.append(batch.select(rows.cpu()))
            kept_rewards.append(rewards[rows])
            if self.shards.all(sum(len(r) for r in kept_rewards) >= limit):  # ranks refill in step
                break
        batch = concat_batches(kept_batches, self.tokenizer.pad_token_id, limit) if kept_batches else None
        rewards = torch.cat(kept_rewards)[:limit]
        extra["reward/refill_rounds"] = rnd
        if batch is None or len(rewards) == 0:
            return None, rewards, {**first_stats, **extra}
        return batch, rewards, {**first_stats, **extra}


def concat_batches(batches: list[RolloutBatch], pad_id: int, limit: int) -> RolloutBatch:
    """Stack rollout batches of different prompt/response widths, keeping the first ``limit`` rows.

    Prompts are re-padded on the left and responses on the right, so the layout stays
    "prompt (left-padded) + response (right-padded)" for every row.
    """
    Lp = max(b.input_ids.shape[1] - b.response_mask.shape[1] for b in batches)
    T = max(b.response_mask.shape[1] for b in batches)

    def widen(b: RolloutBatch, x: torch.Tensor, value, response_only: bool = False) -> torch.Tensor:
        t = b.response_mask.shape[1]
        left = 0 if response_only else Lp - (b.input_ids.shape[1] - t)
        return torch.cat([x.new_full((x.shape[0], left, *x.shape[2:]), value), x,
                          x.new_full((x.shape[0], T - t, *x.shape[2:]), value)], dim=1)

    def stack(get, value, response_only=False) -> torch.Tensor:
        return torch.cat([widen(b, get(b), value, response_only) for b in batches])[:limit]

    return RolloutBatch(
        input_ids=stack(lambda b: b.input_ids, pad_id),
        attention_mask=stack(lambda b: b.attention_mask, 0),
        response_mask=stack(lambda b: b.response_mask, 0.0, response_only=True),
        truncated=torch.cat([b.truncated for b in batches])[:limit],
        completions=sum((b.completions for b in batches), [])[:limit],
        examples=sum((b.examples for b in batches), [])[:limit],
        records=None if batches[0].records is None else sum((b.records for b in batches), [])[:limit],
        rollout_logp=None if batches[0].rollout_logp is None
        else stack(lambda b: b.rollout_logp, 0.0, response_only=True),
        routing=None if batches[0].routing is None else stack(lambda b: b.routing, 0),
    )
