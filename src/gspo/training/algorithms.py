"""What an RL step does around the policy loss, chosen by ``objective.name`` from a small registry.

The trainer runs every step the same way (rollouts, rewards, then an update) and asks its
``Algorithm`` only for what differs:

* ``GroupRelative`` (every objective of ``gspo.core.objectives``: gspo, grpo, sapo, …): group-relative
  advantages Â_i (GSPO Eq. 6); nothing else trains.
* ``PPO`` (``ppo``): a critic (``gspo.core.value.Critic``, initialised from the policy), per-token GAE
  with the sequence reward on the last response token (``gspo.core.advantages.gae``), optional KL
  penalty in the reward, whitened advantages for the ``ppo`` objective, and after the policy's
  update M minibatch updates of the critic with the clipped value loss.
* ``SFTBaseline`` (``sft``): no policy-gradient update; M AdamW steps of ``gspo.training.cold_start.sft_loss`` on
  demonstrations whose tokens match the step's rollout batch (the "no RL" baseline).
* ``OnlineDPO`` (``dpo``): no policy-gradient update; M AdamW steps of the DPO loss
  (``gspo.core.objectives.dpo_loss``) on each group's best-vs-worst pair, the cold start as reference.

The interface (``Algorithm``) is what the step calls: ``setup`` once the policy exists (handed
``PolicyParts``: the model, its optimizer, data and log-prob passes, never the trainer),
``advantages`` on each rollout batch, ``update`` after the policy's update (or instead of it when
``objective`` is None), ``state_dict`` / ``save`` / ``load`` for checkpoints. Rationale, defaults
and measured results: docs/baselines.md. This module is not the loop (``gspo.training.step``) and
holds no math of its own (``gspo.core.advantages``, ``gspo.core.value``, ``gspo.core.objectives``,
``gspo.training.cold_start``).
Shapes: N sequences, T response positions, M minibatches.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from gspo.config import BASELINES, objective_names
from gspo.core import advantages, objectives
from gspo.core.advantages import GAE_FORMULA, best_worst_pairs, formula, gae, whiten
from gspo.core.objectives import dpo_loss, sequence_logprobs
from gspo.core.trajectory import scored_mask
from gspo.core.value import Critic, explained_variance, value_loss
from gspo.core.plan import minibatch_seed, split_minibatches
from gspo.rollout.collect import DataCursor
from gspo.rollout.generate import RolloutBatch, demonstration_batch
from gspo.training.cold_start import sft_loss
from gspo.training.optim import MinibatchSteps, build_optimizer, build_scheduler
from gspo.training.passes import LogprobPasses

__all__ = ["Algorithm", "GroupRelative", "OnlineDPO", "PPO", "PolicyParts", "SFTBaseline", "get",
           "names",
           "terminal_rewards"]

CRITIC_FILES = ("critic.safetensors", "critic_optimizer.pt", "critic_scheduler.pt")


class AllRewards(Protocol):
    """The rewards of every rank (gspo.training.distributed.Dist; one process: its own)."""

    enabled: bool
    """More than one rank."""

    def all_rewards(self, rewards: Tensor) -> tuple[Tensor, slice]:
        """(the rewards of all ranks [N_all], this rank's rows in them)."""


@dataclass(kw_only=True)
class PolicyParts:
    """What an algorithm may use of the run: the policy, its optimizer, data and passes."""
    model: torch.nn.Module
    tokenizer: object
    optimizer: torch.optim.Optimizer
    scheduler: object
    device: torch.device
    train_set: list
    ref_model: torch.nn.Module | None
    """The frozen reference policy when train.beta > 0."""
    passes: LogprobPasses
    ranks: AllRewards


class Algorithm(Protocol):
    """What the step asks of an algorithm (one instance per run)."""

    objective: str | None
    """Registry name of the policy loss; None: no policy-gradient update (``update`` trains)."""

    def setup(self, parts: PolicyParts) -> None:
        """Once the policy, optimizer and scheduler exist (before a resume restores them)."""

    def advantages(self, batch: RolloutBatch, rewards: Tensor) -> Tensor:
        """Advantages [N] or [N, T] of a scored rollout batch (its ``dropped`` rows marked);
        only called when ``objective`` is not None."""

    def update(self, batch: RolloutBatch, rewards: Tensor, step: int) -> dict[str, float]:
        """After the policy's update (instead of it when ``objective`` is None): metrics."""

    def advantage_estimator(self) -> dict:
        """JSON-able: which advantages this algorithm computes and with what (provenance.json)."""

    def state_dict(self) -> dict:
        """JSON-able state for trainer_state.json."""

    def save(self, path: Path) -> None:
        """Write tensors into the checkpoint folder being built (checksummed with it)."""

    def load(self, path: Path, state: dict) -> None:
        """Restore from a checkpoint folder and its ``state_dict``."""


class Stateless:
    """The checkpoint half of ``Algorithm`` for an algorithm whose state is the policy's alone."""

    def state_dict(self) -> dict:
        return {}

    def save(self, path: Path) -> None:
        pass

    def load(self, path: Path, state: dict) -> None:
        pass


def single_process(parts: PolicyParts, name: str) -> None:
    if parts.ranks.enabled:
        raise ValueError(f"objective.name={name} runs in one process for now (its second model "
                         "and optimizer are not data-parallel); run it without torchrun")


# ----------------------------------------------------------------------------- group-relative

class GroupRelative(Stateless):
    """Group-relative advantages (``advantage.estimator``: group, GSPO Eq. 6 | rloo; dropped
    samples get 0) for a registry objective."""

    def __init__(self, cfg):
        self.cfg, self.objective = cfg, cfg.objective.name
        self.ranks: AllRewards | None = None      # set up: the other ranks' rewards (scale=batch)

    def setup(self, parts: PolicyParts) -> None:
        self.ranks = parts.ranks

    def advantages(self, batch: RolloutBatch, rewards: Tensor) -> Tensor:
        """Â [N]; advantage.scale=batch: the std spans the rewards of every rank."""
        a = self.cfg.advantage
        everyone, own = self.ranks.all_rewards(rewards) if a.scale == "batch" and self.ranks \
            else (rewards, slice(None))
        estimator = advantages.get(a.estimator)
        return estimator(everyone, self.cfg.rollout.group_size, scale=a.scale, eps=a.eps)[own]  # [N]

    def advantage_estimator(self) -> dict:
        a = self.cfg.advantage
        return {"name": a.estimator, "formula": formula(a.estimator, a.scale), "scale": a.scale,
                "eps": a.eps, "group_size": self.cfg.rollout.group_size,
                "reward_on_error": self.cfg.rewards.on_error}

    def update(self, batch: RolloutBatch, rewards: Tensor, step: int) -> dict[str, float]:
        return {}


# ----------------------------------------------------------------------------- PPO

def terminal_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """[N, T]: r_i on the last token with mask 1 (the EOS, or the last token of a truncated
    response), 0 elsewhere; rows with an empty mask get nothing. rewards [N], mask [N, T]."""
    keep = mask > 0
    last = keep & (keep.cumsum(-1) == keep.sum(-1, keepdim=True))                  # [N, T] one-hot
    return torch.where(last, rewards[:, None].to(torch.float32), torch.zeros(last.shape,
                                                                              device=mask.device))


class PPO:
    """PPO with a separate critic: GAE advantages for the ``ppo`` objective, then critic updates."""

    objective = "ppo"

    def __init__(self, cfg):
        self.cfg, self.p = cfg, cfg.ppo
        self._pending: dict = {}

    def advantage_estimator(self) -> dict:
        p = self.p
        return {"name": "gae", "formula": GAE_FORMULA, "gamma": p.gamma, "lam": p.lam,
                "whiten": p.whiten_advantages, "kl_in_reward": p.kl_in_reward,
                "kl_coef": p.kl_coef, "value_clip": p.value_clip, "critic_lr": p.critic_lr}

    def setup(self, parts: PolicyParts) -> None:
        single_process(parts, "ppo")
        cfg = self.cfg
        self.passes = parts.passes
        self.critic = Critic.from_policy(parts.model, seed=cfg.seed)  # same seed, same critic
        self.optimizer = build_optimizer(self.critic, self.p.critic_lr or cfg.train.lr,
                                         cfg.train.weight_decay)
        self.scheduler = build_scheduler(self.optimizer, cfg.train.schedule, cfg.train.warmup_steps,
                                         cfg.train.steps * cfg.train.minibatches)
        self.ref = None
        if self.p.kl_in_reward:  # the trainer's reference when it has one (train.beta > 0)
            self.ref = parts.ref_model or copy.deepcopy(parts.model).eval().requires_grad_(False)

    @torch.no_grad()
    def advantages(self, batch: RolloutBatch, rewards: Tensor) -> Tensor:
        """GAE over the loss mask, the reward on each response's last token, whitened: [N, T]."""
        passes, p = self.passes, self.p
        dropped = ~torch.isfinite(rewards)                      # [N] rewards.on_error=drop
        mask = scored_mask(batch, self.cfg.train.mask_truncated)                      # [N, T]
        r = torch.where(dropped, torch.zeros_like(rewards), rewards)                  # [N]
        rewards_tok = terminal_rewards(r, mask)                                       # [N, T]
        stats = {}
        if self.ref is not None:                   # −β_kl (log π_old − log π_ref) per token (k1)
            logp = passes.logprobs(passes.model, batch).logp                          # [N, T]
            ref = passes.logprobs(self.ref, batch).logp                               # [N, T]
            kl = torch.where(mask > 0, logp - ref, torch.zeros_like(logp))            # [N, T]
            rewards_tok = rewards_tok - p.kl_coef * kl
            stats["ppo/kl_reward"] = kl.sum(-1).mean()                                # per response
        self.critic.eval()
        values = self.critic(batch.input_ids, batch.attention_mask, mask)             # [N, T] V_old
        adv, returns = gae(rewards_tok, values, mask, p.gamma, p.lam)                 # [N, T]
        stats.update({"value/mean": objectives.masked_mean(values, mask),
                      "value/returns_mean": objectives.masked_mean(returns, mask),
                      "value/explained_variance": explained_variance(values, returns, mask),
                      "ppo/advantage_mean": objectives.masked_mean(adv, mask),
                      "ppo/advantage_abs_mean": objectives.masked_mean(adv.abs(), mask)})
        self._pending = {"values": values, "returns": returns, "mask": mask, "stats": stats}
        return whiten(adv, mask) if p.whiten_advantages else adv

    def update(self, batch: RolloutBatch, rewards: Tensor, step: int) -> dict[str, float]:
        """M minibatch steps of the clipped value loss on this batch (the policy's split)."""
        cfg, pend = self.cfg, self._pending
        values, returns, mask = pend["values"], pend["returns"], pend["mask"]
        gen = torch.Generator().manual_seed(minibatch_seed(cfg.seed, step))
        steps = MinibatchSteps(self.optimizer, self.scheduler, cfg.train.grad_clip)
        steps.add(pend["stats"])
        self.critic.train()
        for idx in split_minibatches(len(returns), cfg.train.minibatches, gen, cfg.minibatch_unit):
            idx = idx.to(values.device)
            mb = batch.select(idx)
            v = self.critic(mb.input_ids, mb.attention_mask, mask[idx])               # [m, T]
            loss, s = value_loss(v, values[idx], returns[idx], mask[idx], clip=self.p.value_clip)
            norm = steps.step(loss, self.critic.parameters())
            steps.add({"value/loss": loss.detach(), "value/clip_frac": s["clip_frac"],
                       "value/grad_norm": norm.detach()})
        self._pending = {}
        return {**steps.means(), "value/lr": self.scheduler.get_last_lr()[0],
                "value/skipped_nonfinite": steps.skipped}

    def state_dict(self) -> dict:
        return {}

    def save(self, path: Path) -> None:
        weights, optim, sched = (Path(path) / name for name in CRITIC_FILES)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.critic.state_dict().items()},
                  str(weights))
        torch.save(self.optimizer.state_dict(), optim)
        torch.save(self.scheduler.state_dict(), sched)

    def load(self, path: Path, state: dict) -> None:
        weights, optim, sched = (Path(path) / name for name in CRITIC_FILES)
        if not weights.is_file():
            raise FileNotFoundError(f"{path}: no {weights.name}: not a checkpoint of a ppo run")
        device = next(self.critic.parameters()).device
        self.critic.load_state_dict(load_file(str(weights), device=str(device)))
        self.optimizer.load_state_dict(torch.load(optim, weights_only=True, map_location="cpu"))
        self.scheduler.load_state_dict(torch.load(sched, weights_only=True, map_location="cpu"))


