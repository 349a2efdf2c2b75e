"""What an RL step does around the policy loss, chosen by ``objective.name`` from a small registry.

The trainer runs every step the same way (rollouts, rewards, then an update) and asks its
``Algorithm`` only for what differs:

* ``GroupRelative`` (every objective of ``gspo.objectives``: gspo, grpo, sapo, …): group-relative
  advantages Â_i (GSPO Eq. 6); nothing else trains.
* ``PPO`` (``ppo``): a critic (``gspo.value.Critic``, initialised from the policy), per-token GAE
  with the sequence reward on the last response token (``gspo.advantages.gae``), optional KL
  penalty in the reward, whitened advantages for the ``ppo`` objective, and after the policy's
  update M minibatch updates of the critic with the clipped value loss.
* ``SFTBaseline`` (``sft``): no policy-gradient update; M AdamW steps of ``gspo.sft.sft_loss`` on
  demonstrations whose tokens match the step's rollout batch (the "no RL" baseline).
* ``OnlineDPO`` (``dpo``): no policy-gradient update; M AdamW steps of the DPO loss
  (``gspo.objectives.dpo_loss``) on each group's best-vs-worst pair, the cold start as reference.

The interface (``Algorithm``) is what the trainer calls: ``setup`` once the policy exists,
``advantages`` on each rollout batch, ``update`` after the policy's update (or instead of it when
``objective`` is None), ``state_dict`` / ``save`` / ``load`` for checkpoints. Rationale, defaults
and measured results: docs/baselines.md. This module is not the loop (``gspo.trainer``) and holds
no math of its own (``gspo.advantages``, ``gspo.value``, ``gspo.objectives``, ``gspo.sft``).
Shapes: N sequences, T response positions, M minibatches.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from gspo import objectives
from gspo.advantages import GAE_FORMULA, best_worst_pairs, formula, gae, whiten
from gspo.isolation import advantages_with_drops
from gspo.objectives import dpo_loss, sequence_logprobs
from gspo.optim import build_optimizer, build_scheduler, clipped_step
from gspo.rollout import RolloutBatch, demonstration_batch
from gspo.sft import sft_loss
from gspo.value import Critic, explained_variance, value_loss

__all__ = ["Algorithm", "GroupRelative", "OnlineDPO", "PPO", "SFTBaseline", "get", "names",
           "terminal_rewards"]

CRITIC_FILES = ("critic.safetensors", "critic_optimizer.pt", "critic_scheduler.pt")


class Algorithm(Protocol):
    """What the trainer asks of an algorithm (one instance per run)."""

    objective: str | None
    """Registry name of the policy loss; None: no policy-gradient update (``update`` trains)."""

    def setup(self, trainer) -> None:
        """Once the policy, optimizer and scheduler exist (before a resume restores them)."""

    def advantages(self, batch: RolloutBatch, rewards: Tensor) -> Tensor:
        """Advantages [N] or [N, T] of a scored rollout batch (may mark dropped rows in extras);
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


def _single_process(trainer, name: str) -> None:
    if trainer.dist.enabled:
        raise ValueError(f"objective.name={name} runs in one process for now (its second model "
                         "and optimizer are not data-parallel); run it without torchrun")


# ----------------------------------------------------------------------------- group-relative

