"""Collecting one RL step's rollout batch: P prompts in data order, G sampled responses each, scored.

``Collector.collect(step)`` takes the next P training prompts (``DataCursor``), samples G
responses per prompt through the run's episode and engine (``generate``; under
``moe.routing_replay=rollout`` the experts used are kept in ``batch.routing``), scores them with
the run's rewards and returns the batch, its rewards [N] and the step's reward / response
metrics. With ``train.dynamic_sampling`` groups whose rewards are all equal are dropped and fresh
prompts drawn until the batch is full again (at most ``train.max_refill_rounds`` more rounds).

The Collector composes the parts that do the other jobs: the engine's life (``engine_host``),
which prompts and seeds this rank samples (``shares``), a MoE sampler's routing (``routing``) and
the rewards' statistics (``scoring``). This module computes no advantages and never trains.
Shapes: P prompts, G responses per prompt, N = P·G rows, T response positions.
"""

from __future__ import annotations

import contextlib
import copy
import random
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from gspo.core.trajectory import COLUMNS, RESPONSE, ROW, ROW_FIELDS, ROW_LAYOUT
from gspo.models import moe
from gspo.rollout import engines, routing
from gspo.rollout.engine_host import EngineHost
from gspo.rollout.episodes import Episode, SingleTurn
from gspo.rollout.generate import RolloutBatch, SamplingParams
from gspo.rollout.scoring import reward_stats, score
from gspo.rollout.shares import RankShares, Shards
from gspo.tasks import task_counts


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