# ----------------------------------------------------------------------------- SFT baseline

class SFTBaseline:
    """Continued SFT at RL's budget: per step, M optimizer steps on demonstrations whose tokens
    (answer + EOS, cut at max_new_tokens) add up as closely as possible to the response tokens of
    the step's rollout batch. The rollouts are only measured (reward/*), never trained on."""

    objective = None

    def __init__(self, cfg):
        self.cfg = cfg
        self._lengths: dict[int, int] = {}

    def advantage_estimator(self) -> dict:
        return {"name": "none", "formula": "no advantages: supervised steps on demonstrations"}

    def setup(self, parts: PolicyParts) -> None:
        single_process(parts, "sft")
        self.parts = parts
        self.cursor = DataCursor(len(parts.train_set), self.cfg.seed + 1)  # not the prompts' order

    def _length(self, i: int) -> int:
        """Tokens of demonstration i as trained on: answer + EOS, at most max_new_tokens."""
        if i not in self._lengths:
            answer = self.parts.train_set[i].answer
            n = len(self.parts.tokenizer(answer, add_special_tokens=False)["input_ids"]) + 1
            self._lengths[i] = min(n, self.cfg.rollout.max_new_tokens)
        return self._lengths[i]

    def draw(self, tokens: int) -> list[int]:
        """Demonstration indices, in data order, whose lengths sum closest to ``tokens`` (≥ 1)."""
        picked, total = [], 0
        while total < tokens or not picked:
            i = self.cursor.take(1)[0]
            n = self._length(i)
            if picked and total + n - tokens > tokens - total:  # overshoot worse than stopping
                break
            picked.append(i)
            total += n
        return picked

    def update(self, batch: RolloutBatch, rewards: Tensor, step: int) -> dict[str, float]:
        t, cfg = self.parts, self.cfg
        rl_tokens = int(batch.response_mask.sum())
        picked = self.draw(rl_tokens)
        M = min(cfg.train.minibatches, len(picked))
        steps, tokens = MinibatchSteps(t.optimizer, t.scheduler, cfg.train.grad_clip), 0
        t.model.train()
        for part in torch.tensor(picked).tensor_split(M):
            demos = demonstration_batch(t.tokenizer, [t.train_set[i] for i in part.tolist()],
                                        t.device, max_new_tokens=cfg.rollout.max_new_tokens)
            loss = sft_loss(t.model, demos, chunk_size=cfg.train.logprob_chunk)
            norm = steps.step(loss, t.model.parameters())
            steps.add({"sft/loss": loss.detach(), "optim/grad_norm": norm.detach()})
            tokens += int(demos.response_mask.sum())
        return {**steps.means(), "sft/tokens": tokens, "sft/rl_tokens": rl_tokens,
                "sft/demonstrations": len(picked), "optim/lr": t.scheduler.get_last_lr()[0],
                "optim/skipped_nonfinite": steps.skipped}

    def state_dict(self) -> dict:
        return {"demo_cursor": self.cursor.state()}

    def save(self, path: Path) -> None:
        pass

    def load(self, path: Path, state: dict) -> None:
        self.cursor.load(state["demo_cursor"])


