"""The policy's log-prob passes of one RL step, with their speed paths and MoE routing inside.

``LogprobPasses`` answers the three questions the step asks of the policy: π_old's log-probs of
the rollout batch (``old_logprobs``), π_θ's log-probs of one minibatch with gradient
(``minibatch``), and a frozen model's log-probs (``logprobs``: the reference policy, π_new for an
audit record, the critic's KL). What it hides from the step:

* **Speed paths** (exact, docs/results/performance/speed-paths.md): rows without signal skip their forward (they
  enter the loss with log π_θ = log π_old, ratio 1, Â = 0); the first minibatch's π_old is its own
  detached forward (π_θ = π_old before the first optimizer step); rows whose groups share a
  prompt run the prompt once; padding columns no response depends on are trimmed. Or, under
  ``train.pack_rows``, every pass runs its rows packed without padding
  (``gspo.core.packing.pack_rows``; a group's prompt packed once, when prompts may be shared).
* **MoE routing** (docs/moe.md): the experts π_old chose are captured in the old-log-prob pass,
  or at generation, and replayed when π_θ is computed (``moe.routing_replay``); otherwise they
  are captured for the routing metrics (``moe/*``) and the router's load-balancing loss. Stored
  per padded column [N, L]; a packed forward replays them laid out as its packed rows.
* **Tokens computed**: the update's forwards count the positions they computed and those the
  rows need (``take_tokens``, for ``perf/padding_frac``).
* **Ranks**: under FSDP a forward is a collective, so none is split or skipped per rank.

This module computes no loss; the step (``gspo.training.step``) does.
Shapes: N rows of the rollout batch, m rows of a minibatch, n of them computed, T response
positions, L prompt + response columns.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from gspo.core.logprobs import packing_honoured
from gspo.core.packing import PackedRows, pack_rows
from gspo.models import moe
from gspo.rollout.generate import RolloutBatch


class Forwards(Protocol):
    """How a log-prob forward runs on the ranks (gspo.training.distributed.Dist)."""

    policy: object
    """The FSDP root when the model is sharded (its forwards are collectives), else None."""

    def logprobs(self, model: torch.nn.Module, *args, **kwargs): ...


@dataclass
class Minibatch:
    """One minibatch of the update plan as this rank runs it."""
    idx: Tensor                 # [m] rows of the rollout batch (on the device)
    pos: Tensor                 # [n] positions within idx that get a forward (the others: no signal)
    host_idx: Tensor | None     # idx on the CPU (prompt sharing); None for a stand-in
    mask: Tensor                # [N, T] loss mask of the whole batch (zeros for a stand-in)
    live: bool                  # False: this rank has no row of it; one masked-out row keeps ranks in step

    @property
    def partial(self) -> bool:
        """Some rows skip the forward: parameters only they reach get a zero gradient."""
        return len(self.pos) < len(self.idx)


@dataclass
class MinibatchForward:
    """π_θ on the rows of one minibatch that get a forward, and what the MoE layers did."""
    logp: Tensor                # [n, T] log π_θ of the rows computed, with gradient
    entropy: Tensor | None      # [n, T] of the rows computed (None: no row computed)
    mask: Tensor | None         # [n, T] their loss mask
    stats: dict                 # moe/* routing metrics of the rows computed
    rows: RolloutBatch | None = None   # the rows computed
    capture: object = None      # their routing capture (MoE)

    def over(self, mb: Minibatch, old_logp: Tensor) -> Tensor:
        """[m, T] log π_θ of the whole minibatch, as the objective reads it: the rows computed,
        and the others (no signal, no forward) at their ``old_logp`` [m, T] (ratio 1)."""
        if len(mb.pos) == len(mb.idx):
            return self.logp
        return old_logp.index_copy(0, mb.pos.to(old_logp.device), self.logp)


class LogprobPasses:
    """The policy's log-prob passes (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, forwards: Forwards, *, temperature: float,
                 chunk_size: int, group_size: int, entropy_grad: bool, routing_replay: str,
                 aux_loss: bool, pack: bool = False, pack_length: int | None = None):
        self.model, self.forwards = model, forwards
        self.temperature, self.chunk_size, self.group_size = temperature, chunk_size, group_size
        self.entropy_grad, self.routing_replay, self.aux_loss = entropy_grad, routing_replay, aux_loss
        self.is_moe = moe.supports_moe(model)
        if routing_replay != "none" or aux_loss:
            moe.moe_layers(model)  # raises a clear ValueError for a model it cannot route
        self.split_forwards = not self.is_moe or (routing_replay == "none" and not aux_loss)
        """Whether a log-prob pass may run as a trimmed and prompt-shared set of forwards. MoE: only
        when the routing is just captured (its forwards are laid out again, ``cap.layout``), not
        replayed, nor needed in one piece for the aux loss."""
        self.pack, self.pack_length = pack, pack_length
        attn = str(getattr(model.config, "_attn_implementation", None) or "")
        self.pack_shared = not attn.startswith("flash")
        """Whether a packed pass may pack a group's prompt once (a 4D mask: not flash-attention)."""
        if pack:
            if aux_loss:
                raise ValueError("train.pack_rows does not work with moe.aux_loss_coef > 0 (the "
                                 "router loss averages over every attended column of padded rows)")
            if not self.pack_shared:  # varlen from position ids: one packed row only
                self.pack_length = None
            if not (packing_honoured(model, several_rows=self.pack_length is not None)
                    and (not self.pack_shared or packing_honoured(model, self.pack_length is not None,
                                                                  shared=True))):
                raise ValueError(f"train.pack_rows: {type(model).__name__} under attention {attn!r} "
                                 f"does not confine attention to each packed row; set it false")
        self.tokens = [0, 0]
        """Positions the update's forwards computed, and those their rows needed, since ``take_tokens``."""

    def packing(self, batch: RolloutBatch, rows: Tensor | None = None) -> PackedRows | None:
        """The packed layout of the batch's rows under ``train.pack_rows`` (one host sync), else
        None. ``rows`` (CPU, as in ``logprobs``): each group's prompt packed once, when prompts may
        be shared (not under routing replay or fsdp, nor flash-attention: it takes no 4D mask)."""
        if not self.pack:
            return None
        groups = self.prompt_groups(rows) if self.pack_shared else None
        return pack_rows(batch.attention_mask, batch.response_mask, self.pack_length, groups=groups)

    def prompt_groups(self, rows: Tensor | None) -> Tensor | None:
        """[n] the group of each of ``rows`` (CPU) when their groups may run each prompt once
        (``split_forwards``, not under fsdp), else None."""
        if rows is None or not self.split_forwards or self.forwards.policy is not None:
            return None
        return rows // self.group_size

    def take_tokens(self) -> tuple[int, int]:
        """(positions computed, positions needed) by the update's forwards since the last call."""
        computed, needed = self.tokens
        self.tokens = [0, 0]
        return computed, int(needed)

    def logprobs(self, model: torch.nn.Module, batch: RolloutBatch, with_entropy: bool = False,
                 rows: Tensor | None = None, packed: PackedRows | None = None):
        """``response_logprobs`` of ``model`` (through the FSDP root when sharded). ``rows``: the
        batch's rows in the rollout batch (CPU), whose groups of G share a prompt: each prompt then
        runs once (not under fsdp, whose forwards are collectives that every rank must run alike).
        Padding columns no response token depends on are trimmed. Both only when ``split_forwards``.
        Under ``train.pack_rows`` the rows run packed instead (``packed``, or laid out here), each
        group's prompt once under the same conditions."""
        if self.pack:
            layout = {"packed": packed if packed is not None else self.packing(batch, rows)}
        else:
            layout = {"prompt_groups": self.prompt_groups(rows), "trim": self.split_forwards}
        return self.forwards.logprobs(model, batch.input_ids, batch.attention_mask,
                                      batch.response_mask, temperature=self.temperature,
                                      chunk_size=self.chunk_size, with_entropy=with_entropy,
                                      entropy_grad=self.entropy_grad, **layout)

    def routing_context(self, batch: RolloutBatch, keep_logits: bool = False,
                        packed: PackedRows | None = None):
        """Replay the batch's stored experts when configured (laid out as ``packed`` rows when the
        forward is packed), else just capture (MoE) or nothing."""
        if self.routing_replay != "none" and batch.routing is not None:
            routing = batch.routing if packed is None else moe.packed_routing(batch.routing, packed)
            return moe.replay_routing(self.model, routing, keep_logits=keep_logits)
        if self.is_moe:
            return moe.capture_routing(self.model, keep_logits=keep_logits)
        return contextlib.nullcontext()

    def routed(self, batch: RolloutBatch, with_entropy: bool, rows: Tensor | None,
               keep_logits: bool = False):
        """The policy's ``logprobs`` inside ``routing_context``: (log-probs, the routing capture or
        None), the capture told which forwards ran (``layout``) so that ``cap.routing`` is laid out."""
        packed = self.packing(batch, rows)
        with self.routing_context(batch, keep_logits=keep_logits, packed=packed) as cap:
            out = self.logprobs(self.model, batch, with_entropy=with_entropy, rows=rows,
                                packed=packed)
        if cap is not None:
            cap.layout = out.layout
        return out, cap

    def new_logprobs(self, batch: RolloutBatch) -> Tensor:
        """[N, T] the policy's log-probs now, routed as in training, no gradient."""
        packed = self.packing(batch)
        with torch.no_grad(), self.routing_context(batch, packed=packed):
            return self.logprobs(self.model, batch, packed=packed).logp

    @torch.no_grad()
    def old_logprobs(self, batch: RolloutBatch, rows: Tensor | None = None) -> Tensor:
        """[N, T] log π_old recomputed on the rollout batch; ``rows`` (CPU, from the update plan):
        only these, the others stay 0 (filled by the first minibatch, or never read)."""
        if rows is None:
            sub = batch
        elif len(rows) == 0:
            return batch.response_mask.new_zeros(batch.response_mask.shape, dtype=torch.float32)
        else:
            sub = batch.select(rows.to(batch.input_ids.device))
        out, cap = self.routed(sub, with_entropy=False, rows=rows)
        logp = out.logp  # [n, T]
        if self.is_moe and batch.routing is None:
            store_routing(batch, rows, cap.routing)  # π_old's experts [N, L, layers, k]
        if rows is None:
            return logp
        return logp.new_zeros(batch.response_mask.shape).index_copy_(0, rows.to(logp.device), logp)

    def minibatch(self, batch: RolloutBatch, mb: Minibatch, *, as_old: bool) -> MinibatchForward:
        """π_θ of the rows ``mb.idx[mb.pos]`` with gradient. ``as_old``: the first minibatch,
        before any optimizer step, stands for π_old (its log-probs are written in by
        ``OldLogprobs.minibatch``); MoE: its experts become the batch's π_old experts."""
        host_rows = None if mb.host_idx is None else mb.host_idx[mb.pos]
        pos = mb.pos.to(mb.idx.device)
        rows = mb.idx if len(mb.pos) == len(mb.idx) else mb.idx[pos]
        if not len(rows):
            T = mb.mask.shape[1]
            return MinibatchForward(mb.mask.new_zeros((0, T), dtype=torch.float32), None, None, {})
        sub = batch.select(rows)
        out, cap = self.routed(sub, with_entropy=True, rows=host_rows, keep_logits=self.aux_loss)
        if mb.live and out.layout is not None:
            self.tokens = [self.tokens[0] + out.layout.tokens, self.tokens[1] + out.layout.needed]
        if as_old and self.is_moe and self.routing_replay == "none":
            store_routing(batch, rows, cap.routing)
            sub.routing = cap.routing
        stats = routing_stats(sub, cap) if self.is_moe else {}
        return MinibatchForward(out.logp, out.entropy, mb.mask[rows], stats, sub, cap)

    def router_loss(self, fwd: MinibatchForward) -> Tensor | None:
        """The router's load-balancing loss over the rows computed (None: off, or no row)."""
        if not (self.is_moe and self.aux_loss and fwd.capture is not None):
            return None
        return moe.router_aux_loss(self.model, fwd.capture.router_logits(), fwd.rows.attention_mask)


def store_routing(batch: RolloutBatch, rows: Tensor | None, routing: Tensor) -> None:
    """Put the experts of ``rows`` (None: all) into batch.routing [N, L, layers, k]."""
    if rows is None:
        batch.routing = routing
        return
    if batch.routing is None:
        batch.routing = routing.new_zeros((len(batch.input_ids), *routing.shape[1:]))
    batch.routing[rows.to(routing.device)] = routing


def routing_stats(sub: RolloutBatch, cap) -> dict:
    """Expert load of these rows and the share of (token, layer) whose top-k moved since π_old."""
    T = sub.response_mask.shape[1]
    old = sub.routing
    return moe.routing_metrics(moe.response_routing(cap.routing, T), sub.response_mask,
                               cap.num_experts,
                               old=None if old is None else moe.response_routing(old, T))
