"""One RL step, top to bottom, as the GSPO paper's algorithm reads::

    prompts[P] --generate G each (π_old)--> responses[N = P·G] --rewards--> r[N]
      --group advantages--> Â[N] --old log-probs (recompute | rollout)--> old_logp[N, T]
      --shuffle, M minibatches--> logp = π_θ; loss = objective(...) (+ β·KL − c·H)
      --> backward, clip, AdamW step

``RLStep.__call__`` is that sequence; ``RLStep.update`` the minibatch loop. What is not the
algorithm sits behind small collaborators, each with a narrow interface:

* ``Collect`` (gspo.rollout.collect.Collector): sampling and scoring, dynamic sampling;
* ``Algorithm`` (gspo.training.algorithms): the advantages, and what else trains (PPO's critic);
* ``LogprobPasses`` (gspo.training.passes): the speed paths (rows without signal, the on-policy
  first minibatch, shared prompts) and MoE routing capture / replay;
* ``Ranks`` (gspo.training.distributed.Dist): global normalisers, gradient sums, metric reduction;
* ``Audit`` (gspo.observe.records.Recorder): the audit record of a step.

The math lives in ``gspo.core``: the objective is looked up in the registry, never chosen by an
``if``. The stability guard's snapshot and checks wrap the step in the loop (gspo.training.trainer).
Shapes: N rows, T response positions, M minibatches, m rows of a minibatch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
from torch import Tensor

from gspo.config import TrainConfig
from gspo.core import correction, objectives
from gspo.core.plan import UpdatePlan, live_rows, plan_update
from gspo.observe import diagnostics
from gspo.observe.records import UpdateRecord
from gspo.observe.timing import StepTimer, breakdown
from gspo.rewards.isolation import correct_all
from gspo.rollout.collect import loss_mask, mark_dropped, minibatch_seed
from gspo.rollout.generate import RolloutBatch
from gspo.training import lora
from gspo.training.algorithms import Algorithm
from gspo.training.passes import LogprobPasses, Minibatch, MinibatchForward
from gspo.training.proximal import LateProximal


class Collect(Protocol):
    """Sampling and scoring of a step's batch (gspo.rollout.collect.Collector)."""

    def collect(self, step: int) -> tuple[RolloutBatch | None, Tensor, dict]: ...
    def seed(self, step: int, rnd: int = 0) -> int: ...
    def proximal(self, step: int) -> Callable | None:
        """rollout.async_ratio=decoupled, a stale batch: a call that waits for π_prox of its later
        minibatches (gspo.training.proximal); None: π_old is computed here."""


class Ranks(Protocol):
    """What the step asks of the ranks (gspo.training.distributed.Dist; one process: identity)."""

    policy: object
    """The FSDP root when the model is sharded (every forward a collective), else None."""

    def any(self, flag: bool) -> bool: ...
    def minibatch_rows(self, n: int, m: int, generator: torch.Generator,
                       group_size: int = 1) -> list[Tensor]: ...
    def global_counts(self, mask: Tensor) -> dict[str, Tensor]: ...
    def token_share(self, mask: Tensor, counts: dict) -> Tensor | float: ...
    def sync_grads(self, model: torch.nn.Module, loss: Tensor) -> Tensor: ...
    def clip_grad_norm(self, params, max_norm: float) -> Tensor: ...
    def reduce_stats(self, stats: dict, mask: Tensor, sequence_level: bool) -> dict: ...
    def reduce_metrics(self, metrics: dict, weight: float) -> dict: ...


class Audit(Protocol):
    """The audit record of a step (gspo.observe.records.Recorder)."""

    def due(self, step: int) -> bool: ...
    def begin(self, step: int) -> None: ...
    def finish(self, step: int, batch: RolloutBatch, rewards: Tensor, advantages: Tensor,
               old_logp: Tensor, record: UpdateRecord, metrics: dict, *,
               new_logprobs: Callable, seeds: dict) -> None: ...


