"""Advantage estimators in a small registry: group-relative advantages (GSPO paper Eq. 6, as
GRPO) and RLOO's leave-one-out baseline, both reading NaN rewards as dropped samples; best-vs-worst
pairs of a group (online DPO); per-token GAE for PPO with a critic (`gae`, `whiten`).

Rewards [N] arrive as P consecutive groups of G responses to the same prompt (N = P·G); each
response is judged against its own group, never against the whole batch (docs/math.md). Groups
are never split across ranks, so only ``scale=batch`` needs the other ranks' rewards.

GAE (`gae`) is a pure function of per-token rewards, critic values and the response mask; the
critic itself, its loss and where rewards are placed live in `gspo.core.value` / `gspo.training.algorithms`.

This module deliberately is not: reward computation, filtering of zero-variance groups (the
trainer's `dynamic_sampling`), or a value model.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from gspo.registry import Registry

__all__ = ["GAE_FORMULA", "SCALES", "available", "best_worst_pairs", "default_scale", "formula",
           "gae", "get", "group_advantages", "register", "rloo_advantages", "whiten"]

SCALES = ("group", "batch", "none")
"""What centred rewards are divided by: the group's std (Eq. 6), the batch's std, nothing."""
DIVISORS = {"group": "std_group(r) + eps", "batch": "std_batch(r) + eps", "none": None}
"""What each scale divides the centred reward by (`formula`)."""
GAE_FORMULA = ("δ_t = r_t + γ V_t' − V_t; Â_t = δ_t + γλ Â_t'   (GAE, arXiv 1506.02438 Eq. 16; "
               "t' the next response token)")
"""`gae` in one line."""

Estimator = Callable[..., Tensor]
_REGISTRY: Registry[Estimator] = Registry("advantage estimator")
_DEFAULT_SCALE: dict[str, str] = {}
_CENTRED: dict[str, tuple[str, str]] = {}


def register(name: str, *, scale: str, centred: str | None = None, paper: str = ""
             ) -> Callable[[Estimator], Estimator]:
    """Decorator: register an estimator `(rewards [N], group_size, *, scale, eps) -> advantages [N]`
    with the `scale` its paper uses (what `advantage.scale` resolves to when left unset), its
    centred reward in one line (`formula`; left out: the docstring's first line) and citation."""

    def decorate(fn: Estimator) -> Estimator:
        _REGISTRY.add(name, fn)
        _DEFAULT_SCALE[name] = scale
        _CENTRED[name] = (centred or (fn.__doc__ or name).strip().splitlines()[0], paper)
        return fn

    return decorate


def formula(name: str, scale: str) -> str:
    """Estimator `name` at `scale` in one line, e.g. 'Â_i = (r_i − mean_group(r)) /
    (std_group(r) + eps)  [GSPO Eq. 6 ...]' (what a run's provenance.json records)."""
    get(name)
    (centred, paper), divisor = _CENTRED[name], DIVISORS[scale]
    body = f"({centred}) / ({divisor})" if divisor else centred
    return f"Â_i = {body}" + (f"  [{paper}]" if paper else "")


def default_scale(name: str) -> str:
    """The scale estimator `name` uses when `advantage.scale` is not given (its paper's)."""
    get(name)
    return _DEFAULT_SCALE[name]


available = _REGISTRY.names
"""Sorted names of the registered advantage estimators."""
get = _REGISTRY.get
"""The estimator `name`; ValueError listing the valid names if unknown."""


@register("group", scale="group", centred="r_i − mean_group(r)",
          paper="GSPO Eq. 6, arXiv 2507.18071; scale none: Dr. GRPO, arXiv 2503.20783")
def group_advantages(rewards: Tensor, group_size: int, *, scale: str = "group",
                     eps: float = 1e-6) -> Tensor:
    """Â_i = (r_i − mean_group(r)) / (std + eps), one vectorised pass over rewards.view(P, G).

    scale="group": std of the response's group, Bessel-corrected (GSPO Eq. 6; as TRL / verl).
    scale="batch": centre per group, divide by the Bessel-corrected std of all N rewards.
    scale="none":  centre per group only (Dr. GRPO, arXiv 2503.20783).
    A group whose rewards are all equal gets exactly 0 (no signal), whatever the scale.

    A NaN reward is a dropped sample (``rewards.on_error=drop``): it gets 0 and takes no part;
    each group's mean and std use only its remaining samples (``scale=batch``: all remaining
    samples), and a group left with fewer than 2 has no signal. Under data parallelism the batch
    std spans every rank: the caller passes the rewards of all ranks and keeps its own rows
    (``gspo.training.distributed.Dist.all_rewards``).
    """
    _check_groups(rewards, group_size)
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; valid: {', '.join(SCALES)}")
    valid = torch.isfinite(rewards)                                        # [N]
    if not bool(valid.all()):
        return _with_dropped(rewards, valid, group_size, scale, eps)
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32)).view(-1, group_size)  # [P, G]
    centred = r - r.mean(-1, keepdim=True)                            # [P, G] r − mean_group
    if scale == "group":
        centred = centred / (r.std(-1, keepdim=True) + eps)           # [P, G] / (std_group + eps)
    elif scale == "batch":
        centred = centred / (r.std() + eps)                           # [P, G] / (std_batch + eps)
    flat = (r == r[:, :1]).all(-1, keepdim=True)                      # [P, 1] zero-variance group
    return torch.where(flat, torch.zeros_like(centred), centred).view(-1)  # [N]


