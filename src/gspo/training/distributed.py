"""Data parallelism over torch.distributed: K ranks compute the update of one process, exactly.

What it is: the plumbing behind ``torchrun --nproc_per_node K -m gspo train`` (docs/distributed.md),
as one object, ``Dist``, that the trainer calls at a few points:

* shares of the batch: each rank generates a contiguous share of the step's P prompts
  (``shard``), so a prompt's G responses never leave their rank and group advantages stay local;
  the global batch is the ranks' rows concatenated in rank order, the single process's batch;
* minibatches: ``minibatch_rows`` draws the single process's shuffled partition of the GLOBAL
  batch (same seed; whole groups under train.minibatch_by=groups, a rank's share being whole
  groups) and keeps this rank's rows, so minibatch m on K ranks is the union over ranks
  of their shares and equals minibatch m of one process (a rank without rows in it runs one
  masked-out row, to stay in step);
* normalisers: ``global_counts`` all-reduces the minibatch's non-empty responses and response
  tokens for the objectives' ``num_seqs=`` / ``num_tokens=``. Each rank's loss is then its part
  of the global loss, L_r = (1/N_glob) Σ_{i∈r} ℓ_i, so Σ_r L_r = L and Σ_r ∇L_r = ∇L:
  ``sync_grads`` SUMS gradients over ranks (torch's DDP would average them, i.e. divide by K);
* metrics (``reduce_stats``, ``reduce_metrics``): losses summed, means weighted by each
  rank's rows / tokens, maxima and minima as such; rank 0 writes logs, reports and checkpoints
  (``on_main``, ``save_checkpoint``) and evaluates (``on_main``);
* strategies: ``ddp`` (every rank holds the whole model; bucketed all-reduce after backward) and
  ``fsdp`` (FSDP2 ``fully_shard`` on every decoder layer and on ``PolicyForward``, the root whose
  forward is ``response_logprobs``; reduce-scatter sums: divide factor 1).

One process (no torchrun, or K = 1) is ``Dist()``: every helper returns its input or does what
the trainer did before, so single-process runs are bit-identical.

What it is not: a launcher (torchrun is), tensor / pipeline / sequence parallelism, or
communication overlapped with backward (the ``ddp`` all-reduce runs after it).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gspo.core.logprobs import decoder_and_head, response_logprobs
from gspo.errors import UserError, WriteFailed
from gspo.rollout.collect import split_minibatches
from gspo.training import checkpoint

STRATEGIES = ("ddp", "fsdp")
RANK_SEED_STRIDE = 1 << 40
"""Rank r samples with seed(step) + r·stride: ranks draw different tokens; rank 0 the 1-process seed."""
BUCKET_NUMEL = 1 << 24
"""Gradient elements per all-reduce (64 MiB in float32)."""
SUMMED = ("policy/loss", "policy/kl_ref", "policy/log_ratio_clamped", "reward/errors",
          "train/rows_skipped")
"""Metrics that are each rank's part of a global value (global normalisers) or counts: summed."""
MAXED = ("reward/refill_rounds", "train/skipped")