class GroupRelative:
    """Group-relative advantages (``advantage.estimator``: group, GSPO Eq. 6 | rloo; reward.on_error=drop
    aware) for a registry objective."""

    def __init__(self, cfg):
        self.cfg, self.objective = cfg, cfg.objective.name

    def setup(self, trainer) -> None:
        pass

    def advantages(self, batch: RolloutBatch, rewards: Tensor) -> Tensor:
        a = self.cfg.advantage
        return advantages_with_drops(batch, rewards, self.cfg.rollout.group_size, scale=a.scale,
                                     eps=a.eps, estimator=a.estimator)                # [N]

    def advantage_estimator(self) -> dict:
        a = self.cfg.advantage
        return {"name": a.estimator, "formula": formula(a.estimator, a.scale), "scale": a.scale,
                "eps": a.eps, "group_size": self.cfg.rollout.group_size,
                "reward_on_error": self.cfg.reward.on_error}

    def update(self, batch: RolloutBatch, rewards: Tensor, step: int) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict:
        return {}

    def save(self, path: Path) -> None:
        pass

    def load(self, path: Path, state: dict) -> None:
        pass


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

    def setup(self, trainer) -> None:
        _single_process(trainer, "ppo")
        cfg = self.cfg
        self.trainer = trainer
        self.critic = Critic.from_policy(trainer.model)
        self.optimizer = build_optimizer(self.critic, self.p.critic_lr or cfg.train.lr,
                                         cfg.train.weight_decay)
        self.scheduler = build_scheduler(self.optimizer, cfg.train.schedule, cfg.train.warmup_steps,
                                         cfg.train.steps * cfg.train.minibatches)
        self.ref = None
        if self.p.kl_in_reward:  # the trainer's reference when it has one (train.beta > 0)
            self.ref = trainer.ref_model or copy.deepcopy(trainer.model).eval().requires_grad_(False)

    @torch.no_grad()
    def advantages(self, batch: RolloutBatch, rewards: Tensor) -> Tensor:
        """GAE over the loss mask, the reward on each response's last token, whitened: [N, T]."""
        t, p = self.trainer, self.p
        dropped = ~torch.isfinite(rewards)                                            # [N]
        if bool(dropped.any()):                                # reward.on_error=drop: out of the loss
            batch.extras["dropped"] = dropped
        mask = t.loss_mask(batch)                                                     # [N, T]
        r = torch.where(dropped, torch.zeros_like(rewards), rewards)                  # [N]
        rewards_tok = terminal_rewards(r, mask)                                       # [N, T]
        stats = {}
        if self.ref is not None:                   # −β_kl (log π_old − log π_ref) per token (k1)
            logp = t._logprobs(t.model, batch, with_entropy=False).logp               # [N, T]
            ref = t._logprobs(self.ref, batch, with_entropy=False).logp               # [N, T]
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
        from gspo.trainer import split_minibatches
        t, cfg, pend = self.trainer, self.cfg, self._pending
        values, returns, mask = pend["values"], pend["returns"], pend["mask"]
        gen = torch.Generator().manual_seed(t.minibatch_seed(step))
        collected: dict[str, list[Tensor]] = {k: [v] for k, v in pend["stats"].items()}
        self.critic.train()
        for idx in split_minibatches(len(returns), cfg.train.minibatches, gen):
            idx = idx.to(values.device)
            mb = batch.select(idx)
            v = self.critic(mb.input_ids, mb.attention_mask, mask[idx])               # [m, T]
            loss, s = value_loss(v, values[idx], returns[idx], mask[idx], clip=self.p.value_clip)
            norm = clipped_step(loss, self.critic.parameters(), self.optimizer, self.scheduler,
                                cfg.train.grad_clip)
            for k, x in {"value/loss": loss.detach(), "value/clip_frac": s["clip_frac"],
                         "value/grad_norm": norm.detach()}.items():
                collected.setdefault(k, []).append(x)
        self._pending = {}
        keys = list(collected)
        numbers = torch.stack([torch.stack([x.float() for x in collected[k]]).mean()
                               for k in keys]).tolist()
        return {**dict(zip(keys, numbers)), "value/lr": self.scheduler.get_last_lr()[0]}

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

    def setup(self, trainer) -> None:
        from gspo.trainer import DataCursor
        _single_process(trainer, "sft")
        self.trainer = trainer
        self.cursor = DataCursor(len(trainer.train_set), self.cfg.seed + 1)  # not the prompts' order

    def _length(self, i: int) -> int:
        """Tokens of demonstration i as trained on: answer + EOS, at most max_new_tokens."""
        if i not in self._lengths:
            answer = self.trainer.train_set[i].answer
            n = len(self.trainer.tokenizer(answer, add_special_tokens=False)["input_ids"]) + 1
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
        t, cfg = self.trainer, self.cfg
        rl_tokens = int(batch.response_mask.sum())
        picked = self.draw(rl_tokens)
        M = min(cfg.train.minibatches, len(picked))
        losses, norms, tokens = [], [], 0
        t.model.train()
        for part in torch.tensor(picked).tensor_split(M):
            demos = demonstration_batch(t.tokenizer, [t.train_set[i] for i in part.tolist()],
                                        t.device, max_new_tokens=cfg.rollout.max_new_tokens)
            loss = sft_loss(t.model, demos, chunk_size=cfg.train.logprob_chunk)
            norm = clipped_step(loss, t.model.parameters(), t.optimizer, t.scheduler,
                                cfg.train.grad_clip)
            losses.append(loss.detach())
            norms.append(norm.detach())
            tokens += int(demos.response_mask.sum())
        loss, norm = torch.stack([torch.stack(losses).mean(), torch.stack(norms).mean()]).tolist()
        return {"sft/loss": loss, "sft/tokens": tokens, "sft/rl_tokens": rl_tokens,
                "sft/demonstrations": len(picked), "optim/grad_norm": norm,
                "optim/lr": t.scheduler.get_last_lr()[0]}

    def state_dict(self) -> dict:
        return {"demo_cursor": self.cursor.state()}

    def save(self, path: Path) -> None:
        pass

    def load(self, path: Path, state: dict) -> None:
        self.cursor.load(state["demo_cursor"])


