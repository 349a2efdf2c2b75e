"""The decoupled ratio on a stale asynchronous batch, with π_prox arriving during the update.

Under ``rollout.async_ratio: decoupled`` a stale batch (sampled by version v, trained at step
k > v) is trained with π_old = π_prox, the trainer's weights at the start of step k, and the
rollout-mismatch correction weighs π_prox against the sampler's π_v (docs/math.md). Computing
π_prox costs a log-prob pass; here it costs the trainer nothing on top of its update:

* minibatch 1's π_prox is its own forward before the first optimizer step (the synchronous
  loop's on-policy first minibatch, ``OldLogprobs.minibatch(reused=True)``);
* the later minibatches' π_prox is computed by the rollout worker, which receives version k as
  step k starts, while the trainer runs minibatch 1 (``async_rollout.proximal_logp``): ``fill``
  waits for it once minibatch 2's forward has run (that forward does not read π_old);
* the correction is therefore taken per minibatch, on the rows it computes (``correct``): every
  registered correction is row-local, so each row gets the weight and mask it gets from the
  whole batch. Rows without a signal (no forward, Â = 0) are not corrected: their loss is 0
  whatever their weight, and under a masking correction they stay in the normalisers.
* the ``mismatch/*`` statistics cover the rows trained on (``metrics``), not every row.

Shapes: N rows, T response positions.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from gspo.core import correction
from gspo.observe import diagnostics


class LateProximal:
    """π_prox of a stale batch arriving from the worker, and the correction per minibatch."""

    def __init__(self, fetch: Callable, rollout_logp: Tensor, advantages: Tensor, mask: Tensor,
                 needed: Tensor | None, *, mode: str, params: dict, per_row: bool):
        self.fetch = fetch
        """Waits for the worker's π_prox: an object with rows [n] (CPU), logp [n, T], seconds."""
        self.needed = needed                                    # [n'] CPU: the plan's old rows
        self.rollout_logp = rollout_logp                        # [N, T] π_v, the sampler's
        self.mode, self.params, self.per_row = mode, params, per_row
        self.mask_before = mask.clone()                         # [N, T] the loss mask uncorrected
        token_level = not (per_row and advantages.dim() == 1)
        self.advantages = (advantages[:, None].expand_as(mask) if token_level and advantages.dim() == 1
                           else advantages).clone()            # [N] or [N, T], corrected per row
        self.seconds: dict | None = None                        # set once fetched

    def fill(self, old_logp: Tensor) -> None:
        """Write the worker's π_prox rows into ``old_logp`` [N, T] (waits the first time)."""
        if self.seconds is not None:
            return
        got = self.fetch()
        if self.needed is not None and not bool(torch.isin(self.needed, got.rows).all()):
            missing = self.needed[~torch.isin(self.needed, got.rows)].tolist()
            raise RuntimeError(f"async rollouts: the worker's π_prox lacks rows {missing[:8]} the "
                               "update needs (proximal_rows and the update plan disagree)")
        old_logp[got.rows.to(old_logp.device)] = got.logp.to(old_logp.dtype)
        self.seconds = got.seconds

    def correct(self, rows: Tensor, old_logp: Tensor, mask: Tensor) -> None:
        """Correct ``rows`` (device indices, their π_prox in ``old_logp``): their advantages are
        weighted, and ``mask`` [N, T] (the update's loss mask) takes the correction's mask."""
        if not len(rows):
            return
        out = correction.spec(self.mode).fn(old_logp[rows], self.rollout_logp[rows],
                                            self.mask_before[rows], **self.params)
        self.advantages[rows] = correction.weighted_advantages(
            self.advantages[rows], out.weight, self.mask_before[rows], per_row=self.per_row)
        mask[rows] = self.mask_before[rows] * out.mask.to(mask.dtype)

    def metrics(self, old_logp: Tensor, response_mask: Tensor, rows: Tensor) -> dict[str, float]:
        """mismatch/* of π_v against π_prox over ``rows`` (the rows trained on), the worker's
        seconds, as the synchronous correction logs them over every row."""
        out = {**(self.seconds or {})}
        if not len(rows):
            return out
        fix = correction.spec(self.mode).fn(old_logp[rows], self.rollout_logp[rows],
                                            self.mask_before[rows], **self.params)
        values = torch.stack(list(fix.stats.values())).tolist()
        out.update({f"mismatch/{k}": v for k, v in zip(fix.stats, values)})
        out.update(diagnostics.logprob_mismatch(self.rollout_logp[rows], old_logp[rows],
                                                response_mask[rows]))
        return out
