"""Rollout-mismatch corrections: a registry of pure functions of log-prob tensors.

When the model that samples (π_rollout: an inference engine, or the policy in a lower precision)
is not the model that trains, the log-probs it reports differ from the trainer's recomputed π_old
for the very same tokens. Each correction turns the per-token log ratio

    δ_t = log π_old(y_t) − log π_rollout(y_t),      ρ_t = exp(δ_t)   (= π_old / π_rollout)

into a per-token importance weight (detached; it multiplies the policy loss of the token) and a
per-token mask (0: the token leaves the loss, its normalisers included). Every correction has the
signature

    fn(old_logp, rollout_logp, mask, **params) -> Correction

with `old_logp`, `rollout_logp`, `mask` of shape [N, T] (mask: the tokens that enter the loss;
values under mask 0 are never read). The stats (detached scalars, logged as ``mismatch/*``) are
over the tokens of `mask`, before the correction's own mask:

* ``kl``: the k3 estimate of KL(π_rollout ‖ π_old) per token, ρ − δ − 1 ≥ 0, mean over tokens;
* ``ratio_min`` / ``ratio_max``: of the ratio the correction acts on (ρ_t for token-level ones,
  the geometric mean ρ_i of a response for sequence-level ones; ρ_t for ``none``);
* ``masked_frac``: share of the tokens the correction masks out;
* ``is_weight_mean``: mean weight over the tokens it keeps;
* ``ratio_above_2_frac`` / ``ratio_below_half_frac``: share of the tokens whose ρ_t > 2 / < 1/2
  (the crash precursor the R3 paper reports: > 10% of tokens beyond 2x at the crash).

The formulas: docs/math.md ("Rollout-mismatch correction"). This module never calls ``.item()``.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping

import torch
from torch import Tensor

from gspo.core.objectives import LOG_RATIO_LIMIT, kl_k3, masked_mean
from gspo.registry import Registry

__all__ = ["Correction", "CorrectionSpec", "available", "ratio_tails", "register", "spec", "weighted_advantages"]


@dataclass
class Correction:
    """What a correction returns: weight and mask [N, T] (detached) and detached stats."""

    weight: Tensor
    """[N, T] importance weight per token (1 where nothing is corrected; constant along a row for
    sequence-level corrections)."""
    mask: Tensor
    """[N, T] 1 keeps the token in the loss, 0 drops it (and it leaves the loss's normalisers)."""
    stats: dict[str, Tensor]
    """kl, ratio_min, ratio_max, masked_frac, is_weight_mean, ratio_above_2_frac, ratio_below_half_frac (unprefixed)."""


@dataclass(frozen=True)
class CorrectionSpec:
    """One registered correction: its callable (defaults bound) and its kind."""

    name: str
    fn: Callable[..., Correction]
    defaults: Mapping[str, float]
    """Its parameters and their defaults (cap | low, high)."""
    per_token: bool
    """True when the weight varies along a response (a token-level weight; an objective with one
    ratio per response takes its mean over the response, see `weighted_advantages`)."""


_REGISTRY: Registry[CorrectionSpec] = Registry("rollout correction")


def register(name: str, *, per_token: bool, **defaults: float):
    """Decorator: register `fn` as the correction `name` with its parameter defaults."""

    def decorate(fn: Callable[..., Correction]) -> Callable[..., Correction]:
        params = {p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY}
        if params != set(defaults):
            raise TypeError(f"{name}: defaults {sorted(defaults)} must name its parameters {sorted(params)}")

        def with_defaults(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, **kwargs) -> Correction:
            given = {k: v for k, v in kwargs.items() if k in defaults and v is not None}
            return fn(old_logp, rollout_logp, mask, **{**defaults, **given})

        with_defaults.__doc__ = fn.__doc__
        _REGISTRY.add(name, CorrectionSpec(name, with_defaults, MappingProxyType(dict(defaults)), per_token))
        return with_defaults

    return decorate


available = _REGISTRY.names
"""Sorted names of the registered corrections ('none' among them)."""
spec = _REGISTRY.get
"""The `CorrectionSpec` of `name`; ValueError listing the valid names if unknown."""


# ----------------------------------------------------------------------------- shared pieces

def _token_log_ratio(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> Tensor:
    """[N, T] δ_t = log π_old − log π_rollout, detached, 0 under mask 0, clamped to ±LOG_RATIO_LIMIT."""
    d = (old_logp.detach() - rollout_logp.detach()).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.where(mask > 0, d, torch.zeros_like(d))


def _seq_log_ratio(delta: Tensor, mask: Tensor) -> Tensor:
    """[N] log of the geometric-mean ratio of each response, (1/|y_i|) Σ_t m_t δ_t (0 if empty)."""
    return masked_mean(delta, mask, dim=-1)


def _stats(delta: Tensor, acted: Tensor, where: Tensor, weight: Tensor, keep: Tensor,
           mask: Tensor) -> dict[str, Tensor]:
    """The mismatch stats; ``acted`` holds the ratios the correction looked at, counted ``where``."""
    m = (mask > 0).to(delta.dtype)
    big, one = torch.finfo(acted.dtype).max, torch.ones((), dtype=acted.dtype, device=acted.device)
    kept = m * keep
    low = torch.where(where, acted, torch.full_like(acted, big)).min()
    high = torch.where(where, acted, torch.full_like(acted, -big)).max()
    return {
        "kl": masked_mean(kl_k3(-delta, torch.zeros_like(delta)), m),     # ρ − δ − 1 (k3)
        "ratio_min": torch.where(where.any(), low, one),                   # 1 when nothing counts
        "ratio_max": torch.where(where.any(), high, one),
        "masked_frac": (m - kept).sum() / m.sum().clamp(min=1),
        "is_weight_mean": masked_mean(weight, kept),
        **ratio_tails(delta, m),
    }


LOG_TWO = math.log(2.0)


def ratio_tails(delta: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Share of the tokens of ``mask`` whose ρ_t = exp(δ_t) is beyond 2 either way (δ [N, T])."""
    m = (mask > 0).to(delta.dtype)
    count = m.sum().clamp(min=1)
    return {"ratio_above_2_frac": (m * (delta > LOG_TWO)).sum() / count,
            "ratio_below_half_frac": (m * (delta < -LOG_TWO)).sum() / count}


def _token_result(delta: Tensor, weight: Tensor, keep: Tensor, mask: Tensor) -> Correction:
    """A token-level correction: stats over ρ_t of the loss tokens."""
    rho = delta.exp()
    return Correction(weight, keep, _stats(delta, rho, mask > 0, weight, keep, mask))


def _seq_result(delta: Tensor, rho_seq: Tensor, weight_seq: Tensor, keep_seq: Tensor,
                mask: Tensor) -> Correction:
    """A sequence-level correction: per-response weight and mask [N] spread over the row."""
    weight = weight_seq[:, None].expand_as(delta).contiguous()              # [N, T]
    keep = keep_seq[:, None].expand_as(delta).to(delta.dtype).contiguous()  # [N, T]
    present = (mask > 0).any(-1)                                            # [N] non-empty rows
    return Correction(weight, keep, _stats(delta, rho_seq, present, weight, keep, mask))


# ----------------------------------------------------------------------------- the corrections

@register("none", per_token=False)
def none(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> Correction:
    """No correction (weight 1, nothing masked); the stats still measure the mismatch (ρ_t)."""
    delta = _token_log_ratio(old_logp, rollout_logp, mask)
    return _token_result(delta, torch.ones_like(delta), torch.ones_like(delta), mask)


@register("tis", per_token=True, cap=2.0)
def tis(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, *, cap: float) -> Correction:
    """Token-level truncated importance sampling: w_t = min(ρ_t, C), nothing masked."""
    delta = _token_log_ratio(old_logp, rollout_logp, mask)
    weight = delta.exp().clamp(max=cap)
    return _token_result(delta, weight, torch.ones_like(delta), mask)


@register("icepop", per_token=False, low=0.5, high=2.0)
def icepop(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, *, low: float,
           high: float) -> Correction:
    """IcePop-style token masking: keep token t iff low ≤ ρ_t ≤ high; weight 1."""
    delta = _token_log_ratio(old_logp, rollout_logp, mask)
    rho = delta.exp()
    keep = ((rho >= low) & (rho <= high)).to(delta.dtype)
    return _token_result(delta, torch.ones_like(delta), keep, mask)


@register("seq_tis", per_token=False, cap=2.0)
def seq_tis(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, *, cap: float) -> Correction:
    """Sequence-level truncated IS: w_i = min(ρ_i, C), ρ_i = exp((1/|y_i|) Σ_t δ_t) the geometric
    mean of the token ratios (GSPO's length normalisation); nothing masked."""
    delta = _token_log_ratio(old_logp, rollout_logp, mask)
    rho = _seq_log_ratio(delta, mask).exp()                                   # [N]
    return _seq_result(delta, rho, rho.clamp(max=cap), torch.ones_like(rho, dtype=torch.bool), mask)


@register("seq_mask", per_token=False, low=0.5, high=2.0)
def seq_mask(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, *, low: float,
             high: float) -> Correction:
    """Sequence-level masking: drop response i unless low ≤ ρ_i ≤ high (geometric mean); weight 1."""
    delta = _token_log_ratio(old_logp, rollout_logp, mask)
    rho = _seq_log_ratio(delta, mask).exp()                                   # [N]
    return _seq_result(delta, rho, torch.ones_like(rho), (rho >= low) & (rho <= high), mask)


# ----------------------------------------------------------------------------- applying one

def weighted_advantages(advantages: Tensor, weight: Tensor, mask: Tensor, *, per_row: bool) -> Tensor:
    """Advantages scaled by the correction's weight, which weights each token's loss by it.

    Every registered objective's per-token loss is positively homogeneous in Â (ℓ(wÂ) = w·ℓ(Â)
    for w ≥ 0: the clipped surrogates, SAPO's gate, CISPO's, GMPO's), so scaling Â by w is the
    same as weighting the loss by w. ``per_row`` (an objective with one ratio per response, whose
    advantages are [N]): the row's loss ℓ_i is the same at each of its tokens, so Σ_t w_t ℓ_i / |y_i|
    = w̄_i ℓ_i with w̄_i the mean weight over the row's tokens of ``mask`` [N, T]: Â_i · w̄_i, [N].
    Otherwise Â [N] or [N, T] times w: [N, T]."""
    if per_row and advantages.dim() == 1:
        return advantages * masked_mean(weight, mask, dim=-1).to(advantages.dtype)   # [N]
    adv = advantages if advantages.dim() == 2 else advantages[:, None]       # [N, T] | [N, 1]
    return adv * weight.to(advantages.dtype)                                  # [N, T]
