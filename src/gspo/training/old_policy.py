"""π_old as a strategy: how one RL step gets the old log-probs its ratio is taken against.

The step asks one question, "log π_old of this batch, please", and this module answers it by the
batch's kind (``OldPolicy.pick``), never by an ``if`` in the step:

* ``recompute`` (train.old_logprobs=recompute, an on-policy batch): a log-prob pass of the
  trainer's weights over the rows the update plan needs; the first minibatch's own forward is
  π_old of its rows (``reuse_first``) unless the sampler's log-probs or π_old's experts must be
  known before the update.
* ``rollout`` (train.old_logprobs=rollout): the sampler's own log-probs.
* ``behaviour`` (rollout.async_ratio=behaviour, a stale batch): π_v, the sampling weights'
  log-probs, as the asynchronous worker computed them (``batch.behaviour_logp``).
* ``proximal`` (rollout.async_ratio=decoupled, a stale batch): π_prox, the trainer's weights at
  the start of the step: the first minibatch's own forward, the others' from the worker while the
  first runs (gspo.training.proximal), each minibatch's rows corrected once they are in.

Whatever the strategy, it hands the step an ``OldLogprobs``: log π_old [N, T], the advantages
weighted by the rollout correction and the correction's mismatch/* metrics. The minibatch loop
asks it once per minibatch, after the forward, for that minibatch's π_old, advantages and loss
mask (``OldLogprobs.minibatch``): where the first minibatch's forward is π_old, where
``proximal`` waits for the worker and corrects. It also sets the batch's loss mask, once: the
scored mask times the correction's mask (``proximal``: per minibatch, as π_prox arrives).
Shapes: N rows, T response positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
from torch import Tensor

from gspo.core import correction
from gspo.core.plan import UpdatePlan
from gspo.core.trajectory import scored_mask
from gspo.observe import diagnostics
from gspo.observe.timing import StepTimer
from gspo.registry import Registry
from gspo.rollout.generate import RolloutBatch
from gspo.training.passes import LogprobPasses, Minibatch
from gspo.training.proximal import LateProximal


class ProximalFeed(Protocol):
    """Where the worker's π_prox of a stale batch comes from (gspo.training.batch_source)."""

    def proximal(self, step: int) -> Callable:
        """A call that waits for the worker's π_prox of the batch of ``step``."""


@dataclass
class OldMinibatch:
    """π_old as one minibatch (or micro-batch) trains on it: what the objective takes beside π_θ."""
    logp: Tensor                    # [m, T] log π_old of its rows
    advantages: Tensor              # [m] or [m, T], weighted by the rollout correction
    mask: Tensor                    # [m, T] its loss mask (the correction's included)


@dataclass
class OldLogprobs:
    """log π_old of one step's batch, as the strategy made it; ``minibatch`` hands it to the
    update one minibatch at a time."""
    logp: Tensor                    # [N, T] (rows the plan does not read stay 0)
    advantages: Tensor              # [N] or [N, T], weighted by the rollout correction
    metrics: dict = field(default_factory=dict)   # mismatch/* before the update
    late: LateProximal | None = None

    def minibatch(self, mb: Minibatch, computed: Tensor, *, reused: bool) -> OldMinibatch:
        """π_old of minibatch ``mb`` once its forward has run; ``computed`` [n, T]: π_θ of the
        rows it computed (``mb.idx[mb.pos]``). ``reused`` (the plan's first minibatch, before
        any optimizer step): that forward is its rows' π_old, bit for bit, and is written in.
        ``proximal``: the later minibatches wait for the worker's π_prox (made while the first
        ran), and the rows computed are corrected now that their π_old is in; the correction's
        mask goes into ``mb.mask``, the update's loss mask."""
        rows = mb.idx[mb.pos.to(mb.idx.device)]                                    # [n]
        if reused:
            self.logp[rows] = computed.detach()
        elif self.late is not None:
            self.late.fill(self.logp)
        if self.late is not None and mb.live:   # (the counts were taken before, unaffected)
            self.late.correct(rows, self.logp, mb.mask)
        return self.view(mb)

    def view(self, mb: Minibatch) -> OldMinibatch:
        """π_old of minibatch ``mb`` as it stands (no forward to take in)."""
        advantages = self.advantages if self.late is None else self.late.advantages
        return OldMinibatch(self.logp[mb.idx], advantages[mb.idx], mb.mask[mb.idx])

    def finish(self, response_mask: Tensor, trained: Tensor) -> dict:
        """After the update: ``proximal``'s mismatch/* over the ``trained`` rows, its final
        advantages (M = 1: nothing waited for its π_prox)."""
        if self.late is None:
            return {}
        self.late.fill(self.logp)
        self.advantages = self.late.advantages
        return self.late.metrics(self.logp, response_mask, trained)


class Strategy(Protocol):
    """One way to get π_old (module docstring)."""

    def reuse_first(self, batch: RolloutBatch) -> bool:
        """Whether the first minibatch's forward may be its rows' π_old (gspo.core.plan)."""

    def __call__(self, batch: RolloutBatch, advantages: Tensor, plan: UpdatePlan,
                 timer: StepTimer, step: int) -> OldLogprobs: ...


@dataclass
class Context:
    """What the strategies use of the run: the settings, the policy's passes, the worker."""
    cfg: object                     # TrainConfig: train.mask_truncated, rollout_correction, moe
    passes: LogprobPasses
    per_row: bool                   # the objective is sequence-level (correction weights per row)
    feed: ProximalFeed | None = None


STRATEGIES: Registry[type] = Registry("π_old strategy")
register = STRATEGIES.register