def _with_dropped(rewards: Tensor, valid: Tensor, group_size: int, scale: str, eps: float) -> Tensor:
    """``group_advantages`` over the samples with ``valid`` [N] set; the others get 0."""
    v = valid.view(-1, group_size).float()                                 # [P, G]
    r = torch.where(valid, rewards, torch.zeros_like(rewards)).view(-1, group_size).float()
    n = v.sum(-1, keepdim=True)                                            # [P, 1] remaining
    mean = (r * v).sum(-1, keepdim=True) / n.clamp(min=1)
    centred = (r - mean) * v                                               # [P, G]
    if scale == "group":
        std = ((centred ** 2).sum(-1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
        centred = centred / (std + eps)
    elif scale == "batch":
        kept = rewards[valid].float()
        std = kept.std() if kept.numel() > 1 else torch.zeros((), device=rewards.device)
        centred = centred / (std + eps)
    hi = torch.where(v > 0, r, torch.full_like(r, -math.inf)).amax(-1, keepdim=True)
    lo = torch.where(v > 0, r, torch.full_like(r, math.inf)).amin(-1, keepdim=True)
    flat = (hi == lo) | (n < 2)                                            # [P, 1] no signal
    return torch.where(flat, torch.zeros_like(centred), centred).view(-1)  # [N]


@register("rloo", scale="none", centred="r_i − mean_{j≠i} r_j",
          paper="RLOO, arXiv 2402.14740 Eq. 5")
def rloo_advantages(rewards: Tensor, group_size: int, *, scale: str = "none",
                    eps: float = 1e-6) -> Tensor:
    """RLOO: Â_i = r_i − mean_{j≠i} r_j, the mean of the OTHER responses of i's group as baseline
    (Kool et al. 2019; Ahmadian et al., arXiv 2402.14740, Eq. 5). Equals n/(n−1)·(r_i − mean_group).

    NaN rewards are dropped samples (rewards.on_error=drop): they take no part in any baseline and
    get 0; n is the number of scored samples of the group. A group with fewer than 2 scored
    samples, or with equal rewards, gets exactly 0. scale="none" (default, the paper's form), or
    "group": divided by the Bessel-corrected std of the group's scored rewards + eps.
    "batch" is not offered (its distributed std is the group estimator's). rewards: [N] → [N].
    """
    _check_groups(rewards, group_size)
    if scale not in ("none", "group"):
        raise ValueError(f"rloo takes scale none or group; got {scale!r}")
    valid = torch.isfinite(rewards).view(-1, group_size)                           # [P, G]
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    r = torch.where(valid, rewards.view(-1, group_size).to(dtype), torch.zeros((), dtype=dtype))
    n = valid.sum(-1, keepdim=True)                                                # [P, 1] scored
    others = (r.sum(-1, keepdim=True) - r) / (n - 1).clamp(min=1)                  # [P, G] mean_{j≠i}
    adv = r - others                                                               # [P, G] Â_i
    if scale == "group":
        mean = r.sum(-1, keepdim=True) / n.clamp(min=1)
        var = (torch.where(valid, r - mean, torch.zeros_like(r)) ** 2).sum(-1, keepdim=True)
        adv = adv / ((var / (n - 1).clamp(min=1)).sqrt() + eps)                   # / (std + eps)
    hi = torch.where(valid, r, torch.full_like(r, -math.inf)).amax(-1, keepdim=True)
    lo = torch.where(valid, r, torch.full_like(r, math.inf)).amin(-1, keepdim=True)
    silent = (hi == lo) | (n < 2) | ~valid                                         # [P, G] no signal
    return torch.where(silent, torch.zeros_like(adv), adv).view(-1)                # [N]


def best_worst_pairs(rewards: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """Online-DPO pairs: per group, the row of its best and of its worst reward (first on ties).

    Groups whose scored rewards are all equal (or with fewer than 2 scored) give no pair; NaN
    rewards (dropped samples) never enter one. Returns (winners [K], losers [K]), row indices
    into rewards [N], K ≤ P, in group order, on rewards' device.
    """
    _check_groups(rewards, group_size)
    r = rewards.view(-1, group_size).float()                                       # [P, G]
    valid = torch.isfinite(r)
    hi = torch.where(valid, r, torch.full_like(r, -math.inf))
    lo = torch.where(valid, r, torch.full_like(r, math.inf))
    keep = hi.amax(-1) > lo.amin(-1)                                               # [P] a difference
    offset = torch.arange(r.shape[0], device=r.device) * group_size                # [P] first row
    return (hi.argmax(-1) + offset)[keep], (lo.argmin(-1) + offset)[keep]


def _check_groups(rewards: Tensor, group_size: int) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N]; got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2 (a group needs a baseline); got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")


def gae(rewards_tok: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
        ) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2015, arXiv 1506.02438, Eq. 16) per token.

    Over the positions with mask 1, in order (t' = the next such position, none after the last):
      δ_t = r_t + γ V_t' − V_t                   (V after the last position = 0: the episode ends)
      Â_t = δ_t + γλ Â_t'                        returns R_t = Â_t + V_t (the critic's target)
    Positions with mask 0 are skipped (a value and advantage pass through them unchanged), so a mask
    with holes chains its unmasked tokens; right padding is the common case. Both outputs are 0
    where mask is 0. rewards_tok, values, mask: [N, T]; a backwards loop over T, vectorised over N.
    """
    if not rewards_tok.shape == values.shape == mask.shape or rewards_tok.dim() != 2:
        raise ValueError("rewards_tok, values and mask must share one [N, T] shape; got "
                         f"{tuple(rewards_tok.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}")
    dtype = torch.promote_types(values.dtype, torch.float32)
    r, v, keep = rewards_tok.to(dtype), values.detach().to(dtype), mask > 0      # [N, T]
    next_v = torch.zeros(r.shape[0], dtype=dtype, device=r.device)              # [N] V_t'
    next_a = torch.zeros_like(next_v)                                            # [N] Â_t'
    adv = torch.zeros_like(r)                                                    # [N, T]
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * next_v - v[:, t]                               # [N] δ_t
        a = delta + gamma * lam * next_a                                         # [N] Â_t
        m = keep[:, t]
        adv[:, t] = torch.where(m, a, torch.zeros_like(a))
        next_v = torch.where(m, v[:, t], next_v)                                 # skip mask 0
        next_a = torch.where(m, a, next_a)
    returns = torch.where(keep, adv + v, torch.zeros_like(adv))                  # [N, T] R_t
    return adv, returns


def whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x − mean) / sqrt(var + eps) over the tokens with mask 1 (Bessel-corrected var), 0 elsewhere.

    PPO's advantage normalisation over the whole batch of tokens (cleanrl `norm_adv`; TRL
    `masked_whiten`). values, mask: [N, T]."""
    keep = mask > 0
    x = values[keep]                                                             # [K]
    if x.numel() < 2:
        return torch.zeros_like(values)
    out = (values - x.mean()) * torch.rsqrt(x.var() + eps)                       # [N, T]
    return torch.where(keep, out, torch.zeros_like(out))