@dataclass
class RLStep:
    """Runs RL step ``step`` (0-based) on the policy and returns its metrics row."""
    cfg: TrainConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    collector: Collect
    algorithm: Algorithm
    passes: LogprobPasses
    ranks: Ranks
    audit: Audit
    task: object                                   # is_correct, for the length slices
    ref_model: torch.nn.Module | None = None       # frozen π_ref when train.beta > 0
    objective: Callable | None = field(init=False)
    """The policy loss from the registry (None: sft, no policy-gradient update)."""

    def __post_init__(self):
        name = self.algorithm.objective
        self.spec = objectives.spec(name) if name else None
        self.objective = self.spec.fn if self.spec else None
        self.objective_kwargs = self.cfg.objective_kwargs()
        self.aggregation = self.cfg.token_aggregation()
        self.device = next(self.model.parameters()).device
        self.skips_rows = skips_rows(self.cfg, self.algorithm.objective, self.ref_model)

    def __call__(self, step: int) -> dict:
        t_start, timer = time.perf_counter(), StepTimer(self.device)
        # 1. generate G responses to each of P prompts with π_old and score them
        batch, rewards, metrics = self.collector.collect(step)
        metrics = self.ranks.reduce_metrics(metrics, len(rewards))      # ranks: one set of numbers
        if self.ranks.any(batch is None):
            return {**metrics, "step": step + 1, "train/skipped": 1.0}
        if self.objective is None:   # sft, dpo: their own update instead of a policy gradient
            return {"step": step + 1, **metrics, **self.algorithm.update(batch, rewards, step)}
        # 2. advantages: group-relative [N] (ppo: GAE [N, T]); dropped samples leave the loss
        mark_dropped(batch, rewards)
        advantages = self.algorithm.advantages(batch, rewards)
        # 3. π_old's log-probs [N, T] of the rows the update plan needs
        fetch = self.collector.proximal(step)   # async, decoupled: π_prox arrives during the update
        plan = self.plan(batch, advantages, step, late=fetch is not None)
        if fetch is not None:          # minibatch 1 makes its own rows', the worker the others'
            old_logp = torch.zeros_like(batch.response_mask, dtype=torch.float32)       # [N, T]
        else:
            # the sampler's log-probs: mismatch and correction read every row (named, so that
            # each prompt is forwarded once, as in the plan's own rows)
            rows = torch.arange(len(advantages)) if batch.rollout_logp is not None else plan.old_rows
            with timer.section("old_logprobs"):
                old_logp = self.old_logprobs(batch, rows)
            if batch.rollout_logp is not None:
                metrics.update(self.ranks.reduce_metrics(self.mismatch(batch, old_logp), len(rewards)))
            if batch.rollout_logp is not None and self.cfg.train.old_logprobs == "recompute":
                advantages, stats = self.correct_rollout(batch, advantages, old_logp)  # vs sampler
                metrics.update(self.ranks.reduce_metrics(stats, len(rewards)))
        # 4. M minibatch updates of the policy, then what else the algorithm trains (ppo: critic)
        t0 = time.perf_counter()
        self.audit.begin(step)                                          # π_old, if audited
        record = UpdateRecord.start(loss_mask(batch, self.cfg.train.mask_truncated))
        late = None if fetch is None else self.late_proximal(fetch, batch, advantages, record.mask,
                                                             plan.old_rows)
        metrics.update(self.update(batch, advantages, old_logp, plan, record, timer, late))
        metrics.update(self.algorithm.update(batch, rewards, step))
        metrics["time/train_s"] = time.perf_counter() - t0
        if late is not None:           # π_prox vs π_v over the rows trained on; the weighted Â
            late.fill(old_logp)                               # (M = 1: nothing waited for it)
            metrics.update(late.metrics(old_logp, batch.response_mask, trained_rows(plan)))
            advantages = late.advantages
        # 5. diagnostics and the audit record
        metrics.update(self.ranks.reduce_metrics(
            self.length_slices(batch, rewards, advantages, old_logp, record), len(rewards)))
        self.audit.finish(step, batch, rewards, advantages, old_logp, record, metrics,
                          new_logprobs=self.passes.new_logprobs,
                          seeds={"generation": self.collector.seed(step, 0),
                                 "dynamic_sampling": self.cfg.train.dynamic_sampling,
                                 "minibatch": minibatch_seed(self.cfg.seed, step)})
        parts = {**timer.seconds(), "generate": metrics["time/generate_s"],
                 "reward": metrics["time/reward_s"]}
        metrics.update(breakdown(parts, time.perf_counter() - t_start))
        return {"step": step + 1, **metrics}

    def update(self, batch: RolloutBatch, advantages: Tensor, old_logp: Tensor, plan: UpdatePlan,
               record: UpdateRecord | None = None, timer: StepTimer | None = None,
               late: LateProximal | None = None) -> dict:
        """M minibatch updates on one rollout batch (``plan``): log-probs, objective, backward,
        clip, step. Metrics averaged over minibatches; ``record`` (its mask: the loss mask) gets
        what each row trained on. The plan may have the first minibatch write its rows of
        ``old_logp`` (in place). ``late``: the later minibatches' π_old arrives before minibatch
        2, and each minibatch's rows are corrected (advantages, mask) once their π_old is in."""
        record = record or UpdateRecord.start(loss_mask(batch, self.cfg.train.mask_truncated))
        timer = timer or StepTimer(self.device)
        ref_logp = self.reference_logprobs(batch)                       # [N, T] or None
        collected: dict[str, list[Tensor]] = {}
        nonfinite = 0
        self.model.train()
        for i, mb in enumerate(minibatches(plan, record.mask, self.device)):
            with timer.section("forward_backward"):
                if late is not None and i == 1:
                    late.fill(old_logp)          # made by the worker while minibatch 1 ran
                counts = self.ranks.global_counts(mb.mask[mb.idx])   # normalisers over all ranks
                fwd = self.passes.minibatch(batch, mb, old_logp,
                                            fill_old=i == 0 and plan.reuse_first and mb.live)
                if late is not None and mb.live:   # (one process: counts are {}, unaffected)
                    late.correct(mb.idx[mb.pos.to(mb.idx.device)], old_logp, record.mask)
                adv = advantages if late is None else late.advantages
                loss, stats = self.objective(fwd.logp, old_logp[mb.idx], adv[mb.idx],
                                             mb.mask[mb.idx], **self.objective_kwargs, **counts)
                if mb.live:
                    record.add(mb.idx, fwd.logp, loss)
                total, stats = self.regularised(loss, stats, fwd, mb, counts, ref_logp)
                self.backward(total, mb.partial)
                total = self.ranks.sync_grads(self.model, total)  # Σ_r ∇L_r = ∇L, the global loss
            with timer.section("optimizer"):
                grad_norm = self.ranks.clip_grad_norm(self.model.parameters(),
                                                      self.cfg.train.grad_clip)
                stats["optim/grad_norm"] = grad_norm.detach()
                if bool(torch.isfinite(total.detach()) & torch.isfinite(grad_norm)):  # one sync
                    self.optimizer.step()
                else:  # a NaN/Inf loss or gradient is never applied: skip this update, counted
                    self.optimizer.zero_grad(set_to_none=True)
                    nonfinite += 1
                self.scheduler.step()
            stats = self.ranks.reduce_stats(stats, mb.mask[mb.idx], self.spec.sequence_level)
            for k, v in stats.items():
                collected.setdefault(k, []).append(v.float())
        # one host sync per step: stack every metric, then move to Python floats together
        keys = list(collected)
        values = torch.stack([torch.stack(collected[k]).mean() for k in keys]).tolist()
        return {**dict(zip(keys, values)), "optim/lr": self.scheduler.get_last_lr()[0],
                "optim/skipped_nonfinite": nonfinite,
                **self.ranks.reduce_metrics({"train/rows_skipped": plan.skipped}, 1)}  # ranks: sum

    # ----------------------------------------------------------------------------- its parts
    def plan(self, batch: RolloutBatch, advantages: Tensor, step: int,
             optimize: bool = True, late: bool = False) -> UpdatePlan:
        """This step's minibatches and the rows needing a forward (gspo.core.plan); ``optimize=False``:
        every row, π_old of every row from the old-log-prob pass. ``late``: π_old is π_prox, the
        trainer's own weights (so the first minibatch's forward is its π_old), the rest arriving."""
        cfg = self.cfg
        gen = torch.Generator().manual_seed(minibatch_seed(cfg.seed, step))
        minibatches = self.ranks.minibatch_rows(len(advantages), cfg.train.minibatches, gen,
                                                cfg.minibatch_unit)                       # this rank's
        if not optimize or self.ranks.policy is not None:  # fsdp: forwards are collectives, none skipped
            return plan_update(minibatches, None, reuse_first=False)
        skip = self.skips_rows and not self.audit.due(step)
        mask = loss_mask(batch, cfg.train.mask_truncated)
        live = live_rows(advantages.cpu(), mask.cpu()) if skip else None                  # [N]
        reuse = late or (cfg.train.old_logprobs == "recompute" and batch.rollout_logp is None
                         and cfg.moe.routing_replay != "old" and "behaviour_logp" not in batch.extras)
        return plan_update(minibatches, live, reuse_first=reuse)

    def old_logprobs(self, batch: RolloutBatch, rows: Tensor | None = None) -> Tensor:
        """[N, T] log π_old: the generator's own (train.old_logprobs=rollout), or recomputed for
        ``rows`` (CPU; None: all, the others stay 0 until the first minibatch fills them)."""
        if self.cfg.train.old_logprobs == "rollout":
            return batch.rollout_logp
        if "behaviour_logp" in batch.extras:  # async, stale batch: π_old of the weights that sampled it
            return batch.extras["behaviour_logp"]
        return self.passes.old_logprobs(batch, rows)

    def late_proximal(self, fetch: Callable, batch: RolloutBatch, advantages: Tensor,
                      mask: Tensor, needed: Tensor | None) -> LateProximal:
        """The decoupled ratio's π_prox arriving from the worker (``needed``: the rows the plan
        reads, checked against what it sends), corrected per minibatch."""
        cfg = self.cfg.train.rollout_correction
        return LateProximal(fetch, batch.rollout_logp, advantages, mask, needed, mode=cfg.mode,
                            params=cfg.params(), per_row=self.spec.sequence_level)

    @torch.no_grad()
    def reference_logprobs(self, batch: RolloutBatch) -> Tensor | None:
        """[N, T] log π_ref for the KL penalty (train.beta > 0), else None."""
        if self.ref_model is None:
            return None
        with lora.reference(self.ref_model):             # LoRA: the same model, adapter off
            return self.passes.logprobs(self.ref_model, batch).logp

    def regularised(self, loss: Tensor, stats: dict, fwd: MinibatchForward, mb: Minibatch,
                    counts: dict, ref_logp: Tensor | None) -> tuple[Tensor, dict]:
        """The objective's loss (+ the MoE router loss), + β·KL(π_θ‖π_ref) − c·H: the total to
        differentiate, and the minibatch's detached stats."""
        train, agg, mask = self.cfg.train, self.aggregation, mb.mask[mb.idx]
        stats = {**{f"policy/{k}": v for k, v in stats.items()}, **fwd.stats}
        aux = self.passes.router_loss(fwd)
        if aux is not None:
            loss = loss + self.cfg.moe.aux_loss_coef * aux * self.ranks.token_share(mask, counts)
            stats["moe/aux_loss"] = aux.detach()
        stats["policy/loss"] = loss.detach()
        if fwd.entropy is not None:   # entropy of the rows trained on
            stats["policy/entropy"] = objectives.aggregate(fwd.entropy.detach(), fwd.mask, agg)
        total = loss
        if ref_logp is not None:  # (the plan trains every row when beta > 0 or entropy_coef > 0)
            kl = objectives.aggregate(objectives.kl_k3(fwd.logp, ref_logp[mb.idx]), mask, agg,
                                      **counts)
            total = total + train.beta * kl
            stats["policy/kl_ref"] = kl.detach()
        if train.entropy_coef > 0:
            total = total - train.entropy_coef * objectives.aggregate(fwd.entropy, mask, agg,
                                                                      **counts)
        return total, stats

    def backward(self, total: Tensor, partial: bool) -> None:
        """Gradients of ``total``; ``partial`` (rows skipped): parameters only they would reach
        get a zero gradient, not None, so that AdamW treats them as in the full update."""
        self.optimizer.zero_grad(set_to_none=not partial)   # (zeroed buffers are kept)
        if total.requires_grad:   # False when no row of the minibatch has a signal
            total.backward()
        if partial:
            for p in self.model.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)

    def mismatch(self, batch: RolloutBatch, old_logp: Tensor) -> dict:
        """Generator vs trainer log-probs (only when the generator's exist)."""
        if self.cfg.train.old_logprobs == "rollout":
            with torch.no_grad():
                trainer_logp = self.passes.logprobs(self.model, batch).logp
        else:
            trainer_logp = old_logp
        return diagnostics.logprob_mismatch(batch.rollout_logp, trainer_logp, batch.response_mask)

    def correct_rollout(self, batch: RolloutBatch, advantages: Tensor, old_logp: Tensor
                        ) -> tuple[Tensor, dict]:
        """train.rollout_correction: its mask joins the loss mask (batch.extras), its weight scales
        the advantages (gspo.core.correction.weighted_advantages); mismatch/* stats (mode none:
        only these)."""
        cfg = self.cfg.train.rollout_correction
        mask = loss_mask(batch, self.cfg.train.mask_truncated)                       # [N, T]
        out = correction.spec(cfg.mode).fn(old_logp, batch.rollout_logp, mask, **cfg.params())
        values = torch.stack(list(out.stats.values())).tolist()
        stats = {f"mismatch/{k}": v for k, v in zip(out.stats, values)}
        if cfg.mode == "none":
            return advantages, stats
        batch.extras["correction_mask"] = out.mask.to(mask.dtype)                   # [N, T]
        advantages = correction.weighted_advantages(advantages, out.weight, mask,
                                                    per_row=self.spec.sequence_level)
        return advantages, stats

    def length_slices(self, batch: RolloutBatch, rewards: Tensor, advantages: Tensor,
                      old_logp: Tensor, record: UpdateRecord) -> dict:
        """Reward, accuracy, clip fraction and ratio per response-length bucket (length/*)."""
        n = self.cfg.monitor.length_buckets
        if not n:
            return {}
        correct = batch.correct if batch.correct is not None else torch.tensor(
            correct_all(self.task, batch.completions, batch.examples))
        return diagnostics.length_slices(
            batch.lengths.cpu(), rewards.cpu(), correct, record.logp, old_logp, advantages,
            record.mask, objective=self.objective, objective_kwargs=self.objective_kwargs,
            buckets=diagnostics.length_buckets(self.cfg.rollout.max_new_tokens, n))


