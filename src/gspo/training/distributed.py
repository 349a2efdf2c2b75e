"""Data parallelism over torch.distributed: K ranks compute the update of one process, exactly.

What it is: the plumbing behind ``torchrun --nproc_per_node K -m gspo train`` (docs/distributed.md),
in three parts by what they do:

* the ranks (``gspo.training.collectives.Ranks``): collectives, the batch's shares, the global
  normalisers, and metric reductions (each metric declares its own, ``gspo.observe.reductions``);
* the model's parallel wrapping (this module, ``Dist``: the ranks plus the wrapped model):
  ``wrap`` starts every rank from rank 0's weights, ``sync_grads`` SUMS gradients over ranks
  (each rank's loss is its part of the global loss, L_r = (1/N_glob) Σ_{i∈r} ℓ_i, so
  Σ_r ∇L_r = ∇L; torch's DDP would average them, i.e. divide by K), ``logprobs`` and
  ``full_params`` run forwards through the sharded model. Strategies: ``ddp`` (every rank holds
  the whole model; bucketed all-reduce after backward) and ``fsdp`` (FSDP2 ``fully_shard`` on
  every decoder layer and on ``PolicyForward``, the root whose forward is ``response_logprobs``;
  reduce-scatter sums: divide factor 1);
* distributed checkpoints (``gspo.training.dist_checkpoint``): rank 0 writes, fsdp's full state
  gathered first; a loaded state set on every rank.

``Dist`` extends ``Ranks`` rather than holding one because the step and the collector are handed
one object and see it through their own narrow Protocols (``Ranks`` in gspo.training.step,
``Shards`` in gspo.rollout.shares, ``Forwards`` in gspo.training.passes). One process (no
torchrun, or K = 1) is ``Dist()``: every helper returns its input or does what the trainer did
before, so single-process runs are bit-identical.

What it is not: a launcher (torchrun is), tensor / pipeline / sequence parallelism, or
communication overlapped with backward (the ``ddp`` all-reduce runs after it).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gspo.core.logprobs import decoder_and_head, response_logprobs
from gspo.training.collectives import Ranks

STRATEGIES = ("ddp", "fsdp")
BUCKET_NUMEL = 1 << 24
"""Gradient elements per all-reduce (64 MiB in float32)."""


def init_from_env(timeout_s: float = 1800.0) -> "Dist":
    """Join torchrun's process group (WORLD_SIZE > 1): NCCL for CUDA tensors, gloo for CPU ones."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        backend = "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            backend = "cpu:gloo,cuda:nccl"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return current()


def current() -> "Dist":
    """The ``Dist`` of the initialised process group, or of one process."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return Dist(rank=dist.get_rank(), world=dist.get_world_size())
    return Dist()


def shutdown(wait: bool = True) -> None:
    """Leave the process group; ``wait``: once every rank is done with it (a rank gone early can
    abort a peer still closing its connections). Not after an error: the others may be anywhere."""
    if dist.is_available() and dist.is_initialized():
        try:
            if wait:
                dist.barrier()
        finally:
            dist.destroy_process_group()


class PolicyForward(nn.Module):
    """FSDP root around a causal LM: ``forward`` is ``response_logprobs`` of the model, so the root's
    hooks gather the parameters no decoder layer owns (embeddings, final norm, head), which
    ``response_logprobs`` uses without calling the model's own ``forward``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return response_logprobs(self.model, *args, **kwargs)