class Known:
    """π_old known before the update (recompute, rollout, behaviour): then the mismatch against
    the sampler's log-probs and the rollout correction over every row, the loss mask set."""

    def __init__(self, ctx: Context):
        self.ctx = ctx

    def reuse_first(self, batch: RolloutBatch) -> bool:
        return False

    def logprobs(self, batch: RolloutBatch, plan: UpdatePlan) -> Tensor:
        """[N, T] log π_old."""
        raise NotImplementedError

    def __call__(self, batch, advantages, plan, timer, step) -> OldLogprobs:
        mask = scored_mask(batch, self.ctx.cfg.train.mask_truncated)                 # [N, T]
        with timer.section("old_logprobs"):
            old = OldLogprobs(self.logprobs(batch, plan), advantages)
        batch.loss_mask = mask
        if batch.rollout_logp is not None:
            old.metrics.update(self.mismatch(batch, old.logp))
            self.correct(batch, old, mask)
        return old

    def mismatch(self, batch: RolloutBatch, old_logp: Tensor) -> dict:
        """Generator vs trainer log-probs (only when the generator's exist)."""
        return diagnostics.logprob_mismatch(batch.rollout_logp, old_logp, batch.response_mask)

    def correct(self, batch: RolloutBatch, old: OldLogprobs, mask: Tensor) -> None:
        """train.rollout_correction of π_old against the sampler: its weight scales the
        advantages (gspo.core.correction.weighted_advantages), its mask joins the loss mask;
        mismatch/* stats (mode none: only these)."""
        cfg = self.ctx.cfg.train.rollout_correction
        out = correction.spec(cfg.mode).fn(old.logp, batch.rollout_logp, mask, **cfg.params())
        values = torch.stack(list(out.stats.values())).tolist()
        old.metrics.update({f"mismatch/{k}": v for k, v in zip(out.stats, values)})
        if cfg.mode == "none":
            return
        old.advantages = correction.weighted_advantages(old.advantages, out.weight, mask,
                                                        per_row=self.ctx.per_row)
        batch.loss_mask = mask * out.mask.to(mask.dtype)                            # [N, T]


@register("recompute")
class Recompute(Known):
    """A log-prob pass of the trainer's weights (train.old_logprobs=recompute, on-policy)."""

    def reuse_first(self, batch: RolloutBatch) -> bool:
        return batch.rollout_logp is None and self.ctx.cfg.moe.routing_replay != "old"

    def logprobs(self, batch: RolloutBatch, plan: UpdatePlan) -> Tensor:
        # the sampler's log-probs: mismatch and correction read every row (named, so that
        # each prompt is forwarded once, as in the plan's own rows)
        rows = torch.arange(len(batch.input_ids)) if batch.rollout_logp is not None \
            else plan.old_rows
        return self.ctx.passes.old_logprobs(batch, rows)


@register("rollout")
class Rollout(Known):
    """The sampler's own log-probs (train.old_logprobs=rollout); no correction against itself."""

    def logprobs(self, batch: RolloutBatch, plan: UpdatePlan) -> Tensor:
        return batch.rollout_logp

    def mismatch(self, batch: RolloutBatch, old_logp: Tensor) -> dict:
        passes = self.ctx.passes
        with torch.no_grad():
            trainer_logp = passes.logprobs(passes.model, batch).logp
        return diagnostics.logprob_mismatch(batch.rollout_logp, trainer_logp, batch.response_mask)

    def correct(self, batch: RolloutBatch, old: OldLogprobs, mask: Tensor) -> None:
        pass


@register("behaviour")
class Behaviour(Known):
    """π_v of a stale batch from the asynchronous worker (rollout.async_ratio=behaviour)."""

    def logprobs(self, batch: RolloutBatch, plan: UpdatePlan) -> Tensor:
        if batch.behaviour_logp is None:
            raise RuntimeError("async rollouts: a stale batch without the behaviour policy's "
                               "log-probs (the worker computes them)")
        return batch.behaviour_logp


@register("proximal")
class Proximal:
    """π_prox of a stale batch (rollout.async_ratio=decoupled): the first minibatch's forward,
    the worker's for the others, corrected per minibatch (gspo.training.proximal)."""

    def __init__(self, ctx: Context):
        self.ctx = ctx

    def reuse_first(self, batch: RolloutBatch) -> bool:
        return True

    def __call__(self, batch, advantages, plan, timer, step) -> OldLogprobs:
        cfg = self.ctx.cfg.train
        # corrected per minibatch, in place: its own tensor (the scored mask may be the
        # response mask itself, which must stay as generated: attention and lengths)
        batch.loss_mask = scored_mask(batch, cfg.mask_truncated).clone()
        late = LateProximal(self.ctx.feed.proximal(step), batch.rollout_logp, advantages,
                            batch.loss_mask, plan.old_rows, mode=cfg.rollout_correction.mode,
                            params=cfg.rollout_correction.params(), per_row=self.ctx.per_row)
        logp = torch.zeros_like(batch.response_mask, dtype=torch.float32)           # [N, T]
        return OldLogprobs(logp, advantages, late=late)


def strategy_name(cfg, stale: bool) -> str:
    """The strategy for a batch: ``stale`` (sampled by older weights than the step's) only under
    rollout.async, where rollout.async_ratio says which."""
    if cfg.train.old_logprobs == "rollout":
        return "rollout"
    if not stale:
        return "recompute"
    return {"behaviour": "behaviour", "decoupled": "proximal"}[cfg.rollout.async_ratio]


class OldPolicy:
    """Picks the strategy of each step's batch by its version (``Trajectories.version``)."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.strategies = {name: STRATEGIES.get(name)(ctx) for name in STRATEGIES.names()}

    def pick(self, batch: RolloutBatch, step: int) -> Strategy:
        stale = batch.version is not None and batch.version < step
        return self.strategies[strategy_name(self.ctx.cfg, stale)]
