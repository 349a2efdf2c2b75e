"""The ranks of a torchrun job: who they are, what they exchange, how the batch divides among them.

``Ranks`` (rank, world) is what every part of a data-parallel step asks of the other processes:

* collectives: ``any`` / ``all`` of a flag, ``gather_objects``, ``sizes``; ``on_main`` runs a
  function on rank 0 (logs, reports, checkpoints, evaluation) and hands its result, or its error,
  to every rank; ``main_first`` lets rank 0 fill a cache before the others read it;
* the batch's shares: each rank generates a contiguous share of the step's P prompts
  (``share`` / ``shard``), so a prompt's G responses never leave their rank and group advantages
  stay local; the global batch is the ranks' rows concatenated in rank order, the single
  process's batch. ``minibatch_rows`` draws the single process's shuffled partition of the
  GLOBAL batch and keeps this rank's rows, so minibatch m on K ranks is the union over ranks of
  their shares (a rank without rows in it runs one masked-out row, to stay in step); ``seed``
  gives each rank its own sampling seed;
* normalisers and reductions: ``global_counts`` all-reduces the minibatch's non-empty responses
  and response tokens for the objectives' ``num_seqs=`` / ``num_tokens=``, so each rank's loss is
  its part of the global loss; ``all_rewards`` gathers the rewards for batch statistics;
  ``reduce_metrics`` / ``reduce_stats`` gather each rank's numbers and reduce each metric as it
  declares (``gspo.observe.reductions``).

One process (no torchrun, or K = 1) is ``Ranks()``: every helper returns its input, so
single-process runs are bit-identical. The model's wrapping (``gspo.training.distributed``) and
distributed checkpoints (``gspo.training.dist_checkpoint``) build on this; it holds no model.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from gspo.errors import UserError, WriteFailed
from gspo.observe import reductions
from gspo.core.plan import split_minibatches

RANK_SEED_STRIDE = 1 << 40
"""Rank r samples with seed(step) + r·stride: ranks draw different tokens; rank 0 the 1-process seed."""


def _told(err: Exception) -> tuple:
    """What the other ranks hear of rank 0's exception in ``on_main``: the user's errors and failed
    writes keep their kind (one line each), anything else is reported as a failure of rank 0."""
    if isinstance(err, WriteFailed):
        return "write", (err.what, str(err.path), err.reason)
    if isinstance(err, UserError):
        return "user", str(err)
    return "error", f"{type(err).__name__}: {err}"


@dataclass
class Ranks:
    """This process's rank among ``world``, and what the ranks exchange (no-ops when world = 1)."""
    rank: int = 0
    world: int = 1

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

    def exchange_objects(self, outgoing: list) -> list:
        """All-to-all of picklable objects: ``outgoing[d]`` goes to rank d; returns what each rank
        sent here, in rank order (one scatter per rank: an object travels to its rank only)."""
        if not self.enabled:
            return list(outgoing)
        incoming = []
        for src in range(self.world):
            box = [None]
            dist.scatter_object_list(box, outgoing if self.rank == src else None, src=src)
            incoming.append(box[0])
        return incoming

    def on_main(self, fn: Callable, alongside: int = 1):
        """``fn()`` run on rank 0 only; its result (or its exception) reaches every rank.
        ``alongside`` > 1: ranks 1 .. alongside-1 run it too, in step with rank 0 (the ranks of
        one tensor-parallel engine, which generate together), and rank 0's result is kept."""
        if not self.enabled:
            return fn()
        box: list = [None]
        if not self.is_main and self.rank < alongside:
            fn()
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

    def group_share(self, n: int, size: int) -> slice:
        """The shares of n items of this rank's group of ``size`` consecutive ranks, together
        (ranks g·size .. (g+1)·size - 1: one tensor-parallel engine's); size 1: ``share``."""
        first = self.rank - self.rank % size
        return slice(Ranks(first, self.world).share(n).start,
                     Ranks(first + size - 1, self.world).share(n).stop)

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

    # ------------------------------------------------------------------ metrics
    def reduce_metrics(self, metrics: dict, weight: float) -> dict:
        """Step metrics of every rank as one, each reduced as it declares
        (``gspo.observe.reductions``; ``weight``: this rank's rows)."""
        if not self.enabled:
            return metrics
        return reductions.reduce_metrics(self.gather_objects((metrics, float(weight))), metrics)

    def reduce_stats(self, stats: dict[str, Tensor], mask: Tensor,
                     sequence_level: bool) -> dict[str, Tensor]:
        """One minibatch's detached stats over ranks (``stats`` itself in one process), each
        reduced as it declares, a mean weighted by the rank's tokens in ``mask`` [n, T], or by
        its responses for a per-response stat (``reductions.per_seq``)."""
        if not self.enabled:
            return stats
        keys = list(stats)
        keep = mask > 0
        numbers = torch.stack([stats[k].detach().float().reshape(()) for k in keys]
                              + [keep.sum().float(), keep.any(-1).sum().float()]).tolist()
        everyone = self.gather_objects((dict(zip(keys, numbers[:-2])), *numbers[-2:]))
        out = {}
        for key in dict.fromkeys(k for values, _, _ in everyone for k in values):
            by_seq = reductions.per_seq(key, sequence_level)
            rows = [(values[key], seqs if by_seq else tokens)
                    for values, tokens, seqs in everyone if key in values]
            out[key] = torch.tensor(reductions.combine(key, rows), device=mask.device)
        return out
