"""Scoring a sampled batch: the run's rewards on its rows (with their episode records), the
failures counted, and the reward and response statistics of a step (``reward/*``,
``response/*``). It computes no advantages."""

from __future__ import annotations

import time

import torch

from gspo.rewards.isolation import correct_all
from gspo.rollout.generate import RolloutBatch


def score(rewards, batch: RolloutBatch, device) -> tuple[torch.Tensor, dict, dict]:
    """(rewards [N] on ``device``, per-source values, {time/reward_s, reward/errors}) of
    ``batch`` under the run's ``rewards`` (completions, examples, records) -> RewardResult."""
    t0 = time.perf_counter()
    result = rewards(batch.completions, batch.examples, batch.records)
    errors = 0 if result.errors is None else int(result.errors.sum())      # rewards.on_error
    counts = {"time/reward_s": time.perf_counter() - t0, "reward/errors": errors}
    return result.total.to(device), result.per_source, counts


def reward_stats(task, batch: RolloutBatch, rewards: torch.Tensor, per_source: dict,
                 group_size: int) -> dict:
    """reward/* and response/* of a scored batch; sets ``batch.correct`` [N] (task.is_correct)."""
    correct = correct_all(task, batch.completions, batch.examples)  # one hand-off
    batch.correct = torch.tensor(correct, dtype=torch.bool)   # [N], reused by the length slices
    rewards, lengths = rewards.cpu(), batch.lengths.cpu()     # host copies: no sync per .item()
    scored = rewards[rewards.isfinite()]  # rewards.on_error=drop marks dropped samples NaN
    stats = {
        "reward/mean": scored.mean().item(), "reward/std": scored.std().item(),
        "reward/accuracy": sum(correct) / len(correct),
        "reward/frac_zero_std_groups": (rewards.view(-1, group_size).std(-1) == 0).float().mean().item(),
        "response/length_mean": lengths.float().mean().item(),
        "response/length_max": lengths.max().item(),
        "response/truncated_frac": batch.truncated.cpu().float().mean().item(),
    }
    if len(per_source) > 1:
        stats.update({f"reward/{k}": v.nanmean().item() for k, v in per_source.items()})
    return stats
