"""The update plan of one RL step: its minibatches, and which rows need a forward pass.

Two savings, both exact for the update (same loss value and gradient):

* **On-policy first minibatch.** Before the first optimizer step π_θ = π_old, so the first
  minibatch's π_old log-probs are its own detached π_θ log-probs: the separate old-log-prob pass
  runs only on the rows of minibatches 2..M (none at all when M = 1). The first minibatch's ratio
  is then 1 bit for bit.
* **Rows without signal.** Every registered objective is proportional to the advantage (its loss
  and gradient are exactly 0 where Â = 0; tests/core/test_objectives.py pins this), and a row with an
  empty loss mask contributes nothing either. Such rows need neither π_old nor a forward/backward:
  they stay in the loss with log π_θ = log π_old (ratio 1), so counts and normalisers are unchanged.

The minibatches themselves are a seeded shuffled partition of the rows (``split_minibatches``,
``minibatch_seed``: whole groups kept together under train.minibatch_by=groups). Under torchrun
``deal_to_ranks`` deals each minibatch's units to the ranks by tokens (train.balance_ranks).
Index sets are CPU tensors: planning never waits on the device. Shapes: N rows, M minibatches.
What it is not: the loop. The trainer runs the plan (``Trainer.update``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class UpdatePlan:
    """Minibatches of one rollout batch and the rows that need computing."""

    minibatches: list[Tensor]
    """M shuffled index sets (CPU, long) partitioning range(N)."""
    trained: list[Tensor]
    """Per minibatch: positions within it (CPU, long) of the rows that get a forward/backward."""
    old_rows: Tensor | None
    """Rows (CPU, long) whose π_old log-probs the old-log-prob pass computes; None: all N."""
    reuse_first: bool
    """The first minibatch's π_old log-probs are taken from its own forward (no separate pass)."""

    @property
    def skipped(self) -> int:
        """Rows left out of the forward/backward (no signal)."""
        return sum(len(idx) - len(pos) for idx, pos in zip(self.minibatches, self.trained))


def live_rows(advantages: Tensor, mask: Tensor) -> Tensor:
    """[N] bool: rows with a non-zero advantage on some loss token (advantages [N] or [N, T], mask [N, T])."""
    adv = advantages if advantages.dim() == 2 else advantages[:, None]         # [N, T] or [N, 1]
    return ((adv != 0) & (mask > 0)).any(-1)                                    # [N]


def plan_update(minibatches: list[Tensor], live: Tensor | None, *, reuse_first: bool) -> UpdatePlan:
    """The plan for ``minibatches`` (CPU index sets); ``live`` [N] CPU bool, None: train every row."""
    trained = [torch.arange(len(idx)) if live is None else live[idx].nonzero().squeeze(-1)
               for idx in minibatches]
    if live is None and not reuse_first:
        return UpdatePlan(minibatches, trained, None, False)
    later = minibatches[1:] if reuse_first else minibatches
    later_pos = trained[1:] if reuse_first else trained
    rows = [idx[pos] for idx, pos in zip(later, later_pos)]
    old_rows = torch.cat(rows).sort().values if rows else torch.zeros(0, dtype=torch.long)
    return UpdatePlan(minibatches, trained, old_rows, reuse_first)


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


def deal_to_ranks(parts: list[Tensor], tokens: Tensor, world: int, unit: int = 1
                  ) -> list[list[Tensor]]:
    """Each minibatch's units dealt to ``world`` ranks by tokens: [M][K] CPU global rows.

    ``parts``: the minibatches as global row indices (``split_minibatches``: whole units of
    ``unit`` consecutive rows); ``tokens`` [N] CPU: each row's tokens. A minibatch's units go
    longest first to the rank holding the fewest of its tokens so far (ties: the fewest tokens of
    the step so far, then the lowest rank), so every unit is dealt once, no rank exceeds the
    minibatch's mean load by more than its longest unit, and while some rank holds nothing of the
    step the next unit goes to one such rank (with at least K units, every rank gets rows). A
    rank's rows keep their order in the minibatch."""
    step_load = [0] * world
    dealt = []
    for part in parts:
        units = part.view(-1, unit)                                            # [u, unit]
        sizes = tokens[units].sum(-1).tolist()                                 # [u]
        load, mine = [0] * world, [[] for _ in range(world)]
        for u in sorted(range(len(sizes)), key=lambda u: -sizes[u]):       # stable: ties in order
            r = min(range(world), key=lambda r: (load[r], step_load[r]))
            mine[r].append(u)
            load[r] += sizes[u]
            step_load[r] += sizes[u]
        dealt.append([units[sorted(us)].reshape(-1) if us else part.new_zeros(0) for us in mine])
    return dealt


def owned_rows(parts: list[Tensor], sizes: list[int]) -> list[list[Tensor]]:
    """[M][K] CPU global rows of each minibatch that rank r holds when the ranks hold contiguous
    shares of ``sizes`` rows each, in rank order (no dealing: the rows stay where generated)."""
    bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
    return [[p[(p >= lo) & (p < hi)] for lo, hi in zip(bounds, bounds[1:])] for p in parts]


def max_over_mean(dealt: list[list[Tensor]], tokens: Tensor) -> float:
    """Of each minibatch, the most tokens a rank holds over the ranks' mean (1: balanced; K: one
    rank holds all), averaged over the minibatches with tokens ([M][K] rows, ``tokens`` [N])."""
    ratios = []
    for ranks in dealt:
        loads = torch.stack([tokens[rows].sum() for rows in ranks]).double()    # [K]
        if loads.sum() > 0:
            ratios.append(float(loads.max() / loads.mean()))
    return sum(ratios) / len(ratios) if ratios else 1.0


def minibatch_seed(run_seed: int, step: int) -> int:
    """Seed of the minibatch split of ``step`` (the policy's and PPO's critic's)."""
    return run_seed * 7 + step


# ------------------------------------------------------------------------- tokens computed
# A forward over rows pads each to the longest prompt (left) and the longest response (right) among
# them (the columns no row uses are trimmed, gspo.core.logprobs.trim_columns): about rows × (max
# prompt + max response) tokens, the budget's measure. What the passes computed is counted by the
# forwards themselves (gspo.core.logprobs.DecoderLayout.tokens, perf/padding_frac).


def forward_tokens(prompt_lens: Tensor, response_lens: Tensor) -> int:
    """Tokens one forward over these rows computes, padding included ([n] CPU lengths)."""
    if not len(prompt_lens):
        return 0
    return len(prompt_lens) * int(prompt_lens.max() + response_lens.max())


def token_microbatches(prompt_lens: Tensor, response_lens: Tensor, budget: int) -> list[Tensor]:
    """Positions (CPU, long) of n rows ([n] CPU lengths) grouped by length into micro-batches of
    at most ``budget`` computed tokens each (``forward_tokens``; a row longer than the budget
    alone): rows sorted by prompt + response length, longest first, each micro-batch filled
    greedily. Every position in exactly one; fewer when the lengths are alike."""
    order = torch.argsort(prompt_lens + response_lens, descending=True, stable=True)
    groups, current, p_max, r_max = [], [], 0, 0
    for i in order.tolist():
        p, r = max(p_max, int(prompt_lens[i])), max(r_max, int(response_lens[i]))
        if current and (len(current) + 1) * (p + r) > budget:
            groups.append(torch.tensor(current))
            current, p, r = [], int(prompt_lens[i]), int(response_lens[i])
        current.append(i)
        p_max, r_max = p, r
    if current:
        groups.append(torch.tensor(current))
    return groups
