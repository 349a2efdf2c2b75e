"""Advantage estimators: group-relative advantages (GSPO paper Eq. 6, as GRPO) and a small registry.

Rewards [N] arrive as P consecutive groups of G responses to the same prompt (N = P·G); each
response is judged against its own group, never against the whole batch (see seeds/NOTES.md §1).
Groups are never split across ranks, so this runs locally on each rank.

This module deliberately is not: reward computation, filtering of zero-variance groups (the
trainer's `dynamic_sampling`), or GAE (no critic here yet).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

__all__ = ["SCALES", "available", "get", "group_advantages", "register"]

SCALES = ("group", "batch", "none")
"""What centred rewards are divided by: the group's std (Eq. 6), the batch's std, nothing."""

Estimator = Callable[..., Tensor]
_REGISTRY: dict[str, Estimator] = {}


def register(name: str) -> Callable[[Estimator], Estimator]:
    """Decorator: register an estimator `(rewards [N], group_size, **options) -> advantages [N]`."""

    def decorate(fn: Estimator) -> Estimator:
        _REGISTRY[name] = fn
        return fn

    return decorate


def available() -> list[str]:
    """Sorted names of the registered advantage estimators."""
    return sorted(_REGISTRY)


def get(name: str) -> Estimator:
    """The estimator `name`; ValueError listing the valid names if unknown."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {', '.join(available())}")
    return _REGISTRY[name]


@register("group")
def group_advantages(rewards: Tensor, group_size: int, *, scale: str = "group",
                     eps: float = 1e-6) -> Tensor:
    """Â_i = (r_i − mean_group(r)) / (std + eps), one vectorised pass over rewards.view(P, G).

    scale="group": std of the response's group, Bessel-corrected (GSPO Eq. 6; as TRL / verl).
    scale="batch": centre per group, divide by the Bessel-corrected std of all N rewards.
    scale="none":  centre per group only (Dr. GRPO, arXiv 2503.20783).
    A group whose rewards are all equal gets exactly 0 (no signal), whatever the scale.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N]; got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2 (a group needs a baseline); got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; valid: {', '.join(SCALES)}")
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32)).view(-1, group_size)  # [P, G]
    centred = r - r.mean(-1, keepdim=True)                            # [P, G] r − mean_group
    if scale == "group":
        centred = centred / (r.std(-1, keepdim=True) + eps)           # [P, G] / (std_group + eps)
    elif scale == "batch":
        centred = centred / (r.std() + eps)                           # [P, G] / (std_batch + eps)
    flat = (r == r[:, :1]).all(-1, keepdim=True)                      # [P, 1] zero-variance group
    return torch.where(flat, torch.zeros_like(centred), centred).view(-1)  # [N]