@dataclass
class Dist(Ranks):
    """The ranks with the model wrapped across them (no-ops when world = 1)."""
    strategy: str = "ddp"
    policy: nn.Module | None = None
    """fsdp: the sharded ``PolicyForward`` around the trainer's model (None otherwise)."""

    # ------------------------------------------------------------------ gradients
    def sync_grads(self, model: nn.Module, loss: Tensor) -> Tensor:
        """Sum gradients over ranks; returns the summed (global) loss.

        Each rank's loss carries the GLOBAL normalisers, so the sum of the ranks' gradients is
        the single process's gradient (no division by K). A gradient that is None on every rank
        stays None (AdamW then leaves the parameter alone, as in one process). fsdp: the
        reduce-scatter in backward already summed them; only the loss is reduced here."""
        if not self.enabled:
            return loss
        params = [p for p in model.parameters() if p.requires_grad]
        if self.policy is not None:
            params = []                        # fsdp: only the loss
        head = torch.tensor([float(p.grad is not None) for p in params] + [0.0],
                            dtype=torch.float64, device=self.device)   # [has grad..., loss]
        head[-1] = loss.detach().to(self.device, torch.float64)
        dist.all_reduce(head)
        used = [p for p, f in zip(params, head[:-1].tolist()) if f > 0]
        for p in used:
            if p.grad is None:                 # unused here, used on another rank
                p.grad = torch.zeros_like(p)
        for bucket in buckets([p.grad for p in used]):
            flat = torch._utils._flatten_dense_tensors(bucket)
            dist.all_reduce(flat)
            for g, s in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
                g.copy_(s)
        return head[-1].to(loss.device, loss.dtype)

    def clip_grad_norm(self, params, max_norm: float) -> Tensor:
        """``clip_grad_norm_``; under fsdp the norm of the sharded gradients as a plain tensor."""
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    # ------------------------------------------------------------------ model
    def wrap(self, model: nn.Module, strategy: str = "ddp") -> None:
        """Make every rank start from rank 0's weights; fsdp: shard them (``self.policy``)."""
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown dist.strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")
        self.strategy = strategy
        if not self.enabled:
            return
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                on = t.data.to(self.device)
                dist.broadcast(on, src=0)
                t.data.copy_(on)
        if strategy == "fsdp":
            from torch.distributed.fsdp import FSDPModule, fully_shard
            decoder, _ = decoder_and_head(model)
            for layer in getattr(decoder, "layers", []):
                fully_shard(layer)
            self.policy = fully_shard(PolicyForward(model))
            for module in self.policy.modules():
                if isinstance(module, FSDPModule):
                    module.set_gradient_divide_factor(1.0)  # sum, not mean: global normalisers
                    module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
            # FSDP2 initialises from the first forward through its root; a generation (decoder
            # layers called directly) must not come first: one token through the root, no grad
            device = next(model.parameters()).device
            with torch.no_grad():
                self.policy(torch.ones(1, 2, dtype=torch.long, device=device),
                            torch.ones(1, 2, dtype=torch.long, device=device),
                            torch.ones(1, 1, device=device), with_entropy=False)
            self.policy.reshard()  # the root keeps its weights gathered after a forward: the
            # optimizer (built next) must hold the sharded parameters

    def logprobs(self, model: nn.Module, *args, **kwargs):
        """``response_logprobs``; the sharded model goes through its FSDP root."""
        if self.policy is not None and model is self.policy.model:
            # each decoder-layer call is a collective, so every rank must make the same calls:
            # no shared-prompt split (its extra prompt pass depends on the rank's rows)
            kwargs.pop("prompt_groups", None)
            out = self.policy(*args, **kwargs)
            if not torch.is_grad_enabled():  # no backward will reshard the root: do it now, so
                self.policy.reshard()        # the optimizer's shards are what the model holds
            return out
        return response_logprobs(model, *args, **kwargs)

    def weights(self, model: nn.Module) -> Mapping[str, Tensor]:
        """The model's weights by name, whole: its ``state_dict``; fsdp: each tensor gathered
        from the ranks' shards when it is read (``Gathered``), so a reader that takes them one at
        a time (an engine's weight sync) holds one whole tensor at once, never a second model.
        Every rank must read the same names in the same order (each read is a collective)."""
        state = model.state_dict()
        return Gathered(state) if self.policy is not None else state

    @contextlib.contextmanager
    def full_params(self):
        """fsdp: all parameters gathered on every rank for the block (generation, evaluation), so
        that forwards run without collectives, as many as each rank needs. Else nothing."""
        if self.policy is None:
            yield
            return
        from torch.distributed.fsdp import FSDPModule
        modules = [m for m in self.policy.modules() if isinstance(m, FSDPModule)]
        for m in modules:
            m.unshard()
        self.policy.set_reshard_after_forward(False)
        try:
            yield
        finally:
            self.policy.set_reshard_after_forward(True)
            for m in modules:
                m.reshard()


# ----------------------------------------------------------------------------- helpers

class Gathered(Mapping):
    """A sharded ``state_dict`` read as whole tensors: ``[name]`` all-gathers that DTensor
    (``full_tensor``, a collective), a plain tensor is returned as it is."""

    def __init__(self, state: Mapping[str, Tensor]):
        self.state = state

    def __getitem__(self, name: str) -> Tensor:
        t = self.state[name]
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    def __iter__(self):
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)


def buckets(tensors: list[Tensor], limit: int = BUCKET_NUMEL):
    """Consecutive groups of same-dtype, same-device tensors of at most ``limit`` elements."""
    bucket, size = [], 0
    for t in tensors:
        if bucket and (size + t.numel() > limit or t.dtype != bucket[0].dtype
                       or t.device != bucket[0].device):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += t.numel()
    if bucket:
        yield bucket