# ----------------------------------------------------------------------------- online DPO

class OnlineDPO(Stateless):
    """Online DPO (arXiv 2305.18290's loss on on-policy pairs, as arXiv 2402.04792): from each
    group of G rollouts, the best-rewarded response is preferred to the worst-rewarded one; groups
    without a reward difference give no pair. Reference: the cold-start policy (the trainer's
    ``ref_model`` when ``train.beta > 0``, else a frozen copy taken at setup, before a resume
    restores the weights). Per step, M minibatch AdamW steps over the step's K ≤ P pairs.

    It replaces the policy-gradient update (``objective`` is None): no ratio, no clipping, no row
    skipping (only pair rows are ever forwarded). A response leaves the pairs when its reward was
    dropped (rewards.on_error=drop) or its loss mask is empty (train.mask_truncated)."""

    objective = None

    def __init__(self, cfg):
        self.cfg = cfg

    def advantage_estimator(self) -> dict:
        return {"name": "none", "formula": "no advantages: DPO on each group's best-vs-worst "
                                           "reward pair"}

    def setup(self, parts: PolicyParts) -> None:
        single_process(parts, "dpo")
        self.parts = parts
        self.ref = parts.ref_model or copy.deepcopy(parts.model).eval().requires_grad_(False)

    def pairs(self, batch: RolloutBatch, rewards: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(winners [K], losers [K]) row indices on the host, and the loss mask [N, T]."""
        mask = scored_mask(batch, self.cfg.train.mask_truncated)                      # [N, T]
        usable = (mask > 0).any(-1) & torch.isfinite(rewards)                         # [N]
        scored = torch.where(usable, rewards.float(), torch.full_like(rewards.float(), float("nan")))
        win, lose = best_worst_pairs(scored.cpu(), self.cfg.rollout.group_size)
        return win, lose, mask

    def update(self, batch: RolloutBatch, rewards: Tensor, step: int) -> dict[str, float]:
        t, cfg = self.parts, self.cfg
        win, lose, mask = self.pairs(batch, rewards)
        groups = len(rewards) // cfg.rollout.group_size
        out = {"dpo/pairs": len(win), "dpo/groups_without_pair": groups - len(win)}
        if not len(win):
            return {**out, "train/skipped": 1.0}
        rows = torch.cat([win, lose])                                                 # [2K] host
        with torch.no_grad():
            ref = sequence_logprobs(t.passes.logprobs(self.ref, batch.select(rows)).logp,
                                    mask[rows.to(mask.device)])                       # [2K]
        ref_w, ref_l = ref.chunk(2)                                                   # [K] each
        gen = torch.Generator().manual_seed(minibatch_seed(cfg.seed, step))
        order = torch.randperm(len(win), generator=gen)
        steps = MinibatchSteps(t.optimizer, t.scheduler, cfg.train.grad_clip)
        t.model.train()
        for part in order.tensor_split(min(cfg.train.minibatches, len(win))):
            sel = torch.cat([win[part], lose[part]])                                  # [2k] host
            logp = t.passes.logprobs(t.model, batch.select(sel)).logp                  # [2k, T]
            seq_w, seq_l = sequence_logprobs(logp, mask[sel.to(mask.device)]).chunk(2)  # [k] each
            part_d = part.to(ref.device)
            loss, stats = dpo_loss(seq_w, seq_l, ref_w[part_d], ref_l[part_d], beta=cfg.dpo.beta)
            norm = steps.step(loss, t.model.parameters())
            steps.add({"dpo/loss": loss.detach(), "optim/grad_norm": norm.detach(),
                       **{f"dpo/{name}": x for name, x in stats.items()}})
        return {**out, **steps.means(), "optim/lr": t.scheduler.get_last_lr()[0],
                "optim/skipped_nonfinite": steps.skipped}



# ----------------------------------------------------------------------------- registry

REGISTRY = {"dpo": OnlineDPO, "ppo": PPO, "sft": SFTBaseline}
"""objective.name -> its algorithm, where it is not plain group-relative advantages."""
if set(REGISTRY) - set(objectives.available()) != set(BASELINES):
    raise RuntimeError("gspo.config.BASELINES must name the algorithms that are not an objective")


def names() -> list[str]:
    """Every valid ``objective.name``: the policy-loss registry plus the baselines here."""
    return objective_names()


def get(name: str):
    """The algorithm class for ``objective.name``; ValueError listing the valid names."""
    if name in REGISTRY:
        return REGISTRY[name]
    if name in objectives.available():
        return GroupRelative
    raise ValueError(f"unknown objective {name!r}; valid: {', '.join(names())}")
