"""Ranks balanced by tokens under torchrun (``train.balance_ranks``): which rows each rank trains.

Each rank generates a contiguous share of the step's prompts and computes its groups' advantages
(a group never splits). Left there, a minibatch holds different numbers of tokens on different
ranks and the slowest rank paces the gradient all-reduce. So, right after the advantages and
before π_old (``deal``):

1. every rank's per-row tokens (prompt + response reach: what a forward over the row computes,
   ``row_lengths``) are all-gathered;
2. every rank draws the single process's minibatch partition of the global batch (the same seed,
   ``split_minibatches``, whole groups: ``train.minibatch_by=groups``);
3. each minibatch's groups are dealt to the ranks longest first onto the lightest rank
   (``gspo.core.plan.deal_to_ranks``), whole: a rank's rows stay G-aligned groups, which the
   log-prob passes read a row's prompt group from (``LogprobPasses.prompt_groups``);
4. the ranks' batches are exchanged (on the CPU, one ``all_gather_object``) and each keeps the rows
   dealt to it, minibatch after minibatch: every per-row field (``ROW_FIELDS``), the completions,
   examples, episode records, correctness, rewards and advantages travel with their row.

Everything after it (π_old, the update, the length slices, the samples) runs on the dealt rows;
``Dealt.minibatches`` are the local rows of each minibatch. Minibatch m holds the same rows as
the single process's minibatch m, and the normalisers are global (``Ranks.global_counts``), so the
loss and gradient are the single process's up to float rounding. One process: nothing happens
(no metric, no exchange). Refused at set-up (``gspo.config.resolve.balance_refusal``) under
``rollout.async`` (the worker computes π_prox for the rows its own rank generated) and
``train.minibatch_by=rows`` (a group's rows would scatter).

Metrics (the same on every rank): ``perf/rank_tokens_max_over_mean``, of each minibatch the most
tokens a rank holds over the ranks' mean, averaged over minibatches (1: balanced), and
``perf/rank_tokens_max_over_mean_unbalanced``, the same for the contiguous shares (none: both are
that of the shares). Shapes: N rows, T response positions, M minibatches, K ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from gspo.core.plan import deal_to_ranks, max_over_mean, owned_rows, split_minibatches
from gspo.core.trajectory import ROW_FIELDS, row_lengths
from gspo.rollout.collect import concat_batches
from gspo.rollout.generate import RolloutBatch


class RankRows(Protocol):
    """What dealing asks of the ranks (gspo.training.collectives.Ranks)."""

    rank: int
    world: int

    @property
    def enabled(self) -> bool: ...
    def gather_objects(self, obj) -> list: ...


@dataclass
class Dealt:
    """This rank's rows of the step once dealt, and how the minibatches lie in them."""
    batch: RolloutBatch
    rewards: Tensor                         # [N'] of the rows dealt here
    advantages: Tensor                      # [N'] or [N', T]
    minibatches: list[Tensor] | None
    """M local index sets (CPU, long), minibatch m's rows here; None: not dealt (the plan draws
    the minibatches of the rows generated here, ``Ranks.minibatch_rows``)."""
    metrics: dict


def deal(ranks: RankRows, batch: RolloutBatch, rewards: Tensor, advantages: Tensor, *,
         minibatches: int, seed: int, unit: int, pad_id: int, balance: bool) -> Dealt:
    """The rows this rank trains (module docstring): those dealt to it by tokens when
    ``balance``, else those it generated (the imbalance measured all the same under torchrun).
    ``seed``: the step's minibatch seed; ``unit``: rows dealt together (G or 1)."""
    if not ranks.enabled:
        return Dealt(batch, rewards, advantages, None, {})
    prompt, reach = row_lengths(batch)
    everyone = ranks.gather_objects((prompt + reach).tolist())                  # K x [n_r]
    tokens = torch.tensor([t for share in everyone for t in share], dtype=torch.long)   # [N]
    parts = split_minibatches(len(tokens), minibatches, torch.Generator().manual_seed(seed), unit)
    shares = max_over_mean(owned_rows(parts, [len(share) for share in everyone]), tokens)
    metrics = {"perf/rank_tokens_max_over_mean_unbalanced": shares,
               "perf/rank_tokens_max_over_mean": shares}
    if not balance:
        return Dealt(batch, rewards, advantages, None, metrics)
    dealt = deal_to_ranks(parts, tokens, ranks.world, unit)
    metrics["perf/rank_tokens_max_over_mean"] = max_over_mean(dealt, tokens)
    mine = [ranks_rows[ranks.rank] for ranks_rows in dealt]                  # M x [m_r] global
    batch, rewards, advantages = exchange(ranks, batch, rewards, advantages, torch.cat(mine), pad_id)
    local = list(torch.arange(len(rewards)).split([len(rows) for rows in mine]))
    return Dealt(batch, rewards, advantages, local, metrics)


def exchange(ranks: RankRows, batch: RolloutBatch, rewards: Tensor, advantages: Tensor,
             rows: Tensor, pad_id: int) -> tuple[RolloutBatch, Tensor, Tensor]:
    """Rows ``rows`` (CPU, of the global batch: the ranks' rows in rank order) of every rank's
    (batch, rewards, advantages), brought here: the batches travel whole, on the CPU, and are
    stacked to a common prompt and response width (``concat_batches``)."""
    device, where = batch.input_ids.device, (rewards.device, advantages.device)
    everyone = ranks.gather_objects((on(batch, "cpu"), rewards.cpu(), advantages.cpu()))
    whole = concat_batches([b for b, _, _ in everyone], pad_id)
    kept = whole.select(rows)
    kept.correct = None if whole.correct is None else whole.correct[rows]      # (select drops it)
    T = whole.response_mask.shape[1]
    all_rewards = torch.cat([r for _, r, _ in everyone])                       # [N]
    all_advantages = torch.cat([widened(a, T) for _, _, a in everyone])        # [N] or [N, T]
    return on(kept, device), all_rewards[rows].to(where[0]), all_advantages[rows].to(where[1])


def on(batch: RolloutBatch, device) -> RolloutBatch:
    """The batch with its per-row tensors on ``device`` (the correctness stays on the CPU)."""
    return dataclasses.replace(batch, **{name: getattr(batch, name).to(device)
                                         for name in ROW_FIELDS if getattr(batch, name) is not None})


def widened(advantages: Tensor, T: int) -> Tensor:
    """Per-token advantages [n, t] right-padded with 0 to T columns (per-row [n]: as they are)."""
    if advantages.dim() == 1:
        return advantages
    return torch.cat([advantages, advantages.new_zeros(len(advantages), T - advantages.shape[1])], 1)