@dataclass(kw_only=True)
class Collector:
    """Draws, samples and scores the rollout batch of each RL step (``collect``)."""

    cfg: object                        # TrainConfig: rollout, train (refills, log-probs), moe, seed
    host: EngineHost
    """The engine, built on first use, synced before each generation."""
    shares: RankShares
    """This rank's prompts and seeds."""
    episode: Episode
    """How the prompts become trajectories through the engine (gspo.rollout.episodes)."""
    rewards: Callable                  # (completions, examples, records) -> RewardResult
    task: object                       # is_correct for reward/accuracy
    train_set: list
    cursor: DataCursor
    device: torch.device
    keep_logprobs: bool = False
    """Ask the sampler for its log-probs even when the config does not (the async worker takes
    them as the behaviour policy's, gspo.training.async_rollout.sampler_is_behaviour)."""
    routing_stats: dict = field(default_factory=dict)
    """The last generation's moe/sampler_trainer_disagreement (a MoE sampler copy; else empty)."""

    @classmethod
    def create(cls, *, cfg, model, tokenizer, task, train_set, cursor, rewards, shards: Shards,
               device, episode: Episode | None = None, **more) -> "Collector":
        """The run's collector over ``model`` (the policy) and its parts."""
        host = EngineHost(cfg, model, tokenizer, shards,
                          share_prompts=not routing.captures_at_generation(cfg, model))
        return cls(cfg=cfg, host=host, shares=RankShares(cfg.rollout, cfg.seed, shards),
                   episode=episode or SingleTurn(), rewards=rewards, task=task,
                   train_set=train_set, cursor=cursor, device=device, **more)

    @property
    def model(self) -> torch.nn.Module:
        return self.host.model

    @property
    def tokenizer(self):
        return self.host.tokenizer

    @property
    def engine(self) -> engines.Engine | None:
        return self.host.engine

    @property
    def sampling(self) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(r.max_new_tokens, r.temperature, r.top_p, r.top_k)

    def seed(self, step: int, rnd: int = 0) -> int:
        """This rank's sampling seed of round ``rnd`` of ``step`` (``RankShares.seed``)."""
        return self.shares.seed(step, rnd)

    def for_worker(self, model: torch.nn.Module) -> "Collector":
        """A thread worker's collector: ``model`` (its policy copy), its own data cursor, the
        engine when it is shared (``EngineHost.for_worker``); config, task and rewards shared."""
        return replace(self, host=self.host.for_worker(model), cursor=copy.deepcopy(self.cursor))

    def for_process(self, model: torch.nn.Module) -> "Collector":
        """What a worker process is sent: ``model`` (on the CPU), no engine and no rewards (it
        builds both again: they may hold threads), its own data cursor."""
        host = replace(self.host.without_engines(), model=model)
        return replace(self, host=host, rewards=None, cursor=copy.deepcopy(self.cursor))

    def close(self) -> None:
        """Release the engine (end of the run)."""
        self.host.close()

    def generate(self, examples, seed: int, version: int | None = None) -> RolloutBatch:
        """G responses to each example through the engine (the ``episode``); under
        moe.routing_replay=rollout the experts the sampler routed to are kept (``batch.routing``)."""
        cfg, engine = self.cfg, self.host.sampler(version)
        with_logprobs = (cfg.train.old_logprobs == "rollout" or cfg.train.log_rollout_logprobs
                         or cfg.train.rollout_correction.mode != "none"
                         or engine.capabilities.always_logprobs
                         or self.keep_logprobs or cfg.rollout.quantize is not None)  # its mismatch
        replay = cfg.moe.routing_replay == "rollout"          # (an engine with a module: hf)
        measure = routing.measures_routing(engine, self.model)
        capture = replay or measure
        with moe.capture_routing(engine.module) if capture else contextlib.nullcontext() as cap, \
                self.host.gathered(engine):      # fsdp + hf: ranks may generate unequal lengths
            batch = self.episode(engine, self.tokenizer, examples, self.sampling,
                                 group_size=cfg.rollout.group_size, seed=seed,
                                 with_logprobs=with_logprobs)
        if capture:
            sampled = cap.generated_routing(batch.input_ids.shape[1])     # [N, L, layers, k]
            if replay:
                batch.routing = sampled
            if measure:
                self.routing_stats = routing.disagreement(self.model, batch, sampled)
        return batch

    def collect(self, step: int, version: int | None = None
                ) -> tuple[RolloutBatch | None, torch.Tensor, dict]:
        """Generate and score P groups; with dynamic sampling, drop zero-variance groups and refill.
        The engine sleeps once the step's generation is done."""
        self.host.sync_s = 0.0
        batch, rewards, metrics = self.collect_groups(step, version)
        if self.host.sync_s:
            metrics["time/weight_sync_s"] = self.host.sync_s
        self.host.sleep()
        if batch is not None:
            batch.version = version
        return batch, rewards, metrics

    def collect_groups(self, step: int, version: int | None = None
                       ) -> tuple[RolloutBatch | None, torch.Tensor, dict]:
        """``collect`` without the engine's sleep."""
        cfg, G, P = self.cfg, self.cfg.rollout.group_size, self.cfg.rollout.prompts_per_step
        rounds = 1 + (cfg.train.max_refill_rounds if cfg.train.dynamic_sampling else 0)
        sampled, mine = self.shares.engine_share(), self.shares.own()
        limit = len(range(P)[mine]) * G                  # this rank's rows (P·G in one process)
        kept_batches, kept_rewards, extra, first_stats = [], [], {}, None
        for rnd in range(rounds):
            examples = [self.train_set[i] for i in self.cursor.take(P)[sampled]]
            t0 = time.perf_counter()
            batch = self.generate(examples, seed=self.seed(step, rnd), version=version)
            if sampled != mine:      # a tensor-parallel group sampled its ranks' prompts together
                batch = batch.select(self.shares.own_rows(G))
            add(extra, {"time/generate_s": time.perf_counter() - t0})
            add(extra, self.engine.metrics())                                # ray/*: its syncs
            task_counts(self.task)                   # drop what was scored before (evaluation)
            rewards, per_source, counts = score(self.rewards, batch, self.device)
            add(extra, {"time/reward_s": counts["time/reward_s"]})
            add(extra, {"reward/errors": counts["reward/errors"]}, zero=0)
            add(extra, task_counts(self.task), zero=0)       # reward/scorer_errors: this batch's
            if first_stats is None:
                first_stats = reward_stats(self.task, batch, rewards, per_source, G)
                first_stats.update(getattr(self.episode, "metrics", {}))   # multiturn/*
                first_stats.update(self.routing_stats)                    # a MoE sampler copy
            if not cfg.train.dynamic_sampling:
                return batch, rewards, {**first_stats, **extra}
            keep = rewards.view(-1, G).std(-1) > 0                          # [P]
            rows = keep.repeat_interleave(G).nonzero().squeeze(-1)
            kept_batches.append(batch.select(rows.cpu()))
            kept_rewards.append(rewards[rows])
            if self.shares.shards.all(sum(len(r) for r in kept_rewards) >= limit):  # ranks refill in step
                break
        batch = concat_batches(kept_batches, self.tokenizer.pad_token_id, limit) if kept_batches else None
        rewards = torch.cat(kept_rewards)[:limit]
        extra["reward/refill_rounds"] = rnd
        if batch is None or len(rewards) == 0:
            return None, rewards, {**first_stats, **extra}
        return batch, rewards, {**first_stats, **extra}


