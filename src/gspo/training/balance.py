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
4. the rows are exchanged on the CPU, all to all: each rank sends every other rank only the rows
   dealt to it (``Ranks.exchange_objects``), and each keeps its rows minibatch after minibatch,
   stacked to the widths of the rows it received: every per-row field (``ROW_FIELDS``), the
   completions, examples, episode records, correctness, rewards and advantages travel with their row.

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
    def exchange_objects(self, outgoing: list) -> list: ...


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
    wanted = [torch.cat([ranks_rows[r] for ranks_rows in dealt]) for r in range(ranks.world)]
    start = sum(len(share) for share in everyone[:ranks.rank])                # my first global row
    batch, rewards, advantages = exchange(ranks, batch, rewards, advantages, wanted, start, pad_id)
    mine = wanted[ranks.rank]
    local = list(torch.arange(len(mine)).split([len(rows[ranks.rank]) for rows in dealt]))
    return Dealt(batch, rewards, advantages, local, metrics)


def exchange(ranks: RankRows, batch: RolloutBatch, rewards: Tensor, advantages: Tensor,
             wanted: list[Tensor], start: int, pad_id: int) -> tuple[RolloutBatch, Tensor, Tensor]:
    """Rank r's rows ``wanted[r]`` (CPU, global rows: the ranks' rows in rank order, this rank's
    from ``start``), brought to it from the ranks that generated them, in ``wanted[r]``'s order:
    each rank sends each other rank only its rows (``Ranks.exchange_objects``); the pieces are
    stacked to their common prompt and response width (``concat_batches``)."""
    device, where = batch.input_ids.device, (rewards.device, advantages.device)
    n = len(rewards)
    cpu, rewards_cpu, advantages_cpu = on(batch, "cpu"), rewards.cpu(), advantages.cpu()
    outgoing = []
    for rows in wanted:
        ids = rows[(rows >= start) & (rows < start + n)]                    # mine among its rows
        local = ids - start
        outgoing.append((ids, rows_of(cpu, local), rewards_cpu[local], advantages_cpu[local]))
    pieces = [p for p in ranks.exchange_objects(outgoing) if len(p[0])]
    if not pieces:                                        # no rows dealt here
        return on(outgoing[ranks.rank][1], device), rewards[:0], advantages[:0]
    got = concat_batches([p[1] for p in pieces], pad_id)
    T = got.response_mask.shape[1]
    ids = torch.cat([p[0] for p in pieces])                                  # [n'] global, received
    position = {int(g): i for i, g in enumerate(ids)}
    order = torch.tensor([position[int(g)] for g in wanted[ranks.rank]], dtype=torch.long)
    kept = rows_of(got, order)
    all_rewards = torch.cat([p[2] for p in pieces])[order]                   # [n']
    all_advantages = torch.cat([widened(p[3], T) for p in pieces])[order]    # [n'] or [n', T]
    return on(kept, device), all_rewards.to(where[0]), all_advantages.to(where[1])


def rows_of(batch: RolloutBatch, index: Tensor) -> RolloutBatch:
    """Rows ``index`` of ``batch`` with their correctness (``select`` drops it)."""
    out = batch.select(index)
    out.correct = None if batch.correct is None else batch.correct[index]
    return out


def on(batch: RolloutBatch, device) -> RolloutBatch:
    """The batch with its per-row tensors on ``device`` (the correctness stays on the CPU)."""
    return dataclasses.replace(batch, **{name: getattr(batch, name).to(device)
                                         for name in ROW_FIELDS if getattr(batch, name) is not None})


def widened(advantages: Tensor, T: int) -> Tensor:
    """Per-token advantages [n, t] right-padded with 0 to T columns (per-row [n]: as they are)."""
    if advantages.dim() == 1:
        return advantages
    return torch.cat([advantages, advantages.new_zeros(len(advantages), T - advantages.shape[1])], 1)