def is_main() -> bool:
    """True in rank 0 (and in a single process): the one that writes files."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


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


def _told(err: Exception) -> tuple:
    """What the other ranks hear of rank 0's exception in ``on_main``: the user's errors and failed
    writes keep their kind (one line each), anything else is reported as a failure of rank 0."""
    if isinstance(err, WriteFailed):
        return "write", (err.what, str(err.path), err.reason)
    if isinstance(err, UserError):
        return "user", str(err)
    return "error", f"{type(err).__name__}: {err}"


@dataclass
class Dist:
    """This process's rank among ``world`` and the data-parallel helpers (no-ops when world = 1)."""
    rank: int = 0
    world: int = 1
    strategy: str = "ddp"
    policy: nn.Module | None = None
    """fsdp: the sharded ``PolicyForward`` around the trainer's model (None otherwise)."""

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        """Where collective tensors live: CUDA under NCCL, else CPU."""
        if "nccl" in str(dist.get_backend()):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # ------------------------------------------------------------------ collectives
    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on some rank."""
        if not self.enabled:
            return bool(flag)
        t = torch.tensor([int(bool(flag))], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def all(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on every rank."""
        return not self.any(not flag)

    def gather_objects(self, obj) -> list:
        """``obj`` of every rank, in rank order (picklable objects: small metadata only)."""
        if not self.enabled:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def on_main(self, fn: Callable):
        """``fn()`` run on rank 0 only; its result (or its exception) reaches every rank."""
        if not self.enabled:
            return fn()
        box: list = [None]
        if self.is_main:
            try:
                box[0] = ("ok", fn())
            except Exception as err:  # noqa: BLE001  re-raised below; the others hear of it
                dist.broadcast_object_list([_told(err)], src=0)
                raise
        dist.broadcast_object_list(box, src=0)
        status, value = box[0]
        if status == "user":              # e.g. the run folder is locked by another process:
            raise UserError(value)        # one line and exit 2 on every rank, as on rank 0
        if status == "write":             # a full disk under rank 0's checkpoint: exit 4 on all
            raise WriteFailed(value[0], Path(value[1]), value[2])
        if status == "error":
            raise RuntimeError(f"rank 0 failed: {value}")
        return value

    @contextlib.contextmanager
    def main_first(self):
        """Rank 0 runs the block first (e.g. fills a cache), then the others (which read it)."""
        if not self.enabled:
            yield
            return
        box = [False]
        if self.is_main:
            try:
                yield
                box[0] = True
            finally:
                dist.broadcast_object_list(box, src=0)
            return
        dist.broadcast_object_list(box, src=0)
        if not box[0]:
            raise RuntimeError("rank 0 failed first (its traceback says why)")
        yield

    def sizes(self, n: int) -> list[int]:
        """``n`` of every rank, in rank order."""
        if not self.enabled:
            return [n]
        out = [torch.zeros(1, dtype=torch.long, device=self.device) for _ in range(self.world)]
        dist.all_gather(out, torch.tensor([n], device=self.device))
        return [int(t.item()) for t in out]

    # ------------------------------------------------------------------ the batch
    def share(self, n: int) -> slice:
        """This rank's contiguous share of n items: the first n mod K ranks take one more."""
        base, extra = divmod(n, self.world)
        start = self.rank * base + min(self.rank, extra)
        return slice(start, start + base + (self.rank < extra))

    def shard(self, items: list) -> list:
        """This rank's share of the step's prompts (all of them in one process)."""
        return items if not self.enabled else items[self.share(len(items))]

    def seed(self, base: int) -> int:
        """Sampling seed of this rank: rank 0 keeps the single-process seed, the others differ."""
        return base + self.rank * RANK_SEED_STRIDE

    def minibatch_rows(self, n: int, m: int, generator: torch.Generator, group_size: int = 1
                       ) -> list[Tensor]:
        """This rank's rows of each of the m minibatches, as local indices.

        The partition is the single process's (``split_minibatches`` of the global batch, ranks'
        rows in rank order, whole groups of ``group_size`` dealt when it is > 1: every rank holds
        whole groups), restricted to rows [start, start + n) of this rank. A minibatch may hold
        no row of this rank (an empty index)."""
        if not self.enabled:
            return split_minibatches(n, m, generator, group_size)
        sizes = self.sizes(n)
        start, total = sum(sizes[:self.rank]), sum(sizes)
        parts = split_minibatches(total, m, generator, group_size)
        return [p[(p >= start) & (p < start + n)] - start for p in parts]

    def global_counts(self, mask: Tensor) -> dict[str, Tensor]:
        """``num_seqs`` / ``num_tokens`` of the minibatch over all ranks ({} in one process)."""
        if not self.enabled:
            return {}
        lengths = (mask > 0).sum(-1)                                     # [n] |y_i|
        counts = torch.stack([(lengths > 0).sum(), lengths.sum()]).to(self.device)  # int64
        dist.all_reduce(counts)
        counts = counts.to(mask.device)
        return {"num_seqs": counts[0], "num_tokens": counts[1]}

    @staticmethod
    def token_share(mask: Tensor, counts: dict) -> Tensor | float:
        """This rank's share of the minibatch's response tokens (1 in one process): weighs a loss
        that is a mean over local tokens (the MoE router loss) into a token-weighted mean over ranks."""
        if not counts:
            return 1.0
        return (mask > 0).sum() / counts["num_tokens"].clamp(min=1)

    def all_rewards(self, rewards: Tensor) -> tuple[Tensor, slice]:
        """(the rewards of every rank, in rank order [N_all], this rank's rows in them): for
        statistics over the whole batch (advantage.scale=batch). One process: its own, all of them."""
        if not self.enabled:
            return rewards, slice(None)
        sizes = self.sizes(len(rewards))
        padded = torch.full((max(sizes),), float("nan"), device=self.device)
        padded[:len(rewards)] = rewards.to(self.device, torch.float32)
        everyone = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(everyone, padded)
        full = torch.cat([t[:s] for t, s in zip(everyone, sizes)]).to(rewards.device)
        start = sum(sizes[:self.rank])
        return full, slice(start, start + len(rewards))

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
        for bucket in _buckets([p.grad for p in used]):
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

    def save_checkpoint(self, run_dir, step: int, model, tokenizer, optimizer, scheduler,
                        state: dict, keep: int, extra=None):
        """``checkpoint.save_checkpoint`` on rank 0 (fsdp: of the gathered full state)."""
        if not self.enabled:
            return checkpoint.save_checkpoint(run_dir, step, model, tokenizer, optimizer,
                                              scheduler, state, keep=keep, extra=extra)
        model_state = optimizer_state = None
        if self.policy is not None:
            model_state, optimizer_state = self._full_state(model, optimizer)
        return self.on_main(lambda: checkpoint.save_checkpoint(
            run_dir, step, model, tokenizer, optimizer, scheduler, state, keep=keep,
            model_state=model_state, optimizer_state=optimizer_state, extra=extra))

    def load_state(self, model, optimizer, weights: dict, optimizer_state: dict) -> None:
        """Load full weights and an optimizer state (``optimizer.state_dict()`` layout) on every rank."""
        if self.policy is None:
            model.load_state_dict(weights)
            optimizer.load_state_dict(optimizer_state)
            return
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             set_model_state_dict,
                                                             set_optimizer_state_dict)
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, weights, options=options)
        names = _param_names(model)
        fqn = {"state": {names[i]: v for i, v in optimizer_state["state"].items()},
               "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                                for g in optimizer_state["param_groups"]]}
        set_optimizer_state_dict(model, optimizer, fqn, options=options)

    def _full_state(self, model, optimizer) -> tuple[dict, dict]:
        """fsdp: full weights and optimizer state on rank 0 (CPU), optimizer in its id layout."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_model_state_dict,
                                                             get_optimizer_state_dict)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(model, options=options)
        optim = get_optimizer_state_dict(model, optimizer, options=options)
        if not self.is_main:
            return {}, {}
        index = {name: i for i, name in enumerate(_param_names(model))}
        optim = {"state": {index[k]: v for k, v in optim["state"].items()},
                 "param_groups": [{**g, "params": [index[k] for k in g["params"]]}
                                  for g in optim["param_groups"]]}
        return weights, optim

    # ------------------------------------------------------------------ metrics
    def reduce_metrics(self, metrics: dict, weight: float) -> dict:
        """Step metrics of every rank as one: counts summed, maxima / minima as such, a std pooled
        with its mean, a length bucket's stats weighted by its rows, other means by ``weight``
        (this rank's rows). Keys reported by some ranks only are reduced over those."""
        if not self.enabled:
            return metrics
        everyone = self.gather_objects((metrics, float(weight)))
        keys = list(dict.fromkeys(k for m, _ in everyone for k in m))
        out = {}
        for key in keys:
            present = [(m, w) for m, w in everyone if isinstance(m.get(key), (int, float))]
            mean_key = key[:-3] + "mean"
            if not present:
                out[key] = metrics.get(key)
            elif key.endswith("/std") and all(mean_key in m for m, _ in present):
                out[key] = _pooled_std([(m[key], m[mean_key], w) for m, w in present])
            else:
                out[key] = _combine(key, [(m[key], w * _bucket_share(m, key)) for m, w in present])
        return out

    def reduce_stats(self, stats: dict[str, Tensor], mask: Tensor,
                     sequence_level: bool) -> dict[str, Tensor]:
        """One minibatch's detached stats over ranks (``stats`` itself in one process): the loss
        and KL summed (each rank holds its part), grad_norm as is (the same on every rank),
        maxima / minima over ranks with rows, per-response stats (clip_frac_seqs, a sequence-level
        ratio) weighted by the rank's responses in ``mask`` [n, T], the others by its tokens."""
        if not self.enabled:
            return stats
        keys = list(stats)
        keep = mask > 0
        numbers = torch.stack([stats[k].detach().float().reshape(()) for k in keys]
                              + [keep.sum().float(), keep.any(-1).sum().float()]).tolist()
        everyone = self.gather_objects((dict(zip(keys, numbers[:-2])), *numbers[-2:]))
        per_seq = {"policy/clip_frac_seqs"} | ({"policy/ratio_mean"} if sequence_level else set())
        out = {}
        for key in dict.fromkeys(k for values, _, _ in everyone for k in values):
            rows = [(values[key], seqs if key in per_seq else tokens)
                    for values, tokens, seqs in everyone if key in values]
            out[key] = torch.tensor(_combine(key, rows), device=mask.device)
        return out


# ----------------------------------------------------------------------------- helpers

def _param_names(model: nn.Module) -> list[str]:
    """Names of the trained parameters in the optimizer's order (``build_optimizer``)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _buckets(tensors: list[Tensor], limit: int = BUCKET_NUMEL):
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


def _bucket_share(metrics: dict, key: str) -> float:
    """A length bucket's stat (``length/lo-hi/x``) is weighted by its rows: its ``frac``."""
    parent = key.rsplit("/", 1)[0]
    if key.startswith("length/") and not key.endswith("/frac") and parent + "/frac" in metrics:
        return float(metrics[parent + "/frac"])
    return 1.0


def _combine(key: str, rows: list[tuple[float, float]]) -> float:
    """One value from (value, weight) of each rank, by the kind of metric ``key`` names."""
    values = [v for v, _ in rows]
    if key in SUMMED:
        return sum(values)
    if key == "optim/grad_norm":             # of the summed gradient: the same on every rank
        return values[0]
    live = [v for v, w in rows if w > 0] or values   # a rank without rows reports placeholders
    if key.endswith("_max") or key.startswith("time/") or key in MAXED:
        return max(live)
    if key.endswith("_min"):
        return min(live)
    total = sum(w for _, w in rows)
    if total <= 0:
        return sum(values) / len(values)
    return sum(v * w for v, w in rows) / total


def _pooled_std(parts: list[tuple[float, float, float]]) -> float:
    """Bessel-corrected std of the union of the ranks' samples, from each rank's (std, mean, n)."""
    parts = [(s, m, n) for s, m, n in parts if n > 0]
    n = sum(k for _, _, k in parts)
    if n <= 1 or len(parts) == 1:
        return parts[0][0] if parts else float("nan")
    mean = sum(m * k for _, m, k in parts) / n
    sq = sum(((k - 1) * s * s if k > 1 else 0.0) + k * (m - mean) ** 2 for s, m, k in parts)
    return (sq / (n - 1)) ** 0.5
