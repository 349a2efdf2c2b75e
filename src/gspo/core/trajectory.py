"""The trajectory batch: what every layer above reads of a rollout, as typed tensors (torch only).

One ``Trajectories`` is N token sequences, prompt tokens left-padded then response tokens
right-padded (docs/math.md, The rollout batch), with what the step learns about them on the way
to the optimizer: which samples' rewards failed (``dropped``), the experts π_old routed to
(``routing``, MoE), π_v's log-probs recomputed by an asynchronous worker (``behaviour_logp``),
the weights version that sampled them (``version``) and, set once by the step after the rewards
and the rollout correction, the **loss mask** (``loss_mask``).

Two masks, two jobs: ``response_mask`` is what the sampler generated (1 up to and including the
first EOS): the response columns' attention and the length |y_i|. ``loss_mask`` is what the
policy is trained on: the response mask without truncated responses (``train.mask_truncated``),
dropped samples, or tokens the rollout correction masks. A tool loop's observation tokens are
in neither: response 0 (the policy did not sample them; their columns still attend through
``attention_mask``), so loss 0 too, and |y_i| counts the policy's tokens only.

What it deliberately is not: text. Per-row metadata (decoded completions, the task's examples)
lives beside it in ``gspo.rollout.generate.RolloutBatch``, which extends it.
Shapes: N rows, L prompt + response columns, T response positions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import Tensor

ROW_FIELDS = ("input_ids", "attention_mask", "response_mask", "truncated", "rollout_logp",
              "behaviour_logp", "routing", "dropped", "loss_mask")
"""The per-row tensors (first dimension N) that ``select`` indexes."""

COLUMNS, RESPONSE, ROW = "columns", "response", "row"
ROW_LAYOUT = {"input_ids": COLUMNS, "attention_mask": COLUMNS, "routing": COLUMNS,
              "response_mask": RESPONSE, "rollout_logp": RESPONSE, "behaviour_logp": RESPONSE,
              "loss_mask": RESPONSE, "truncated": ROW, "dropped": ROW}
"""How each per-row field is laid out after its first dimension, so that batches of different
widths can be stacked: COLUMNS [N, L, ...] (prompt left-padded + response right-padded),
RESPONSE [N, T] (right-padded), ROW [N]."""


@dataclass
class Trajectories:
    """N sampled sequences and what the step has learnt about them (module docstring)."""
    input_ids: Tensor              # [N, L] prompt (left-padded) + response (right-padded)
    attention_mask: Tensor         # [N, L]
    response_mask: Tensor          # [N, T] float, 1 up to and including EOS: what was generated
    truncated: Tensor              # [N] bool, no EOS within max_new_tokens
    rollout_logp: Tensor | None = field(default=None, kw_only=True)
    """[N, T] the sampler's log-probs at the sampling temperature (None: not asked for)."""
    behaviour_logp: Tensor | None = field(default=None, kw_only=True)
    """[N, T] π_v, the sampling weights' log-probs recomputed on the trainer's policy copy by an
    asynchronous worker for a stale batch (rollout.async_ratio=behaviour); None otherwise."""
    routing: Tensor | None = field(default=None, kw_only=True)
    """[N, L, layers, k] the experts π_old routed each token to (MoE, captured at generation or
    by the old-log-prob pass, replayed under moe.routing_replay); None: not captured."""
    dropped: Tensor | None = field(default=None, kw_only=True)
    """[N] bool, samples whose reward failed under rewards.on_error=drop; None: none did."""
    loss_mask: Tensor | None = field(default=None, kw_only=True)
    """[N, T] the tokens that enter the loss, set once by the step after the rewards and the
    rollout correction (``scored_mask`` times the correction's mask); None before."""
    version: int | None = field(default=None, kw_only=True)
    """The weights version (RL steps done) that sampled the batch; None: the current one."""

    @property
    def response_ids(self) -> Tensor:
        return self.input_ids[:, -self.response_mask.shape[1]:]  # [N, T]

    @property
    def lengths(self) -> Tensor:
        return self.response_mask.sum(-1)  # [N]

    def rows(self, index: Tensor) -> dict:
        """The per-row fields of rows ``index`` (a LongTensor), by name (``select``'s parts)."""
        return {name: None if getattr(self, name) is None else getattr(self, name)[index]
                for name in ROW_FIELDS}

    def select(self, index: Tensor):
        """Rows ``index`` of every per-row field (a batch of the same type)."""
        return dataclasses.replace(self, **self.rows(index))


def dropped_rows(rewards: Tensor) -> Tensor | None:
    """[N] bool, the samples whose reward failed (NaN under rewards.on_error=drop); None: none."""
    dropped = ~torch.isfinite(rewards)                                     # [N]
    return dropped if bool(dropped.any()) else None


def scored_mask(batch: Trajectories, mask_truncated: bool) -> Tensor:
    """[N, T] the response tokens a scored batch may train on: not of a truncated response when
    ``mask_truncated``, nor of a dropped sample (before any rollout correction)."""
    mask = batch.response_mask
    if mask_truncated:
        mask = mask * (~batch.truncated).float().unsqueeze(-1)              # [N, T]
    if batch.dropped is not None:
        mask = mask * (~batch.dropped).float().unsqueeze(-1)                # [N, T]
    return mask


def row_lengths(batch: Trajectories) -> tuple[Tensor, Tensor]:
    """[N] CPU prompt tokens and response reach of each row (its columns up to its last response
    token, tool outputs between turns included): what a forward over it computes (one host sync)."""
    T = batch.response_mask.shape[1]
    prompt = batch.attention_mask[:, :-T].sum(-1)                                  # [N]
    cols = torch.arange(1, T + 1, device=batch.response_mask.device)
    reach = (batch.response_mask.bool() * cols).amax(-1)                           # [N]
    return prompt.cpu(), reach.cpu()
