"""One RL step, top to bottom, as the GSPO paper's algorithm reads::

    prompts[P] --generate G each (π_old)--> responses[N = P·G] --rewards--> r[N]
      --group advantages--> Â[N] --old log-probs (a strategy)--> old_logp[N, T], loss mask
      --shuffle, M minibatches--> logp = π_θ; loss = objective(...) (+ β·KL − c·H)
      --> backward, clip, AdamW step

``RLStep.__call__`` is that sequence; ``RLStep.update`` the minibatch loop. What is not the
algorithm sits behind small collaborators, each with a narrow interface:

* ``BatchSource`` (gspo.training.batch_source): the sampled and scored batch of the step;
* ``OldPolicy`` (gspo.training.old_policy): π_old by the batch's kind (recompute | rollout |
  behaviour | proximal), the rollout correction, and so the loss mask;
* ``Algorithm`` (gspo.training.algorithms): the advantages, and what else trains (PPO's critic);
* ``LogprobPasses`` (gspo.training.passes): the speed paths (rows without signal, the on-policy
  first minibatch, shared prompts) and MoE routing capture / replay;
* ``Ranks`` (gspo.training.distributed.Dist): global normalisers, gradient sums, metric reduction;
  under torchrun the rows each rank trains are dealt by tokens (gspo.training.balance);
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
from gspo.config.resolve import balance_refusal
from gspo.core import objectives
from gspo.core.plan import UpdatePlan, live_rows, minibatch_seed, plan_update, token_microbatches
from gspo.core.trajectory import dropped_rows, row_lengths, scored_mask
from gspo.observe import diagnostics
from gspo.observe.records import UpdateRecord
from gspo.observe.timing import StepTimer, breakdown
from gspo.rewards.isolation import correct_all
from gspo.rollout.generate import RolloutBatch
from gspo.training import balance, lora
from gspo.training.algorithms import Algorithm
from gspo.training.balance import Dealt
from gspo.training.old_policy import Context, OldLogprobs, OldPolicy, Strategy
from gspo.training.optim import MinibatchSteps, scaled
from gspo.training.passes import LogprobPasses, Minibatch, MinibatchForward


class BatchSource(Protocol):
    """Where a step's sampled and scored batch comes from (gspo.training.batch_source: the
    Collector in the loop, or a worker ahead of it); its π_prox too (``ProximalFeed``)."""

    def collect(self, step: int) -> tuple[RolloutBatch | None, Tensor, dict]: ...
    def seed(self, step: int, rnd: int = 0) -> int: ...
    def proximal(self, step: int) -> Callable: ...


class Ranks(Protocol):
    """What the step asks of the ranks (gspo.training.distributed.Dist; one process: identity)."""

    policy: object
    """The FSDP root when the model is sharded (every forward a collective), else None."""
    rank: int
    world: int

    @property
    def enabled(self) -> bool: ...
    def gather_objects(self, obj) -> list: ...

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


@dataclass(kw_only=True)
class RLStep:
    """Runs RL step ``step`` (0-based) on the policy and returns its metrics row."""
    cfg: TrainConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    source: BatchSource
    algorithm: Algorithm
    passes: LogprobPasses
    ranks: Ranks
    audit: Audit
    task: object                                   # is_correct, for the length slices
    ref_model: torch.nn.Module | None = None       # frozen π_ref when train.beta > 0
    samples: object = None
    """What the model wrote, every run.samples_every steps (gspo.observe.samples; rank 0 only)."""
    pad_id: int = 0
    """The tokenizer's padding id: prompts re-padded when ranks exchange rows (train.balance_ranks)."""
    objective: Callable | None = field(init=False)
    """The policy loss from the registry (None: sft, no policy-gradient update)."""
    old_policy: OldPolicy = field(init=False)
    """π_old's strategy for each batch (gspo.training.old_policy)."""

    def __post_init__(self):
        name = self.algorithm.objective
        self.spec = objectives.spec(name) if name else None
        self.objective = self.spec.fn if self.spec else None
        self.objective_kwargs = self.cfg.objective_kwargs()
        self.aggregation = self.cfg.token_aggregation()
        self.device = next(self.model.parameters()).device
        self.skips_rows = skips_rows(self.cfg, self.algorithm.objective, self.ref_model)
        self.old_policy = OldPolicy(Context(self.cfg, self.passes, feed=self.source,
                                            per_row=bool(self.spec and self.spec.sequence_level)))

    def __call__(self, step: int) -> dict:
        t_start, timer = time.perf_counter(), StepTimer(self.device)
        # 1. generate G responses to each of P prompts with π_old and score them
        batch, rewards, metrics = self.source.collect(step)
        metrics = self.ranks.reduce_metrics(metrics, len(rewards))      # ranks: one set of numbers
        if self.ranks.any(batch is None):
            return {**metrics, "step": step + 1, "train/skipped": 1.0}
        if self.objective is None:   # sft, dpo: their own update instead of a policy gradient
            return {"step": step + 1, **metrics, **self.algorithm.update(batch, rewards, step)}
        # 2. advantages: group-relative [N] (ppo: GAE [N, T]); dropped samples leave the loss
        batch.dropped = dropped_rows(rewards)
        advantages = self.algorithm.advantages(batch, rewards)
        # under torchrun: each minibatch's groups dealt to the ranks by tokens, the rows exchanged
        dealt = self.deal(batch, rewards, advantages, step)
        batch, rewards, advantages = dealt.batch, dealt.rewards, dealt.advantages
        metrics.update(dealt.metrics)
        # 3. π_old's log-probs [N, T] of the rows the update plan needs (and the loss mask)
        strategy = self.old_policy.pick(batch, step)    # recompute | rollout | behaviour | proximal
        plan = self.plan(batch, advantages, step, strategy=strategy, minibatches=dealt.minibatches)
        old = strategy(batch, advantages, plan, timer, step)
        metrics.update(self.ranks.reduce_metrics(old.metrics, len(rewards)))
        # 4. M minibatch updates of the policy, then what else the algorithm trains (ppo: critic)
        t0 = time.perf_counter()
        self.audit.begin(step)                                          # π_old, if audited
        update, record = self.update(batch, old, plan, timer)
        metrics.update(update)
        metrics.update(self.algorithm.update(batch, rewards, step))
        metrics["time/train_s"] = time.perf_counter() - t0
        metrics.update(old.finish(batch.response_mask, trained_rows(plan)))   # proximal: mismatch/*
        # 5. diagnostics and the audit record
        metrics.update(self.ranks.reduce_metrics(
            self.length_slices(batch, rewards, old.advantages, old.logp, record), len(rewards)))
        self.audit.finish(step, batch, rewards, old.advantages, old.logp, record, metrics,
                          new_logprobs=self.passes.new_logprobs,
                          seeds={"generation": self.source.seed(step, 0),
                                 "dynamic_sampling": self.cfg.train.dynamic_sampling,
                                 "minibatch": minibatch_seed(self.cfg.seed, step)})
        if self.samples is not None:
            self.samples.finish(step, batch, rewards, old.advantages, old.logp, record)
        parts = {**timer.seconds(), "generate": metrics["time/generate_s"],
                 "reward": metrics["time/reward_s"]}
        metrics.update(breakdown(parts, time.perf_counter() - t_start))
        return {"step": step + 1, **metrics}

    def update(self, batch: RolloutBatch, old: OldLogprobs, plan: UpdatePlan,
               timer: StepTimer | None = None) -> tuple[dict, UpdateRecord]:
        """M minibatch updates on one rollout batch (``plan``): log-probs, objective, backward,
        clip, step; (metrics averaged over minibatches, what each row trained on). After each
        forward ``old.minibatch`` hands over that minibatch's π_old, advantages and loss mask
        (the plan's first forward may be π_old itself; proximal: π_prox arrives, rows are
        corrected). The loss mask is ``batch.loss_mask`` (the scored mask when the step has not
        set it)."""
        if batch.loss_mask is None:
            batch.loss_mask = scored_mask(batch, self.cfg.train.mask_truncated)
        record, timer = UpdateRecord.start(batch.loss_mask), timer or StepTimer(self.device)
        ref_logp = self.reference_logprobs(batch)                       # [N, T] or None
        steps = MinibatchSteps(self.optimizer, self.scheduler, self.cfg.train.grad_clip,
                               clip=self.ranks.clip_grad_norm)
        self.model.train()
        lengths = row_lengths(batch)                 # (prompt, response) [N] CPU
        for i, mb in enumerate(minibatches(plan, batch.loss_mask, self.device)):
            with timer.section("forward_backward"):
                counts = self.ranks.global_counts(mb.mask[mb.idx])   # normalisers over all ranks
                reused = i == 0 and plan.reuse_first and mb.live     # this forward is π_old too
                parts = self.microbatches(mb, lengths)
                if len(parts) > 1:
                    total, stats = self.accumulate(batch, mb, parts, old, counts, ref_logp,
                                                   reused, record)
                else:
                    fwd = self.passes.minibatch(batch, mb, as_old=reused)
                    pi_old = old.minibatch(mb, fwd.logp, reused=reused)   # [m, T], adv, mask
                    logp = fwd.over(mb, pi_old.logp)                       # [m, T]
                    loss, stats = self.objective(logp, pi_old.logp, pi_old.advantages,
                                                 pi_old.mask, **self.objective_kwargs, **counts)
                    if mb.live:
                        record.add(mb.idx, logp, loss)
                    total, stats = self.regularised(loss, stats, fwd, logp, mb, counts, ref_logp)
                    self.backward(total, mb.partial)
                total = self.ranks.sync_grads(self.model, total)  # Σ_r ∇L_r = ∇L, the global loss
            with timer.section("optimizer"):
                stats["optim/grad_norm"] = steps.apply(total, self.model.parameters()).detach()
            steps.add(self.ranks.reduce_stats(stats, mb.mask[mb.idx], self.spec.sequence_level))
        computed, real = self.passes.take_tokens()   # positions the forwards computed, needed
        counted = self.ranks.reduce_metrics({"train/rows_skipped": plan.skipped,   # all ranks'
                                             "perf/tokens_computed": computed,
                                             "perf/tokens_real": real}, 1)
        computed = counted["perf/tokens_computed"]
        padding = 1.0 - counted["perf/tokens_real"] / computed if computed else 0.0
        return {**steps.means(), "optim/lr": self.scheduler.get_last_lr()[0],
                "optim/skipped_nonfinite": steps.skipped, **counted,
                "perf/padding_frac": padding}, record

    # ----------------------------------------------------------------------------- its parts
    def deal(self, batch: RolloutBatch, rewards: Tensor, advantages: Tensor, step: int) -> Dealt:
        """The rows this rank trains: under torchrun, each minibatch's groups dealt to the ranks
        by tokens unless train.balance_ranks=none or the config cannot deal them (auto then means
        none: gspo.config.resolve.balance_refusal); one process: the batch (gspo.training.balance)."""
        cfg = self.cfg
        return balance.deal(self.ranks, batch, rewards, advantages,
                            minibatches=cfg.train.minibatches, seed=minibatch_seed(cfg.seed, step),
                            unit=cfg.minibatch_unit, pad_id=self.pad_id,
                            balance=cfg.train.balance_ranks != "none" and balance_refusal(cfg) is None)

    def plan(self, batch: RolloutBatch, advantages: Tensor, step: int, speed_paths: bool = True,
             strategy: Strategy | None = None, minibatches: list[Tensor] | None = None
             ) -> UpdatePlan:
        """This step's minibatches and the rows needing a forward (gspo.core.plan);
        ``speed_paths=False``: every row, π_old of every row from the old-log-prob pass.
        ``strategy`` (default: the batch's) says whether the first minibatch's forward may be
        its rows' π_old. ``minibatches``: this rank's rows of each, as dealt (``deal``); None:
        drawn here (this rank's rows of the single process's partition)."""
        cfg = self.cfg
        if minibatches is None:
            gen = torch.Generator().manual_seed(minibatch_seed(cfg.seed, step))
            minibatches = self.ranks.minibatch_rows(len(advantages), cfg.train.minibatches, gen,
                                                    cfg.minibatch_unit)                   # this rank's
        if not speed_paths or self.ranks.policy is not None:  # fsdp: forwards are collectives
            return plan_update(minibatches, None, reuse_first=False)
        skip = self.skips_rows and not self.audit.due(step)
        mask = scored_mask(batch, cfg.train.mask_truncated)
        live = live_rows(advantages.cpu(), mask.cpu()) if skip else None                  # [N]
        strategy = strategy or self.old_policy.pick(batch, step)
        return plan_update(minibatches, live, reuse_first=strategy.reuse_first(batch))

    def old_logprobs(self, batch: RolloutBatch, rows: Tensor | None = None) -> Tensor:
        """[N, T] log π_old of a synchronous batch: the generator's own (train.old_logprobs=
        rollout), or recomputed for ``rows`` (CPU; None: all; the others stay 0)."""
        if self.cfg.train.old_logprobs == "rollout":
            return batch.rollout_logp
        return self.passes.old_logprobs(batch, rows)

    @torch.no_grad()
    def reference_logprobs(self, batch: RolloutBatch) -> Tensor | None:
        """[N, T] log π_ref for the KL penalty (train.beta > 0), else None."""
        if self.ref_model is None:
            return None
        with lora.reference(self.ref_model):             # LoRA: the same model, adapter off
            return self.passes.logprobs(self.ref_model, batch).logp

    def regularised(self, loss: Tensor, stats: dict, fwd: MinibatchForward, logp: Tensor,
                    mb: Minibatch, counts: dict, ref_logp: Tensor | None) -> tuple[Tensor, dict]:
        """The objective's loss (+ the MoE router loss), + β·KL(π_θ‖π_ref) − c·H: the total to
        differentiate, and the minibatch's detached stats; ``logp`` [m, T]: π_θ of its rows."""
        train, agg, mask = self.cfg.train, self.aggregation, mb.mask[mb.idx]
        measured = mb.live     # a stand-in row (no row of the minibatch here) measures nothing
        stats = {**{f"policy/{k}": v for k, v in stats.items()}, **(fwd.stats if measured else {})}
        aux = self.passes.router_loss(fwd)
        if aux is not None:
            loss = loss + self.cfg.moe.aux_loss_coef * aux * self.ranks.token_share(mask, counts)
            stats["moe/aux_loss"] = aux.detach()
        stats["policy/loss"] = loss.detach()
        if fwd.entropy is not None and measured:   # entropy of the rows trained on
            stats["policy/entropy"] = objectives.aggregate(fwd.entropy.detach(), fwd.mask, agg)
        total = loss
        if ref_logp is not None:  # (the plan trains every row when beta > 0 or entropy_coef > 0)
            kl = objectives.aggregate(objectives.kl_k3(logp, ref_logp[mb.idx]), mask, agg,
                                      **counts)
            total = total + train.beta * kl
            stats["policy/kl_ref"] = kl.detach()
        if train.entropy_coef > 0:
            total = total - train.entropy_coef * objectives.aggregate(fwd.entropy, mask, agg,
                                                                      **counts)
        return total, stats

    def microbatches(self, mb: Minibatch, lengths: tuple[Tensor, Tensor]) -> list[Tensor]:
        """Positions within ``mb.pos`` of each forward/backward: one, or under
        train.max_tokens_per_microbatch its rows grouped by length (gspo.core.plan)."""
        budget = self.cfg.train.max_tokens_per_microbatch
        if budget is None or not mb.live or len(mb.pos) < 2:
            return [torch.arange(len(mb.pos))]
        rows = mb.host_idx[mb.pos]
        return token_microbatches(lengths[0][rows], lengths[1][rows], budget)

    def accumulate(self, batch: RolloutBatch, mb: Minibatch, parts: list[Tensor], old: OldLogprobs,
                   counts: dict, ref_logp: Tensor | None, reused: bool,
                   record: UpdateRecord) -> tuple[Tensor, dict]:
        """The minibatch's gradient as a sum over micro-batches (``parts``, positions within
        ``mb.pos``): each loss carries the minibatch's global normalisers ``counts``, so the sum is
        the one-forward loss and gradient up to float rounding. The objective's stats and the
        audit record come from one no-grad pass over the assembled log-probs [m, T], the entropy
        from the rows' entropies together; the other stats are summed (losses, KL) or averaged
        weighted by the micro-batches' loss tokens (moe/*)."""
        if not counts:   # one process: the minibatch's own counts, for each micro-batch's loss
            lengths = (mb.mask[mb.idx] > 0).sum(-1)                                # [m] |y_i|
            counts = {"num_seqs": (lengths > 0).sum(), "num_tokens": lengths.sum()}
        total, parts_stats, entropy, computed = 0.0, [], [], []
        for j, part in enumerate(parts):
            pos = mb.pos[part]
            sub = Minibatch(mb.idx[pos.to(mb.idx.device)], torch.arange(len(pos)), mb.host_idx[pos],
                            mb.mask, live=True)
            fwd = self.passes.minibatch(batch, sub, as_old=reused)
            pi_old = old.minibatch(sub, fwd.logp, reused=reused)                  # [n, T], ...
            loss, _ = self.objective(fwd.logp, pi_old.logp, pi_old.advantages, pi_old.mask,
                                     **self.objective_kwargs, **counts)
            part_total, stats = self.regularised(loss, {}, fwd, fwd.logp, sub, counts, ref_logp)
            self.backward(part_total, mb.partial, accumulate=j > 0)
            total = total + part_total.detach()
            computed.append(fwd.logp.detach())
            parts_stats.append((mb.mask[sub.idx].sum().float(), stats))
            if fwd.entropy is not None:
                entropy.append((fwd.entropy.detach(), fwd.mask))
        pi_old = old.view(mb)                       # the whole minibatch, its rows now in
        where = torch.cat([mb.pos[part] for part in parts]).to(pi_old.logp.device)
        logp = pi_old.logp.index_copy(0, where, torch.cat(computed))               # [m, T]
        loss, stats = self.objective(logp, pi_old.logp, pi_old.advantages, pi_old.mask,
                                     **self.objective_kwargs, **counts)
        record.add(mb.idx, logp, loss)
        stats = {**{f"policy/{k}": v for k, v in stats.items()}, **combined(parts_stats)}
        if entropy:      # of the rows computed, as one forward's
            ent, mask = (torch.cat(t) for t in zip(*entropy))                      # [n, T]
            stats["policy/entropy"] = objectives.aggregate(ent, mask, self.aggregation)
        return total, stats

    def backward(self, total: Tensor, partial: bool, accumulate: bool = False) -> None:
        """Gradients of ``total`` (``accumulate``: added to those in); ``partial`` (rows skipped):
        parameters only they would reach get a zero gradient, not None, so that AdamW treats them
        as in the full update."""
        if not accumulate:
            self.optimizer.zero_grad(set_to_none=not partial)   # (zeroed buffers are kept)
        if total.requires_grad:   # False when no row of the minibatch has a signal
            scaled(total, self.optimizer).backward()   # float16: times the loss scale
        if partial:
            for p in self.model.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)

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
            batch.loss_mask, objective=self.objective, objective_kwargs=self.objective_kwargs,
            buckets=diagnostics.length_buckets(self.cfg.rollout.max_new_tokens, n))


def skips_rows(cfg: TrainConfig, objective: str | None, ref_model) -> bool:
    """Whether rows without signal skip the forward/backward (unless a step is audited): asked
    for, the loss is 0 in value and gradient at Â = 0, and no per-token term needs every row."""
    t = cfg.train
    return bool(objective and t.skip_zero_advantage
                and objectives.spec(objective).zero_at_zero_advantage and ref_model is None
                and t.entropy_coef == 0 and cfg.moe.aux_loss_coef == 0)


def combined(parts: list[tuple[Tensor, dict]]) -> dict:
    """Micro-batches' (loss tokens, stats) as one minibatch's: losses and the KL (global
    normalisers) summed, the others (entropy, moe/*) averaged weighted by loss tokens."""
    out, weight = {}, {}
    for w, stats in parts:
        for k, v in stats.items():
            w_k = 1.0 if k in ("policy/loss", "policy/kl_ref") else w
            out[k], weight[k] = out.get(k, 0.0) + w_k * v, weight.get(k, 0.0) + w_k
    return {k: v if k in ("policy/loss", "policy/kl_ref") else v / max(float(weight[k]), 1.0)
            for k, v in out.items()}


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