# ----------------------------------------------------------------------------- online DPO

class OnlineDPO:
    """Online DPO (arXiv 2305.18290's loss on on-policy pairs, as arXiv 2402.04792): from each
    group of G rollouts, the best-rewarded response is preferred to the worst-rewarded one; groups
    without a reward difference give no pair. Reference: the cold-start policy (the trainer's
    ``ref_model`` when ``train.beta > 0``, else a frozen copy taken at setup, before a resume
    restores the weights). Per step, M minibatch AdamW steps over the step's K ≤ P pairs.

    It replaces the policy-gradient update (``objective`` is None): no ratio, no clipping, no row
    skipping (only pair rows are ever forwarded). A response leaves the pairs when its reward was
    dropped (reward.on_error=drop) or its loss mask is empty (train.mask_truncated)."""

    objective = None

    def __init__(self, cfg):
        self.cfg = cfg

    def advantage_estimator(self) -> dict:
        return {"name": "none", "formula": "no advantages: DPO on each group's best-vs-worst "
                                           "reward pair"}

    def setup(self, trainer) -> None:
        _single_process(trainer, "dpo")
        self.trainer = trainer
        self.ref = trainer.ref_model or copy.deepcopy(trainer.model).eval().requires_grad_(False)

    def pairs(self, batch: RolloutBatch, rewards: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(winners [K], losers [K]) row indices on the host, and the loss mask [N, T]."""
        mask = self.trainer.loss_mask(batch)                                          # [N, T]
        usable = (mask > 0).any(-1) & torch.isfinite(rewards)                         # [N]
        scored = torch.where(usable, rewards.float(), torch.full_like(rewards.float(), float("nan")))
        win, lose = best_worst_pairs(scored.cpu(), self.cfg.rollout.group_size)
        return win, lose, mask

    def update(self, batch: RolloutBatch, rewards: Tensor, step: int) -> dict[str, float]:
        t, cfg = self.trainer, self.cfg
        win, lose, mask = self.pairs(batch, rewards)
        groups = len(rewards) // cfg.rollout.group_size
        out = {"dpo/pairs": len(win), "dpo/groups_without_pair": groups - len(win)}
        if not len(win):
            return {**out, "train/skipped": 1.0}
        rows = torch.cat([win, lose])                                                 # [2K] host
        with torch.no_grad():
            ref = sequence_logprobs(t._logprobs(self.ref, batch.select(rows), with_entropy=False).logp,
                                    mask[rows.to(mask.device)])                       # [2K]
        ref_w, ref_l = ref.chunk(2)                                                   # [K] each
        gen = torch.Generator().manual_seed(t.minibatch_seed(step))
        order = torch.randperm(len(win), generator=gen)
        collected: dict[str, list[Tensor]] = {}
        t.model.train()
        for part in order.tensor_split(min(cfg.train.minibatches, len(win))):
            sel = torch.cat([win[part], lose[part]])                                  # [2k] host
            logp = t._logprobs(t.model, batch.select(sel), with_entropy=False).logp    # [2k, T]
            seq_w, seq_l = sequence_logprobs(logp, mask[sel.to(mask.device)]).chunk(2)  # [k] each
            part_d = part.to(ref.device)
            loss, stats = dpo_loss(seq_w, seq_l, ref_w[part_d], ref_l[part_d], beta=cfg.dpo.beta)
            norm = clipped_step(loss, t.model.parameters(), t.optimizer, t.scheduler,
                                cfg.train.grad_clip)
            logged = {"dpo/loss": loss.detach(), "optim/grad_norm": norm.detach(),
                      **{f"dpo/{name}": x for name, x in stats.items()}}
            for key, x in logged.items():
                collected.setdefault(key, []).append(x.float())
        keys = list(collected)
        numbers = torch.stack([torch.stack(collected[k]).mean() for k in keys]).tolist()
        return {**out, **dict(zip(keys, numbers)), "optim/lr": t.scheduler.get_last_lr()[0]}

    def state_dict(self) -> dict:
        return {}

    def save(self, path: Path) -> None:
        pass

    def load(self, path: Path, state: dict) -> None:
        pass


# ----------------------------------------------------------------------------- registry

_REGISTRY = {"dpo": OnlineDPO, "ppo": PPO, "sft": SFTBaseline}


def names() -> list[str]:
    """Every valid ``objective.name``: the policy-loss registry plus the baselines here."""
    return sorted(set(objectives.available()) | set(_REGISTRY))


def get(name: str):
    """The algorithm class for ``objective.name``; ValueError listing the valid names."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in objectives.available():
        return GroupRelative
    raise ValueError(f"unknown objective {name!r}; valid: {', '.join(names())}")
