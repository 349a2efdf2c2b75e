"""Which prompts of a step this rank samples, and with which seed (rank and tensor-parallel
arithmetic of collection).

One process samples all P prompts of a step with one seed per generation round
(``rollout_seed``). Under torchrun each rank samples its share (``Shards``: gspo.training's
``Dist``); how a share is seeded depends on the engine's capabilities, so that K ranks sample
exactly the batch of one process where the engine allows it: an engine that seeds each prompt on
its own (vllm) or generators on Ray get the round's seed offset by the share's first prompt;
otherwise each rank its own seed. An engine split over ranks (rollout.engine_tp) samples its
group's prompts together. Pure arithmetic: no engine, no model.
Shapes: P prompts per step, G responses per prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ContextManager, Mapping, Protocol

import torch

from gspo.rollout import engines


class Shards(Protocol):
    """What collection asks of the ranks (gspo.training.distributed.Dist; one process: trivial)."""

    world: int
    """Processes in the torchrun group (1 in one process)."""

    def share(self, n: int) -> slice: ...
    def group_share(self, n: int, size: int) -> slice: ...
    def shard(self, items: list) -> list: ...
    def seed(self, base: int) -> int: ...
    def all(self, flag: bool) -> bool: ...
    def full_params(self) -> ContextManager: ...
    def weights(self, model: torch.nn.Module) -> Mapping[str, torch.Tensor]: ...


def rollout_seed(run_seed: int, step: int, rnd: int = 0) -> int:
    """Sampling seed of generation round ``rnd`` of ``step`` (before a rank's own offset)."""
    return run_seed * 1_000_003 + step * 101 + rnd


@dataclass(frozen=True)
class RankShares:
    """This rank's prompts and seeds under ``rollout`` (the config section) and ``shards``."""

    rollout: object          # RolloutConfig: engine, placement, engine_tp, prompts_per_step
    run_seed: int
    shards: Shards

    def seed(self, step: int, rnd: int = 0) -> int:
        """This rank's sampling seed of round ``rnd`` of ``step`` (recorded for audits)."""
        base = rollout_seed(self.run_seed, step, rnd)
        r = self.rollout
        if engines.capabilities(r.engine).seeds_per_prompt or r.placement == "ray":
            return base + self.engine_share().start
        return self.shards.seed(base)

    def engine_group(self) -> int:
        """Ranks per engine: every rank for generators on Ray (rank 0 samples for them all),
        rollout.engine_tp for an engine with its own kernels (vllm), else 1."""
        r = self.rollout
        if r.placement == "ray":
            return self.shards.world
        return r.engine_tp if engines.capabilities(r.engine).own_kernels else 1

    def engine_share(self) -> slice:
        """The step's prompts this rank's engine samples: its own share, or with
        rollout.engine_tp > 1 its tensor-parallel group's (each rank then keeps its own rows)."""
        return self.shards.group_share(self.rollout.prompts_per_step, self.engine_group())

    def own(self) -> slice:
        """The step's prompts whose rows this rank keeps (and trains on)."""
        return self.shards.share(self.rollout.prompts_per_step)

    def own_rows(self, group_size: int) -> torch.Tensor:
        """[rows] the indices of this rank's own rows among those its engine sampled."""
        sampled, mine = self.engine_share(), self.own()
        return torch.arange((mine.start - sampled.start) * group_size,
                            (mine.stop - sampled.start) * group_size)