def add(totals: dict, values: dict, zero=0.0) -> None:
    """Add ``values`` into ``totals`` key by key, from ``zero`` (a step's rounds summed)."""
    for key, value in values.items():
        totals[key] = totals.get(key, zero) + value


def concat_batches(batches: list[RolloutBatch], pad_id: int, limit: int | None = None
                   ) -> RolloutBatch:
    """Stack rollout batches of different prompt/response widths, keeping the first ``limit`` rows
    (None: all): every per-row field (``ROW_LAYOUT``), the text beside them, and the correctness
    when every batch has it.

    Prompts are re-padded on the left and responses on the right, so the layout stays
    "prompt (left-padded) + response (right-padded)" for every row. A field that some batches set
    and others not is refused, except ``dropped`` (None: no row dropped).
    """
    Lp = max(b.input_ids.shape[1] - b.response_mask.shape[1] for b in batches)
    T = max(b.response_mask.shape[1] for b in batches)

    def widen(b: RolloutBatch, x: torch.Tensor, value, layout: str) -> torch.Tensor:
        if layout == ROW:
            return x
        t = b.response_mask.shape[1]
        left = 0 if layout == RESPONSE else Lp - (b.input_ids.shape[1] - t)
        return torch.cat([x.new_full((x.shape[0], left, *x.shape[2:]), value), x,
                          x.new_full((x.shape[0], T - t, *x.shape[2:]), value)], dim=1)

    def stack(name: str) -> torch.Tensor | None:
        values = [getattr(b, name) for b in batches]
        if all(v is None for v in values):
            return None
        if name == "dropped":
            values = [torch.zeros_like(b.truncated) if v is None else v
                      for b, v in zip(batches, values)]
        if any(v is None for v in values):
            raise ValueError(f"concat_batches: {name} is set in some batches, not in others")
        value = pad_id if name == "input_ids" else 0
        return torch.cat([widen(b, v, value, ROW_LAYOUT[name])
                          for b, v in zip(batches, values)])[:limit]

    versions = {b.version for b in batches}
    if len(versions) > 1:
        raise ValueError(f"concat_batches: batches of weights versions {sorted(versions)}")
    correct = None if any(b.correct is None for b in batches) \
        else torch.cat([b.correct for b in batches])[:limit]
    return RolloutBatch(
        **{name: stack(name) for name in ROW_FIELDS},
        completions=sum((b.completions for b in batches), [])[:limit],
        examples=sum((b.examples for b in batches), [])[:limit],
        records=None if batches[0].records is None else sum((b.records for b in batches), [])[:limit],
        correct=correct, version=versions.pop(),
    )
