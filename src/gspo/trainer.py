"""The RL loop (DESIGN.md §3): rollouts -> rewards -> group advantages -> minibatch updates.

One step::

    prompts[P] --generate G each (π_old)--> responses[N = P·G] --rewards--> r[N]
      --group advantages--> Â[N] --old log-probs (recompute | rollout)--> old_logp[N, T]
      --shuffle, M minibatches--> logp = π_θ; loss = objective(...) (+ β·KL − c·H)
      --> backward, clip, AdamW step

Plumbing only: the math lives in ``objectives``, ``advantages`` and ``logprobs``; the objective
is looked up in the registry, never chosen by an ``if``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from gspo import (algorithms, correction, data, diagnostics, distributed, engines, lora, moe,
                  objectives, provenance, tasks)
from gspo.async_rollout import build_source
from gspo.audit import Recorder
from gspo.guard import Guard
from gspo.isolation import correct_all
from gspo.errors import Interrupted
from gspo.checkpoint import load_latest, remove_partial
from gspo.config import TrainConfig, dump_yaml
from gspo.evaluation import EvalResult, evaluate
from gspo.metrics import MetricsWriter, NullWriter
from gspo.models import build_model, enable_activation_checkpointing, load_model
from gspo.optim import build_optimizer, build_scheduler
from gspo.plan import UpdatePlan, live_rows, plan_update
from gspo.rewards import build_rewards
from gspo.rollout import RolloutBatch, SamplingParams, generate
from gspo.rundir import RunLock
from gspo.sft import cache_key, cached_checkpoint, save_cold_start, train_sft
from gspo.storage import write_atomic, writing
from gspo.timing import PARTS, StepTimer, breakdown

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def build_task(cfg: TrainConfig) -> tasks.Task:
    """The configured task with its data checked and its reward calls guarded (gspo.data)."""
    return data.build_task(cfg)


def initial_policy(cfg: TrainConfig, task, log=print, progress: bool = True):
    """The policy RL starts from: model.path, or a preset cold-started by SFT (cached)."""
    dtype, device = DTYPES[cfg.model.dtype], resolve_device(cfg.model.device)
    tokenizer = getattr(task, "tokenizer", None)  # the one the data was checked with (gspo.data)
    if cfg.model.path:
        model, tokenizer = load_model(cfg.model.path, dtype, tokenizer, key="model.path")
    else:
        model, tokenizer = build_model(cfg.model.preset, cfg.seed, cfg.model.overrides, dtype,
                                       tokenizer)
    info: dict = {"source": cfg.model.path or f"preset:{cfg.model.preset}"}
    if cfg.sft.enabled and cfg.sft.steps > 0:
        key = cache_key(cfg.model, cfg.task, cfg.sft, cfg.seed)
        hit = cached_checkpoint(cfg.sft.cache_dir, key)
        if hit is not None:
            log(f"cold start: reusing cached SFT checkpoint {hit}")
            model, tokenizer = load_model(hit, dtype)
            info = json.loads((hit / "sft.json").read_text())
        else:
            log(f"cold start: SFT for {cfg.sft.steps} steps on {cfg.task.name} demonstrations")
            model.to(device)
            t0 = time.time()
            history = train_sft(model, tokenizer, task.split("train"), cfg.sft, seed=cfg.seed,
                                progress=progress)
            info = {**info, "sft_steps": cfg.sft.steps, "sft_final_loss": history[-1]["sft/loss"],
                    "sft_seconds": time.time() - t0, "cache_key": key}
            with writing("the cold-start checkpoint", Path(cfg.sft.cache_dir) / key):  # disk full
                hit = save_cold_start(model, tokenizer, cfg.sft.cache_dir, key, info)
            log(f"cold start: saved {hit}")
        info["checkpoint"] = str(hit)
    return model.to(device), tokenizer, info


@dataclass
class DataCursor:
    """Position in the shuffled training prompts (epoch-seeded permutations): resumable."""
    size: int
    seed: int
    epoch: int = 0
    index: int = 0
    _order: list[int] = field(default_factory=list, repr=False)

    def _permutation(self) -> list[int]:
        order = list(range(self.size))
        random.Random(self.seed * 7919 + self.epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            if not self._order:
                self._order = self._permutation()
            if self.index >= self.size:
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation()
            take = min(n - len(out), self.size - self.index)
            out += self._order[self.index:self.index + take]
            self.index += take
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load(self, state: dict) -> None:
        self.epoch, self.index, self._order = state["epoch"], state["index"], []


def split_minibatches(n: int, m: int, generator: torch.Generator) -> list[torch.Tensor]:
    """A shuffled partition of range(n) into m nearly equal index sets."""
    return list(torch.randperm(n, generator=generator).tensor_split(min(m, n)))


class Trainer:
    """Runs ``cfg.train.steps`` RL steps and writes everything to ``cfg.run.dir``."""

    def __init__(self, cfg: TrainConfig, *, resume: bool = False, log=None):
        self.cfg = cfg
        self.run_dir = Path(cfg.run.dir)
        self.dist = distributed.current()         # rank and world under torchrun; else one process
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        if not self.dist.is_main:                 # rank 0 speaks for all
            self.log = lambda msg: None
        self.progress = cfg.run.progress and sys.stderr.isatty() and self.dist.is_main
        self.resume = resume
        self.run_lock: RunLock | None = None       # rank 0, from set-up to the end of run()
        self.algorithm = algorithms.get(cfg.objective.name)(cfg)  # group-relative | ppo | sft
        self.spec = objectives.spec(self.algorithm.objective) if self.algorithm.objective else None
        self.objective = self.spec.fn if self.spec else None     # sft: no policy loss
        self.task = build_task(cfg)
        self.train_set, self.test_set = self.task.split("train"), data.eval_examples(self.task, cfg)
        self.rewards = build_rewards([r.model_dump() for r in cfg.rewards], self.task, policy=cfg.reward)
        self.sampling = SamplingParams(cfg.rollout.max_new_tokens, cfg.rollout.temperature,
                                       cfg.rollout.top_p, cfg.rollout.top_k)
        self.sampler_engine = None                # hf engine: the policy, or its rollout.dtype copy

    # ----------------------------------------------------------------------------- set-up
    def setup(self) -> None:
        cfg = self.cfg
        self.dist.on_main(lambda: (self._claim_run_dir(), self._write_config()))
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)  # process-wide, before SFT and RL
        self._logging_s = 0.0                       # writing the last metrics row (time/logging_s)
        with self.dist.main_first():                # rank 0 fills the SFT cache, the others read it
            self.model, self.tokenizer, self.init_info = initial_policy(cfg, self.task, self.log,
                                                                        self.progress)
        self.device = next(self.model.parameters()).device
        self._prepare_policy()                      # activation checkpointing, LoRA adapters
        self.is_moe = moe.supports_moe(self.model)
        if cfg.moe.routing_replay != "none" or cfg.moe.aux_loss_coef > 0:
            moe.moe_layers(self.model)  # raises a clear ValueError for a model it cannot route
        self.ref_model = None
        if cfg.train.beta > 0:  # LoRA: the same model, adapter off (lora.reference)
            self.ref_model = self.model if lora.is_lora(self.model) else \
                copy.deepcopy(self.model).eval().requires_grad_(False)
        self.dist.wrap(self.model, cfg.dist.strategy)  # rank 0's weights everywhere; fsdp: sharded
        total = cfg.train.steps * cfg.train.minibatches
        self.optimizer = build_optimizer(self.model, cfg.train.lr, cfg.train.weight_decay)
        self.scheduler = build_scheduler(self.optimizer, cfg.train.schedule,
                                         cfg.train.warmup_steps, total)
        self.cursor = DataCursor(len(self.train_set), cfg.seed)
        self.start_step, self.history, self.wall_before = 0, {}, 0.0
        self.guard = Guard(cfg.guard, cfg.faults, list(self.scheduler.base_lrs))
        self.recorder = Recorder(cfg.audit.every, self.run_dir)
        self.metrics = (MetricsWriter(self.run_dir, cfg.run.trackers, cfg.model_dump(mode="json"))
                        if self.dist.is_main else NullWriter())
        self.algorithm.setup(self)                  # ppo: the critic, from the policy
        self.rollouts = build_source(self)          # each step's batch: collect(k), or made ahead
        if self.resume:
            self._restore()

    def current_provenance(self) -> dict:
        """What produces this run (RUN/provenance.json, gspo.provenance)."""
        return provenance.collect(self.cfg, command="train", world_size=self.dist.world,
                                  device=str(resolve_device(self.cfg.model.device)))

    def _write_config(self) -> None:
        with writing("config.yaml", self.run_dir / "config.yaml"):
            dump_yaml(self.cfg, self.run_dir / "config.yaml")
        with writing(provenance.FILE, self.run_dir / provenance.FILE):
            provenance.write(self.run_dir, self.current_provenance(), resume=self.resume)
    def _prepare_policy(self) -> None:
        """train.activation_checkpointing on the policy; model.lora: adapters over the frozen
        policy, whose weights are saved once as the adapters' base when no checkpoint holds them."""
        cfg = self.cfg
        if cfg.train.activation_checkpointing:
            enable_activation_checkpointing(self.model)
        if cfg.model.lora is None:
            return
        changed = cfg.sft.enabled and cfg.sft.steps > 0
        base, write = lora.base_checkpoint(self.run_dir, cfg.model.path, changed)
        if write:
            self.dist.on_main(lambda: lora.write_base(self.model, self.tokenizer, base))
        self.model = lora.attach(self.model, cfg.model.lora, seed=cfg.seed, base=base)
        self.init_info["lora_base"] = str(base)

    def _claim_run_dir(self) -> None:
        """Lock the folder (one writer at a time, gspo.rundir) and remove what a killed writer
        left half-written; a fresh run never mixes with an old one: refuse, or clear it when
        run.overwrite is set."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.run_lock is None or not self.run_lock.held:  # (set up twice: still ours)
            self.run_lock = RunLock.acquire(self.run_dir, log=self.log)
        remove_partial(self.run_dir)
        previous = [self.run_dir / n for n in ("metrics.jsonl", "checkpoints", "summary.json", "tb",
                                               "events.jsonl", "audit")]
        previous = [p for p in previous if p.exists()]
        if previous and not self.resume:
            if not self.cfg.run.overwrite:
                raise FileExistsError(
                    f"run.dir {self.run_dir} already holds a run: use --resume {self.run_dir} to "
                    f"continue it, run.overwrite=true to replace it, or another run.dir")
            self.log(f"run.overwrite: replacing the previous run in {self.run_dir}")
            for p in previous:
                shutil.rmtree(p) if p.is_dir() else p.unlink()

    def _restore(self) -> None:
        loaded = load_latest(self.run_dir, warn=self.log)
        if loaded is None:
            self.log(f"resume: no usable checkpoint in {self.run_dir}; starting from scratch")
            self.metrics.truncate_after(-1)  # rows of the killed attempt would be logged twice
            return
        self.load_checkpoint(loaded)
        self.guard.load_state_dict(loaded.state.get("guard"))
        self.wall_before = loaded.state.get("wall_s", 0.0)
        self.metrics.truncate_after(self.start_step)
        self.log(f"resume: restored {loaded.path} (step {self.start_step})")

    def load_checkpoint(self, loaded) -> None:
        """Weights, optimizer, scheduler, data position, step and history of a checkpoint."""
        if lora.is_lora(self.model):   # the checkpoint holds the adapter; the base is unchanged
            lora.load_adapter(self.model, loaded.path)
            weights = self.model.state_dict()
        else:
            weights = load_model(loaded.path, DTYPES[self.cfg.model.dtype])[0].state_dict()
        self.dist.load_state(self.model, self.optimizer, weights, loaded.optimizer)
        self.scheduler.load_state_dict(loaded.scheduler)
        state = loaded.state
        self.cursor.load(state["cursor"])
        self.start_step = state["step"]
        self.history = state.get("history", {})
        self.algorithm.load(loaded.path, state.get("algorithm", {}))
        self.rollouts.load(loaded.path)             # async: the weights of the batches in flight

    # ----------------------------------------------------------------------------- one step
    def collect(self, step: int) -> tuple[RolloutBatch, torch.Tensor, dict]:
        """Generate and score P groups; with dynamic sampling, drop zero-variance groups and refill."""
        cfg, G = self.cfg, self.cfg.rollout.group_size
        P = cfg.rollout.prompts_per_step
        rounds = 1 + (cfg.train.max_refill_rounds if cfg.train.dynamic_sampling else 0)
        limit = len(range(P)[self.dist.share(P)]) * G                   # this rank's rows (P·G in one process)
        kept_batches, kept_rewards, extra, first_stats = [], [], {}, None
        for rnd in range(rounds):
            examples = [self.train_set[i] for i in self.dist.shard(self.cursor.take(P))]
            t0 = time.perf_counter()
            batch = self.generate(examples, seed=self.rollout_seed(step, rnd))
            extra["time/generate_s"] = extra.get("time/generate_s", 0.0) + time.perf_counter() - t0
            t0 = time.perf_counter()
            result = self.rewards(batch.completions, batch.examples)
            extra["time/reward_s"] = extra.get("time/reward_s", 0.0) + time.perf_counter() - t0
            errors = 0 if result.errors is None else int(result.errors.sum())   # reward.on_error
            extra["reward/errors"] = extra.get("reward/errors", 0) + errors
            rewards = result.total.to(self.device)                         # [N]
            if first_stats is None:
                first_stats = self._reward_stats(batch, rewards, result.per_source)
            if not cfg.train.dynamic_sampling:
                return batch, rewards, {**first_stats, **extra}
            keep = rewards.view(-1, G).std(-1) > 0                          # [P]
            rows = keep.repeat_interleave(G).nonzero().squeeze(-1)
            kept_batches.append(batch.select(rows.cpu()))
            kept_rewards.append(rewards[rows])
            if self.dist.all(sum(len(r) for r in kept_rewards) >= limit):  # ranks refill in step
                break
        batch = _concat(kept_batches, self.tokenizer.pad_token_id, limit) if kept_batches else None
        rewards = torch.cat(kept_rewards)[:limit]
        extra["reward/refill_rounds"] = rnd
        if batch is None or len(rewards) == 0:
            return None, rewards, {**first_stats, **extra}
        return batch, rewards, {**first_stats, **extra}

    def rollout_seed(self, step: int, rnd: int = 0) -> int:
        """Sampling seed of generation round ``rnd`` of ``step`` (recorded for audits); each rank its own."""
        return self.dist.seed(self.cfg.seed * 1_000_003 + step * 101 + rnd)

    def minibatch_seed(self, step: int) -> int:
        """Seed of the minibatch split of ``step``."""
        return self.cfg.seed * 7 + step

    def generate(self, examples, seed: int) -> RolloutBatch:
        """Sample G responses per example; under rollout routing replay, keep the experts used."""
        capture = self.cfg.moe.routing_replay == "rollout"
        with moe.capture_routing(self.model) if capture else contextlib.nullcontext() as cap, \
                self.dist.full_params():      # fsdp: gathered, so ranks may generate unequal lengths
            batch = generate(self.sampler(), self.tokenizer, examples, self.sampling,
                             group_size=self.cfg.rollout.group_size,
                             with_logprobs=self.cfg.train.old_logprobs == "rollout"
                             or self.cfg.train.log_rollout_logprobs
                             or self.cfg.train.rollout_correction.mode != "none", seed=seed,
                             share_prompts=not capture)  # a capture needs all N rows per forward
        if capture:
            batch.extras["routing"] = cap.generated_routing(batch.input_ids.shape[1])  # [N, L, layers, k]
        return batch

    def sampler(self):
        """The model that samples, with the policy's current weights: the policy itself, or (rollout.dtype)
        the hf engine's copy of it in that dtype."""
        if self.sampler_engine is None:
            dtype = self.cfg.rollout.dtype
            self.sampler_engine = engines.build("hf", self.model, self.tokenizer,
                                                dtype=None if dtype == "model" else DTYPES[dtype])
        else:
            self.sampler_engine.sync_weights(self.model)
        return self.sampler_engine.model

    def routing_context(self, batch: RolloutBatch, keep_logits: bool = False):
        """Replay the batch's stored experts when configured, else just capture (MoE) or nothing."""
        if self.cfg.moe.routing_replay != "none" and "routing" in batch.extras:
            return moe.replay_routing(self.model, batch.extras["routing"], keep_logits=keep_logits)
        if self.is_moe:
            return moe.capture_routing(self.model, keep_logits=keep_logits)
        return contextlib.nullcontext()

    def _reward_stats(self, batch: RolloutBatch, rewards: torch.Tensor, per_source: dict) -> dict:
        G = self.cfg.rollout.group_size
        correct = correct_all(self.task, batch.completions, batch.examples)  # one hand-off
        batch.correct = torch.tensor(correct, dtype=torch.bool)   # [N], reused by length_slices
        rewards, lengths = rewards.cpu(), batch.lengths.cpu()     # host copies: no sync per .item()
        scored = rewards[rewards.isfinite()]  # reward.on_error=drop marks dropped samples NaN
        stats = {
            "reward/mean": scored.mean().item(), "reward/std": scored.std().item(),
            "reward/accuracy": sum(correct) / len(correct),
            "reward/frac_zero_std_groups": (rewards.view(-1, G).std(-1) == 0).float().mean().item(),
            "response/length_mean": lengths.float().mean().item(),
            "response/length_max": lengths.max().item(),
            "response/truncated_frac": batch.truncated.cpu().float().mean().item(),
        }
        if len(per_source) > 1:
            stats.update({f"reward/{k}": v.nanmean().item() for k, v in per_source.items()})
        return stats

    def _routed_logprobs(self, batch: RolloutBatch, with_entropy: bool, rows: torch.Tensor | None,
                         keep_logits: bool = False):
        """The policy's ``_logprobs`` inside ``routing_context``: (log-probs, the routing capture or
        None), the capture told which forwards ran (``layout``) so that ``cap.routing`` is laid out."""
        with self.routing_context(batch, keep_logits=keep_logits) as cap:
            out = self._logprobs(self.model, batch, with_entropy=with_entropy, rows=rows)
        if cap is not None:
            cap.layout = out.layout
        return out, cap

    def _logprobs(self, model, batch: RolloutBatch, with_entropy: bool,
                  rows: torch.Tensor | None = None):
        """``response_logprobs`` (through the FSDP root when the model is sharded). ``rows``: the
        batch's rows in the rollout batch (CPU), whose groups of G share a prompt: each prompt then
        runs once (not under fsdp, whose forwards are collectives that every rank must run alike).
        Padding columns no response token depends on are trimmed. Both only when ``split_forwards``."""
        split = self.split_forwards()
        shared = rows is not None and split and self.dist.policy is None
        groups = rows // self.cfg.rollout.group_size if shared else None
        return self.dist.logprobs(model, batch.input_ids, batch.attention_mask, batch.response_mask,
                                  temperature=self.cfg.rollout.temperature,
                                  chunk_size=self.cfg.train.logprob_chunk, with_entropy=with_entropy,
                                  entropy_grad=self.cfg.train.entropy_coef > 0, prompt_groups=groups,
                                  trim=split)

    def split_forwards(self) -> bool:
        """Whether a log-prob pass may run as a trimmed and prompt-shared set of forwards. MoE: only
        when the routing is just captured (its forwards are laid out again, ``cap.layout``), not
        replayed, nor needed in one piece for the aux loss."""
        moe_cfg = self.cfg.moe
        return not self.is_moe or (moe_cfg.routing_replay == "none" and moe_cfg.aux_loss_coef == 0)

    @torch.no_grad()
    def old_logprobs(self, batch: RolloutBatch, rows: torch.Tensor | None = None) -> torch.Tensor:
        """log π_old on the rollout batch: recomputed by the trainer, or the generator's own.

        ``rows`` (CPU indices, from the update plan): recompute only these; the others stay 0
        (filled by the first minibatch, or never read: rows without signal)."""
        if self.cfg.train.old_logprobs == "rollout":
            return batch.rollout_logp
        if "behaviour_logp" in batch.extras:  # async, stale batch: π_old of the weights that sampled it
            return batch.extras["behaviour_logp"]
        if rows is None:
            sub = batch
        elif len(rows) == 0:
            return batch.response_mask.new_zeros(batch.response_mask.shape, dtype=torch.float32)
        else:
            sub = batch.select(rows.to(batch.input_ids.device))
        out, cap = self._routed_logprobs(sub, with_entropy=False, rows=rows)
        logp = out.logp  # [n, T]
        if self.is_moe and "routing" not in batch.extras:
            self._store_routing(batch, rows, cap.routing)  # π_old's experts [N, L, layers, k]
        if rows is None:
            return logp
        return logp.new_zeros(batch.response_mask.shape).index_copy_(0, rows.to(logp.device), logp)

    @staticmethod
    def _store_routing(batch: RolloutBatch, rows: torch.Tensor | None, routing: torch.Tensor) -> None:
        """Put the experts of ``rows`` (None: all) into batch.extras["routing"] [N, L, layers, k]."""
        if rows is None:
            batch.extras["routing"] = routing
            return
        if "routing" not in batch.extras:
            batch.extras["routing"] = routing.new_zeros((len(batch.completions), *routing.shape[1:]))
        batch.extras["routing"][rows.to(routing.device)] = routing

    def objective_kwargs(self, T: int) -> dict:
        o = self.cfg.objective
        kwargs = {k: v for k, v in (("eps_low", o.eps_low), ("eps_high", o.eps_high),
                                    ("aggregation", o.aggregation)) if v is not None}
        return {**kwargs, **o.params, "token_sum_norm": float(self.cfg.rollout.max_new_tokens)}

    def token_aggregation(self) -> str:
        """How per-token extras (KL, entropy) are reduced: like the objective, seq-mean -> token mean."""
        mode = self.cfg.objective.aggregation or self.spec.defaults.get("aggregation", "seq-mean")
        return "seq-mean-token-mean" if mode == "seq-mean" else mode

    def loss_mask(self, batch: RolloutBatch) -> torch.Tensor:
        """[N, T] the response tokens that enter the loss."""
        mask = batch.response_mask
        if self.cfg.train.mask_truncated:
            mask = mask * (~batch.truncated).float().unsqueeze(-1)              # [N, T]
        if "dropped" in batch.extras:  # reward.on_error=drop: failed samples leave the loss
            mask = mask * (~batch.extras["dropped"]).float().unsqueeze(-1)      # [N, T]
        if "correction_mask" in batch.extras:  # train.rollout_correction: masked tokens leave it
            mask = mask * batch.extras["correction_mask"]                       # [N, T]
        return mask

    def plan(self, batch: RolloutBatch, advantages: torch.Tensor, step: int,
             optimize: bool = True) -> UpdatePlan:
        """This step's minibatches and the rows needing a forward (gspo.plan); ``optimize=False``:
        every row, π_old of every row from the old-log-prob pass."""
        cfg = self.cfg
        gen = torch.Generator().manual_seed(self.minibatch_seed(step))
        minibatches = self.dist.minibatch_rows(len(advantages), cfg.train.minibatches, gen)  # this rank's
        if not optimize or self.dist.policy is not None:  # fsdp: forwards are collectives, none skipped
            return plan_update(minibatches, None, reuse_first=False)
        skip = (cfg.train.skip_zero_advantage and self.spec.zero_at_zero_advantage  # objective allows it
                and self.ref_model is None and cfg.train.entropy_coef == 0
                and cfg.moe.aux_loss_coef == 0 and not self.recorder.due(step))
        live = live_rows(advantages.cpu(), self.loss_mask(batch).cpu()) if skip else None  # [N]
        reuse = (cfg.train.old_logprobs == "recompute" and batch.rollout_logp is None
                 and cfg.moe.routing_replay != "old" and "behaviour_logp" not in batch.extras)
        return plan_update(minibatches, live, reuse_first=reuse)

    def update(self, batch: RolloutBatch, advantages: torch.Tensor, old_logp: torch.Tensor,
               step: int, record: dict | None = None, plan: UpdatePlan | None = None,
               timer: StepTimer | None = None) -> dict:
        """M minibatch updates on one rollout batch; returns metrics averaged over minibatches.

        ``record`` (optional) receives the loss mask, each row's log-probs as trained on, its
        minibatch and the objective's minibatch losses (length slices, audit records).
        ``plan`` (``self.plan``; default: every row, no reuse) may have the first minibatch write
        its own rows of ``old_logp`` (in place); ``timer`` gets forward_backward and optimizer."""
        cfg = self.cfg
        mask = self.loss_mask(batch)                                           # [N, T]
        plan = plan or self.plan(batch, advantages, step, optimize=False)
        timer = timer or StepTimer(self.device)
        ref_logp = None
        if self.ref_model is not None:
            with torch.no_grad(), lora.reference(self.ref_model):
                ref_logp = self._logprobs(self.ref_model, batch, with_entropy=False).logp
        kwargs, agg = self.objective_kwargs(mask.shape[1]), self.token_aggregation()
        collected: dict[str, list[torch.Tensor]] = {}
        skipped_nonfinite = 0
        if record is not None:
            diagnostics.new_record(record, mask)
        self.model.train()
        for i, (idx, pos) in enumerate(zip(plan.minibatches, plan.trained)):
            with timer.section("forward_backward"):
                cpu_idx, idx, live = idx, idx.to(self.device), len(idx) > 0
                if not live:  # no row of minibatch i on this rank: a masked-out row keeps ranks in step
                    idx, pos = idx.new_zeros(1), pos.new_zeros(1)
                loss_mask = mask if live else torch.zeros_like(mask)
                total, stats = self._minibatch_loss(batch, idx, pos, loss_mask, advantages, old_logp,
                                                    ref_logp, fill_old=i == 0 and plan.reuse_first and live,
                                                    record=record if live else None, kwargs=kwargs, agg=agg,
                                                    cpu_idx=cpu_idx if live else None)
                partial = len(pos) < len(idx)  # skipped rows: what they alone reach gets a zero gradient
                self.optimizer.zero_grad(set_to_none=not partial)   # (zeroed buffers are kept)
                if total.requires_grad:   # False when no row of the minibatch has a signal
                    total.backward()
                if partial:
                    for p in self.model.parameters():
                        if p.requires_grad and p.grad is None:
                            p.grad = torch.zeros_like(p)
                total = self.dist.sync_grads(self.model, total)  # ranks: Σ_r ∇L_r = ∇L, the global loss
            with timer.section("optimizer"):
                grad_norm = self.dist.clip_grad_norm(self.model.parameters(), cfg.train.grad_clip)
                stats["optim/grad_norm"] = grad_norm.detach()
                if bool(torch.isfinite(total.detach()) & torch.isfinite(grad_norm)):  # a sync per minibatch
                    self.optimizer.step()
                else:  # a NaN/Inf loss or gradient is never applied: skip this update, counted
                    self.optimizer.zero_grad(set_to_none=True)
                    skipped_nonfinite += 1
                self.scheduler.step()
            stats = self.dist.reduce_stats(stats, loss_mask[idx], self.spec.sequence_level)  # over ranks
            for k, v in stats.items():
                collected.setdefault(k, []).append(v.float())
        # one host sync per step: stack every metric, then move to Python floats together
        keys = list(collected)
        values = torch.stack([torch.stack(collected[k]).mean() for k in keys]).tolist()
        metrics = dict(zip(keys, values))
        metrics["optim/lr"] = self.scheduler.get_last_lr()[0]
        metrics["optim/skipped_nonfinite"] = skipped_nonfinite
        metrics.update(self.dist.reduce_metrics({"train/rows_skipped": plan.skipped}, 1))  # ranks: sum
        return metrics

    def _minibatch_loss(self, batch: RolloutBatch, idx: torch.Tensor, pos: torch.Tensor,
                        mask: torch.Tensor, advantages: torch.Tensor, old_logp: torch.Tensor,
                        ref_logp: torch.Tensor | None, *, fill_old: bool, record: dict | None,
                        kwargs: dict, agg: str, cpu_idx: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, dict]:
        """Forward of the rows ``idx[pos]`` of minibatch ``idx``; the loss over all of ``idx`` (rows
        left out enter with log π_θ = log π_old: ratio 1, Â = 0, loss 0) and detached stats.
        ``cpu_idx``: ``idx`` on the host, to run each prompt once (``_logprobs``)."""
        cfg, aux_coef = self.cfg, self.cfg.moe.aux_loss_coef
        whole = len(pos) == len(idx)
        cpu_rows = None if cpu_idx is None else cpu_idx[pos]
        pos = pos.to(idx.device)
        rows = idx if whole else idx[pos]
        mb, mb_mask = batch.select(rows), mask[idx]
        counts = self.dist.global_counts(mb_mask)   # ranks: normalisers over all ranks ({} in one process)
        out = cap = None
        if len(rows):
            out, cap = self._routed_logprobs(mb, with_entropy=True, rows=cpu_rows,
                                             keep_logits=aux_coef > 0)  # [n, T]
        if fill_old and out is not None:  # before the first optimizer step π_θ = π_old, bit for bit
            old_logp[rows] = out.logp.detach()
            if self.is_moe and cfg.moe.routing_replay == "none":
                self._store_routing(batch, rows, cap.routing)
                mb.extras["routing"] = cap.routing
        if out is None:
            logp = old_logp[idx]                                                # [m, T]
        else:
            logp = out.logp if whole else old_logp[idx].index_copy(0, pos, out.logp)  # [m, T]
        loss, stats = self.objective(logp, old_logp[idx], advantages[idx], mb_mask, **kwargs, **counts)
        if record is not None:
            diagnostics.record_minibatch(record, idx, logp, loss)
        stats = {f"policy/{k}": v for k, v in stats.items()}
        if self.is_moe and out is not None:
            stats.update(self._routing_stats(mb, cap))
            if aux_coef > 0:
                aux = moe.router_aux_loss(self.model, cap.router_logits(), mb.attention_mask)
                loss = loss + aux_coef * aux * self.dist.token_share(mb_mask, counts)
                stats["moe/aux_loss"] = aux.detach()
        stats["policy/loss"] = loss.detach()
        if out is not None:   # entropy of the rows trained on
            stats["policy/entropy"] = objectives.aggregate(out.entropy.detach(), mask[rows], agg)
        total = loss
        if ref_logp is not None:  # (the plan trains every row when beta > 0 or entropy_coef > 0)
            kl = objectives.aggregate(objectives.kl_k3(logp, ref_logp[idx]), mb_mask, agg, **counts)
            total = total + cfg.train.beta * kl
            stats["policy/kl_ref"] = kl.detach()
        if cfg.train.entropy_coef > 0:
            total = total - cfg.train.entropy_coef * objectives.aggregate(out.entropy, mb_mask, agg,
                                                                          **counts)
        return total, stats

    def _routing_stats(self, mb: RolloutBatch, cap) -> dict:
        """Expert load of this minibatch and the share of (token, layer) whose top-k moved since π_old."""
        T = mb.response_mask.shape[1]
        old = mb.extras.get("routing")
        return moe.routing_metrics(moe.response_routing(cap.routing, T), mb.response_mask,
                                   cap.num_experts,
                                   old=None if old is None else moe.response_routing(old, T))

    def step(self, step: int) -> dict:
        t_start, timer = time.perf_counter(), StepTimer(self.device)
        batch, rewards, metrics = self.rollouts.batch(step)          # collect(step), or made ahead
        metrics = self.dist.reduce_metrics(metrics, len(rewards))     # ranks: one set of numbers
        if self.dist.any(batch is None):
            return {**metrics, "step": step + 1, "train/skipped": 1.0}
        G = self.cfg.rollout.group_size
        if self.algorithm.objective is None:    # sft: demonstrations instead of a policy-gradient update
            return {"step": step + 1, **metrics, **self.algorithm.update(batch, rewards, step)}
        advantages = self.algorithm.advantages(batch, rewards)  # [N] group (on_error=drop) | [N, T] ppo
        if self.cfg.advantage.scale == "batch":                       # ranks: the std of all rewards
            advantages = self.dist.batch_advantages(rewards, G, eps=self.cfg.advantage.eps,
                                                    local=advantages)
        plan = self.plan(batch, advantages, step)
        if batch.rollout_logp is not None:        # the mismatch metrics read every row's π_old
            plan.old_rows = None
        with timer.section("old_logprobs"):
            old_logp = self.old_logprobs(batch, rows=plan.old_rows)               # [N, T]
        if batch.rollout_logp is not None:
            metrics.update(self.dist.reduce_metrics(self._mismatch(batch, old_logp), len(rewards)))
        if batch.rollout_logp is not None and self.cfg.train.old_logprobs == "recompute":
            advantages, stats = self.correct_rollout(batch, advantages, old_logp)
            metrics.update(self.dist.reduce_metrics(stats, len(rewards)))
        t0 = time.perf_counter()
        record: dict = {}
        self.recorder.begin(self, step)                                           # π_old, if audited
        metrics.update(self.update(batch, advantages, old_logp, step, record=record, plan=plan,
                                   timer=timer))
        metrics.update(self.algorithm.update(batch, rewards, step))              # ppo: the critic
        metrics["time/train_s"] = time.perf_counter() - t0
        metrics.update(self.dist.reduce_metrics(
            self.length_slices(batch, rewards, advantages, old_logp, record), len(rewards)))
        self.recorder.finish(self, step, batch, rewards, advantages, old_logp, record, metrics)
        parts = {**timer.seconds(), "generate": metrics["time/generate_s"],
                 "reward": metrics["time/reward_s"]}
        metrics.update(breakdown(parts, time.perf_counter() - t_start))
        return {"step": step + 1, **metrics}

    def length_slices(self, batch: RolloutBatch, rewards: torch.Tensor, advantages: torch.Tensor,
                      old_logp: torch.Tensor, record: dict) -> dict:
        """Reward, accuracy, clip fraction and ratio per response-length bucket (length/*)."""
        n = self.cfg.monitor.length_buckets
        if not n:
            return {}
        correct = batch.correct if batch.correct is not None else torch.tensor(
            correct_all(self.task, batch.completions, batch.examples))
        return diagnostics.length_slices(
            batch.lengths.cpu(), rewards.cpu(), correct, record["logp"], old_logp, advantages,
            record["mask"], objective=self.objective, objective_kwargs=self.objective_kwargs(0),
            buckets=diagnostics.length_buckets(self.cfg.rollout.max_new_tokens, n))

    def _mismatch(self, batch: RolloutBatch, old_logp: torch.Tensor) -> dict:
        """Generator vs trainer log-probs (only when the generator's exist)."""
        if self.cfg.train.old_logprobs == "rollout":
            with torch.no_grad():
                trainer_logp = self._logprobs(self.model, batch, with_entropy=False).logp
        else:
            trainer_logp = old_logp
        return diagnostics.logprob_mismatch(batch.rollout_logp, trainer_logp, batch.response_mask)

    def correct_rollout(self, batch: RolloutBatch, advantages: torch.Tensor,
                        old_logp: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """train.rollout_correction: its mask joins the loss mask (batch.extras), its weight scales
        the advantages (gspo.correction.weighted_advantages); mismatch/* stats (mode none: only these)."""
        cfg = self.cfg.train.rollout_correction
        mask = self.loss_mask(batch)                                               # [N, T]
        out = correction.spec(cfg.mode).fn(old_logp, batch.rollout_logp, mask, **cfg.params())
        values = torch.stack(list(out.stats.values())).tolist()
        stats = {f"mismatch/{k}": v for k, v in zip(out.stats, values)}
        if cfg.mode == "none":
            return advantages, stats
        batch.extras["correction_mask"] = out.mask.to(mask.dtype)                 # [N, T]
        advantages = correction.weighted_advantages(advantages, out.weight, mask,
                                                    per_row=self.spec.sequence_level)
        return advantages, stats

    # ----------------------------------------------------------------------------- eval, save
    def evaluate(self) -> EvalResult:
        """Held-out evaluation (under torchrun: on rank 0, its result sent to every rank)."""
        e = self.cfg.eval
        with self.dist.full_params(), self.rollouts.rng_lock:  # async: not while the worker samples
            return self.dist.on_main(lambda: evaluate(
                self.model, self.tokenizer, self.task, self.test_set,
                max_new_tokens=self.cfg.rollout.max_new_tokens, k=e.k,
                temperature=e.temperature, batch_size=e.batch_size, seed=self.cfg.seed))

    def save(self, step: int, wall: float) -> Path:
        self.metrics.flush()                    # TensorBoard as far as the checkpoint
        state = {"cursor": self.cursor.state(), "history": self.history, "wall_s": wall,
                 "objective": self.cfg.objective.name, "init": self.init_info,
                 "guard": self.guard.state_dict(), "algorithm": self.algorithm.state_dict()}
        return self.dist.save_checkpoint(self.run_dir, step, self.model, self.tokenizer,  # rank 0
                                         self.optimizer, self.scheduler, state,
                                         keep=self.cfg.run.keep_checkpoints,
                                         extra=lambda folder: (self.algorithm.save(folder),  # ppo: critic
                                                               self.rollouts.save(folder, step)))

    # ----------------------------------------------------------------------------- the loop
    def wall(self) -> float:
        """Seconds of training so far, over all resumed sessions."""
        return self.wall_before + time.time() - self.t_start

    def stop_if_requested(self, done: int) -> None:
        """Between steps: after SIGINT/SIGTERM (``self.stop``, a gspo.signals.GracefulStop set by
        the CLI), save a checkpoint of the ``done`` steps, then raise Interrupted."""
        stop = getattr(self, "stop", None)
        if stop is None or not self.dist.any(stop.signum is not None):  # ranks stop together
            return
        signum = stop.signum or signal.SIGTERM
        raise Interrupted(signum, done, self.save(done, self.wall()), self.run_dir)

    def run(self) -> dict:
        """Set up, train, save, evaluate; the run folder's lock is released however it ends."""
        try:
            return self._run()
        finally:
            if getattr(self, "rollouts", None) is not None:  # (set-up may have failed before it)
                self.rollouts.close()                        # async: the worker stopped and joined
            self.release()

    def release(self) -> None:
        """Let another process write this run (a process that ends releases it anyway)."""
        if self.run_lock is not None:
            self.run_lock.release()

    def _run(self) -> dict:
        self.setup()
        cfg, t_start = self.cfg, time.time()
        self.t_start = t_start
        if "eval_before" not in self.history:
            result = self.evaluate()
            self.history["eval_before"] = result.as_dict()
            self.metrics.write({"step": 0, **result.as_metrics()})
            self.log(f"held-out before RL: accuracy {result.accuracy:.3f}  pass@1 {result.pass1:.3f}")
        bar = tqdm(desc=f"{cfg.objective.name}", initial=self.start_step, total=cfg.train.steps,
                   disable=not self.progress, dynamic_ncols=True)
        last_acc = self.history["eval_before"]["accuracy"]
        self.guard.on_start(self)
        step = self.start_step
        self.stop_if_requested(step)
        while step < cfg.train.steps:
            t_iter = time.perf_counter()
            self.guard.before_step(self, step)
            row = self.step(step)
            back = self.guard.after_step(self, row)     # skip restores; pause raises GuardPause
            if back is not None:                        # rolled back to the checkpoint of step back
                step = bar.n = back
                continue
            self.rollouts.publish(row["step"])          # async: these weights to the worker
            self.time_iteration(row, t_iter)
            done = row["step"]
            if (cfg.run.eval_every and done % cfg.run.eval_every == 0) or done == cfg.train.steps:
                result = self.evaluate()
                row.update(result.as_metrics())
                last_acc = result.accuracy
                self.history["eval_last"] = result.as_dict()
            self.log_row(row)
            bar.set_postfix(reward=f"{row.get('reward/mean', float('nan')):.2f}",
                            acc=f"{last_acc:.2f}",
                            clip=f"{row.get('policy/clip_frac_tokens', float('nan')):.3f}")
            if not self.progress and (done % 10 == 0 or done == cfg.train.steps):
                self.log(f"step {done}/{cfg.train.steps} reward {row.get('reward/mean', 0):.3f} "
                         f"held-out acc {last_acc:.3f} clip {row.get('policy/clip_frac_tokens', 0):.4f}")
            if cfg.run.save_every and done % cfg.run.save_every == 0 and done < cfg.train.steps:
                self.save(done, self.wall_before + time.time() - t_start)
            self.stop_if_requested(done)
            step += 1
            bar.update(1)
        bar.close()
        wall = self.wall_before + time.time() - t_start
        final = self.save(cfg.train.steps, wall)
        self.metrics.close()
        return self.finish(final, wall)

    def time_iteration(self, row: dict, t_iter: float) -> None:
        """Make time/step_s the whole loop iteration from ``t_iter``: guard hooks, the step, and
        writing the previous row (time/logging_s); eval and checkpoints (periodic) are left out."""
        if "time/step_s" not in row:                   # no update this step
            return
        parts = {p: row.get(f"time/{p}_s", 0.0) for p in PARTS if p != "other"}
        parts["logging"] = self._logging_s
        row.update(breakdown(parts, time.perf_counter() - t_iter + self._logging_s))

    def log_row(self, row: dict) -> None:
        """Write a metrics row (JSONL + TensorBoard), timed for the next row's time/logging_s."""
        t0 = time.perf_counter()
        self.metrics.write(row)
        self._logging_s = time.perf_counter() - t0

    def finish(self, final: Path, wall: float) -> dict:
        after = self.history.get("eval_last") or self.history["eval_before"]
        summary = {
            "objective": self.cfg.objective.name, "task": self.cfg.task.name, "seed": self.cfg.seed,
            "steps": self.cfg.train.steps, "wall_s": round(wall, 1), "eval_split": self.cfg.eval.split,
            "eval_before": self.history["eval_before"], "eval_after": after,
            "accuracy_gain": after["accuracy"] - self.history["eval_before"]["accuracy"],
            "cold_start": self.init_info, "final_checkpoint": str(final),
            "data": getattr(self.task, "data_report", None),  # examples skipped (data.on_error)
        }
        if self.dist.is_main:
            with writing("summary.json", self.run_dir / "summary.json"):
                write_atomic(self.run_dir / "summary.json", json.dumps(summary, indent=1))
        return summary


def _concat(batches: list[RolloutBatch], pad_id: int, limit: int) -> RolloutBatch:
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
        rollout_logp=None if batches[0].rollout_logp is None
        else stack(lambda b: b.rollout_logp, 0.0, response_only=True),
        extras={key: stack(lambda b, k=key: b.extras[k], 0) for key in batches[0].extras},
    )