def skips_rows(cfg: TrainConfig, objective: str | None, ref_model) -> bool:
    """Whether rows without signal skip the forward/backward (unless a step is audited): asked
    for, the loss is 0 in value and gradient at Â = 0, and no per-token term needs every row."""
    t = cfg.train
    return bool(objective and t.skip_zero_advantage
                and objectives.spec(objective).zero_at_zero_advantage and ref_model is None
                and t.entropy_coef == 0 and cfg.moe.aux_loss_coef == 0)


def trained_rows(plan: UpdatePlan) -> Tensor:
    """CPU rows of the rollout batch that get a forward/backward, over all minibatches."""
    rows = [idx[pos] for idx, pos in zip(plan.minibatches, plan.trained)]
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)


def minibatches(plan: UpdatePlan, mask: Tensor, device: torch.device):
    """The plan's minibatches as this rank runs them: a minibatch with no row here becomes one
    stand-in row with a zero loss mask, so that every rank makes the same collective calls."""
    for idx, pos in zip(plan.minibatches, plan.trained):
        if len(idx):
            yield Minibatch(idx.to(device), pos, idx, mask, live=True)
        else:
            yield Minibatch(idx.new_zeros(1).to(device), pos.new_zeros(1), None,
                            torch.zeros_like(mask), live=False)
