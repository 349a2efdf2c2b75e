"""Policy losses: a registry of pure functions of tensors, each returning (loss, stats).

Every objective has the signature

    fn(logp, old_logp, advantages, mask, *, eps_low, eps_high, aggregation, <extra hyper-params>,
       num_seqs: Count = None, num_tokens: Count = None, token_sum_norm: Count = None) -> (loss, stats)

with `logp`, `old_logp`, `mask` of shape [N, T] (N sequences, T padded response length) and
`advantages` of shape [N] (token-level objectives also accept [N, T]). `mask` is 1 for every
generated token up to and including EOS and 0 elsewhere; values under mask 0 are never read, so
padding may hold anything. `loss` is a scalar with autograd; `stats` are detached scalars.
Hyper-parameters left out (or passed as None) take the objective's paper default, stored in its
`ObjectiveSpec` (`spec(name).defaults`) so that the trainer can read them.

Distributed training: `num_seqs` / `num_tokens` are the GLOBAL counts of non-empty responses /
response tokens over all ranks and micro-batches of one optimizer step. With them, the losses of
the pieces sum to the loss of the whole batch (the trainer undoes DDP's mean over ranks).

This module deliberately is not: a model wrapper, a config reader, a logger or a place for
communication. It never calls `.item()` and never synchronises.

The math and its derivations: docs/math.md. Shapes: N sequences, T response positions.
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping

import torch
from torch import Tensor

from gspo.registry import Registry

__all__ = [
    "AGGREGATIONS", "LOG_RATIO_LIMIT", "ObjectiveSpec", "aggregate", "available", "dpo_loss", "get",
    "kl_k3", "masked_mean", "register", "resolve", "sequence_logprobs", "spec",
]

AGGREGATIONS = ("seq-mean", "seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
"""Loss reductions, see `aggregate`."""
LOG_RATIO_LIMIT = 20.0
"""|log ratio| is clamped here before exp, only to prevent overflow (counted in `log_ratio_clamped`)."""
NORMALISERS = ("num_seqs", "num_tokens", "token_sum_norm")

Stats = dict[str, Tensor]
Objective = Callable[..., tuple[Tensor, Stats]]
Count = float | Tensor | None
"""A normaliser: global count (or constant); None → computed locally from the mask."""


# ----------------------------------------------------------------------------- registry

@dataclass(frozen=True)
class ObjectiveSpec:
    """One registered objective: its callable (defaults bound) and what it came from."""

    name: str
    fn: Objective
    """Callable; omitted / None hyper-parameters take `defaults`."""
    defaults: Mapping[str, object]
    """Paper defaults: eps_low, eps_high, aggregation and any extra hyper-parameters."""
    sequence_level: bool
    """True when the importance ratio is one number per response (GSPO, GSPO-token, GMPO)."""
    paper: str
    """Citation: arXiv id, equations, where the defaults come from."""
    zero_at_zero_advantage: bool = True
    """Loss and gradient are exactly 0 on a response with Â = 0 (every token, any ratio): the
    trainer may then skip such rows (``train.skip_zero_advantage``, gspo.core.plan). False: it never does."""
    equations: str = ""
    """The loss as implemented, in one line of the docs/math.md notation (what a run's
    provenance.json locks: a change of it is a different objective)."""


_REGISTRY: Registry[ObjectiveSpec] = Registry("objective")


def register(name: str, *, sequence_level: bool, paper: str, zero_at_zero_advantage: bool = True,
             equations: str | None = None, **defaults: object):
    """Decorator: register `fn` as `name` with its citation, its loss in one line (`equations`;
    left out: the first line of `fn`'s docstring) and its paper defaults (eps_low, eps_high,
    aggregation…).

    ``zero_at_zero_advantage``: whether the loss is proportional to Â (0 in value and gradient where
    Â = 0); the row-skipping path reads it from the spec (tests/core/test_objectives.py checks it)."""

    def decorate(fn: Objective) -> Objective:
        params = inspect.signature(fn).parameters.values()
        hyper = {p.name for p in params if p.kind is p.KEYWORD_ONLY} - set(NORMALISERS)
        if hyper != set(defaults) or defaults.get("aggregation") not in AGGREGATIONS:
            raise TypeError(f"{name}: defaults {sorted(defaults)} must name exactly the "
                            f"hyper-parameters {sorted(hyper)}, with a valid aggregation")

        @functools.wraps(fn)
        def with_defaults(logp, old_logp, advantages, mask, **kwargs):
            unknown = kwargs.keys() - defaults.keys() - set(NORMALISERS)
            if unknown:
                raise TypeError(f"{name}: unknown keyword(s) {sorted(unknown)}; "
                                f"valid: {sorted(defaults) + list(NORMALISERS)}")
            given = {k: v for k, v in kwargs.items() if v is not None}
            return fn(logp, old_logp, advantages, mask, **{**defaults, **given})

        summary = (inspect.getdoc(fn) or name).splitlines()[0]
        _REGISTRY.add(name, ObjectiveSpec(name, with_defaults, MappingProxyType(dict(defaults)),
                                          sequence_level, paper, zero_at_zero_advantage,
                                          equations or summary))
        return with_defaults

    return decorate


available = _REGISTRY.names
"""Sorted names of the registered objectives."""
spec = _REGISTRY.get
"""The `ObjectiveSpec` of `name`; ValueError listing the valid names if unknown."""


def resolve(name: str, **given: object) -> dict[str, object]:
    """The hyper-parameters `name` runs with: its defaults, overridden by the non-None `given`."""
    return {**spec(name).defaults, **{k: v for k, v in given.items() if v is not None}}


def get(name: str) -> Objective:
    """The objective `name`, omitted keywords taking its paper defaults."""
    return spec(name).fn


# ----------------------------------------------------------------------------- reductions

def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `values` where mask > 0 (over `dim`, or everything); 0 where nothing is masked in."""
    keep = mask > 0
    total = torch.where(keep, values, torch.zeros_like(values)).sum(dim)
    return total / keep.sum(dim).clamp(min=1)


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(π_θ ‖ π_ref): exp(ref − logp) − (ref − logp) − 1 ≥ 0."""
    d = ref_logp - logp                               # [N, T] log π_ref/π_θ
    return torch.exp(d) - d - 1                       # [N, T] k3 (Schulman 2020)


_warned: set[str] = set()


def _warn_length_reweight() -> None:
    """Warn once per process that token-mean re-weights sequence-level losses by length."""
    if "token-mean" not in _warned:
        _warned.add("token-mean")
        warnings.warn("aggregation 'token-mean' with a sequence-level ratio weights every response "
                      "by its length |y_i| (the paper's Eq. 5 averages over responses: 'seq-mean')",
                      UserWarning, stacklevel=4)


def _denominator(count: Tensor | float) -> Tensor | float:
    """A count used as divisor, at least 1 (an all-empty batch gives loss 0, not NaN)."""
    return count.clamp(min=1) if isinstance(count, Tensor) else max(float(count), 1.0)


def aggregate(values: Tensor, mask: Tensor, mode: str, *, num_seqs: Count = None,
              num_tokens: Count = None, token_sum_norm: Count = None) -> Tensor:
    """Reduce per-sequence [N] or per-token [N, T] values to a scalar.

    seq-mean:                (1/num_seqs) Σ_i v_i  (token values: v_i = their mean over y_i)
    seq-mean-token-mean:     (1/num_seqs) Σ_i (1/|y_i|) Σ_t m_it v_it
    token-mean:              (1/num_tokens) Σ_it m_it v_it            (DAPO; weights by length)
    seq-mean-token-sum-norm: (1/num_seqs) Σ_i Σ_t m_it v_it / token_sum_norm   (Dr. GRPO)

    Per-sequence values meet a token mode by being broadcast to their tokens (v_it = v_i), so
    token-mean then weights response i by |y_i| (warned once). num_seqs / num_tokens default to
    the local counts of non-empty responses / response tokens; token_sum_norm defaults to T. The
    trainer passes max_new_tokens instead, so that padding columns do not change the loss.
    Responses with an empty mask contribute nothing and are not counted.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {mode!r}; valid: {', '.join(AGGREGATIONS)}")
    keep = mask > 0                                                   # [N, T]
    lengths = keep.sum(-1)                                            # [N] |y_i|
    present = lengths > 0                                             # [N] non-empty responses
    num_seqs = present.sum() if num_seqs is None else num_seqs
    num_tokens = lengths.sum() if num_tokens is None else num_tokens
    token_sum_norm = mask.shape[-1] if token_sum_norm is None else token_sum_norm
    if values.dim() == 1 and mode == "seq-mean":
        per_seq = values                                              # [N] v_i
    else:
        if values.dim() == 1:
            if mode == "token-mean":
                _warn_length_reweight()
            values = values[:, None].expand(mask.shape)               # [N, T] v_it = v_i
        summed = torch.where(keep, values, torch.zeros_like(values)).sum(-1)  # [N] Σ_t m v_it
        if mode == "token-mean":
            return summed.sum() / _denominator(num_tokens)            # Σ_it m v / num_tokens
        if mode == "seq-mean-token-sum-norm":
            per_seq = summed / token_sum_norm                         # [N] Σ_t m v_it / L
        else:
            per_seq = summed / lengths.clamp(min=1)                   # [N] (1/|y_i|) Σ_t m v_it
    per_seq = torch.where(present, per_seq, torch.zeros_like(per_seq))  # [N] empty rows → 0
    return per_seq.sum() / _denominator(num_seqs)                     # (1/num_seqs) Σ_i


# ----------------------------------------------------------------------------- shared pieces

def _check(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
           per_token: bool) -> Tensor:
    """Validate shapes; return advantages in the compute dtype, [N, T] if per_token else [N]."""
    if logp.dim() != 2 or logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError("logp, old_logp and mask must share one [N, T] shape; got "
                         f"{tuple(logp.shape)}, {tuple(old_logp.shape)}, {tuple(mask.shape)}")
    dtype = torch.promote_types(logp.dtype, torch.float32)           # log-ratios in ≥ float32
    n = logp.shape[0]
    if advantages.shape == (n,):
        adv = advantages.to(dtype)
        return adv[:, None].expand(logp.shape) if per_token else adv
    if per_token and advantages.shape == logp.shape:
        return advantages.to(dtype)
    allowed = "[N] or [N, T]" if per_token else "[N]"
    raise ValueError(f"advantages must be {allowed} with N={n}, T={logp.shape[1]}; "
                     f"got {tuple(advantages.shape)}")


def _log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """log π_θ/π_old per token, 0 on padding (whatever it holds). [N, T], float32 or wider."""
    dtype = torch.promote_types(logp.dtype, torch.float32)
    d = logp.to(dtype) - old_logp.to(dtype)
    return torch.where(mask > 0, d, torch.zeros_like(d))


def clamp_log_ratio(log_ratio: Tensor) -> tuple[Tensor, Tensor]:
    """Clamp a log-ratio to ±LOG_RATIO_LIMIT before exp (no overflow) and count the clamps."""
    n_clamped = (log_ratio.detach().abs() > LOG_RATIO_LIMIT).sum().to(log_ratio.dtype)
    return log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT), n_clamped


def _sign_gated(x: Tensor, adv: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """Where the min of a clipped surrogate picks the clipped term: (Â<0, x<low), (Â>0, x>high)."""
    x = x.detach()
    return (adv < 0) & (x < low), (adv > 0) & (x > high)


def _stats(ratio: Tensor, clip_low: Tensor, clip_high: Tensor, log_r: Tensor, mask: Tensor,
           log_ratio_clamped: Tensor) -> Stats:
    """Detached diagnostics. ratio: [N] (per sequence) or [N, T]; clip_low/high: [N, T] bool."""
    with torch.no_grad():
        keep = mask > 0                                               # [N, T]
        present = keep.any(-1)                                        # [N]
        n_tok = keep.sum().clamp(min=1)
        low, high = clip_low & keep, clip_high & keep                 # [N, T]
        clipped = low | high                                          # [N, T]
        where = present if ratio.dim() == 1 else keep                 # which ratios count
        ratio = ratio.detach()
        count = where.sum()
        inf = torch.full_like(ratio, math.inf)
        ratio_min = torch.where(where, ratio, inf).amin()
        ratio_max = torch.where(where, ratio, -inf).amax()
        one = torch.ones_like(ratio_min)
        return {
            "clip_frac_tokens": clipped.sum() / n_tok,
            "clip_frac_seqs": (clipped.any(-1) & present).sum() / present.sum().clamp(min=1),
            "clip_frac_low": low.sum() / n_tok,
            "clip_frac_high": high.sum() / n_tok,
            "ratio_mean": torch.where(where, ratio, torch.zeros_like(ratio)).sum() / count.clamp(min=1),
            "ratio_min": torch.where(count > 0, ratio_min, one),
            "ratio_max": torch.where(count > 0, ratio_max, one),
            "approx_kl": masked_mean(-log_r.detach(), mask),         # mean_t (old − logp), k1
            "log_ratio_clamped": log_ratio_clamped.detach(),
        }


# ----------------------------------------------------------------------------- objectives

@register("gspo", eps_low=3e-4, eps_high=4e-4, aggregation="seq-mean", sequence_level=True,
          paper="arXiv 2507.18071 (Zheng et al., GSPO) Eq. 5, 7; gradient Eq. 10; ε 3e-4/4e-4 §5.1",
          equations="s_i = exp((1/|y_i|) Σ_t log r_it), r_it = π_θ(y_it)/π_old(y_it); "
                    "ℓ_i = −min(s_i Â_i, clip(s_i, 1−ε_low, 1+ε_high) Â_i)")
def gspo(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
         eps_low: float, eps_high: float, aggregation: str,
         num_seqs: Count = None, num_tokens: Count = None, token_sum_norm: Count = None):
    """GSPO: one length-normalised ratio per response, clipped per response (arXiv 2507.18071).

    log s_i = (1/|y_i|) Σ_t m (log π_θ − log π_old)                      (Eq. 7)
    ℓ_i = −min(s_i Â_i, clip(s_i, 1−ε_low, 1+ε_high) Â_i)                (Eq. 5)
    Gradient (Eq. 10): every token of an unclipped response gets −s_i Â_i / |y_i| on ∇log π_θ.
    Defaults: ε_low = 3e-4, ε_high = 4e-4 (§5.1), seq-mean (Eq. 5). advantages: [N].
    Clip stats: every token of a clipped response counts as clipped; ratio stats over s_i.
    """
    loss_i, stats = _sequence_clipped(logp, old_logp, advantages, mask, eps_low, eps_high)
    loss = aggregate(loss_i, mask, aggregation, num_seqs=num_seqs, num_tokens=num_tokens,
                     token_sum_norm=token_sum_norm)
    return loss, stats


def _sequence_clipped(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                      eps_low: float, eps_high: float) -> tuple[Tensor, Stats]:
    """GSPO's per-response loss ℓ_i = −min(s_i Â_i, clip(s_i) Â_i) [N] (Eq. 5, 7) and its stats."""
    adv = _check(logp, old_logp, advantages, mask, per_token=False)           # [N] Â_i
    log_r = _log_ratio(logp, old_logp, mask)                                  # [N, T] log r_it
    log_s, n_clamped = clamp_log_ratio(masked_mean(log_r, mask, dim=-1))               # [N] log s_i (Eq. 7)
    s = torch.exp(log_s)                                                      # [N] s_i
    s_clip = s.clamp(1 - eps_low, 1 + eps_high)                               # [N] clip(s_i)
    loss_i = -torch.minimum(s * adv, s_clip * adv)                            # [N] ℓ_i (Eq. 5)
    low, high = _sign_gated(s, adv, 1 - eps_low, 1 + eps_high)                # [N]
    low, high = low[:, None].expand(mask.shape), high[:, None].expand(mask.shape)  # [N, T]
    return loss_i, _stats(s, low, high, log_r, mask, n_clamped)


@register("luspo", eps_low=3e-4, eps_high=4e-4, aggregation="seq-mean", sequence_level=True,
          paper="arXiv 2602.05261 (Liu et al., LUSPO): GSPO's per-response loss multiplied by the "
                "response length |y_i| (equation as read in docs/math.md); ε as GSPO §5.1",
          equations="ℓ_i = −|y_i| · min(s_i Â_i, clip(s_i, 1−ε_low, 1+ε_high) Â_i), "
                    "s_i as GSPO")
def luspo(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
          eps_low: float, eps_high: float, aggregation: str,
          num_seqs: Count = None, num_tokens: Count = None, token_sum_norm: Count = None):
    """LUSPO: GSPO with each response's loss scaled by its length (arXiv 2602.05261).

    ℓ_i = −|y_i| · min(s_i Â_i, clip(s_i, 1−ε_low, 1+ε_high) Â_i),   s_i as GSPO (Eq. 7)
    loss = (1/N) Σ_i ℓ_i  (seq-mean)
    Gradient: every token of an unclipped response gets −s_i Â_i / N on ∇log π_θ, whatever the
    length (GSPO: −s_i Â_i / (N |y_i|)), so a response's total weight grows with its length, as
    under token-level GRPO. Zero where Â_i = 0. advantages: [N]. Stats as GSPO (ratio s_i, a
    clipped response counts all its tokens). The values are per response: a token aggregation
    broadcasts ℓ_i to its tokens and so weights by |y_i|² (warned for token-mean).
    """
    loss_i, stats = _sequence_clipped(logp, old_logp, advantages, mask, eps_low, eps_high)
    lengths = (mask > 0).sum(-1).to(loss_i.dtype)                             # [N] |y_i|
    loss = aggregate(lengths * loss_i, mask, aggregation, num_seqs=num_seqs,  # ℓ_i·|y_i|
                     num_tokens=num_tokens, token_sum_norm=token_sum_norm)
    return loss, stats


@register("gspo_token", eps_low=3e-4, eps_high=4e-4, aggregation="seq-mean-token-mean",
          sequence_level=True,
          paper="arXiv 2507.18071 (Zheng et al., GSPO-token) Eq. 13-14; gradient Eq. 17; ε §5.1",
          equations="s_it = sg[s_i] · π_θ(y_it)/sg[π_θ(y_it)]; "
                    "ℓ_it = −min(s_it Â_it, clip(s_it, 1−ε_low, 1+ε_high) Â_it)")
def gspo_token(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
               eps_low: float, eps_high: float, aggregation: str,
               num_seqs: Count = None, num_tokens: Count = None, token_sum_norm: Count = None):
    """GSPO-token: GSPO's ratio with per-token advantages (arXiv 2507.18071, Eq. 13-14).

    s_it = sg[s_i] · π_θ(y_it) / sg[π_θ(y_it)]   (value s_i, gradient s_i ∇log π_θ(y_it))
    ℓ_it = −min(s_it Â_it, clip(s_it, 1−ε_low, 1+ε_high) Â_it)           (Eq. 13)
    Gradient (Eq. 17): −s_i Â_it / |y_i| on ∇log π_θ(y_it) where not clipped; with Â_it = Â_i
    this equals GSPO in value and gradient. Defaults as GSPO, seq-mean-token-mean.
    advantages: [N] or [N, T]. Ratio stats over s_i; clip stats per token (sign of Â_it).
    """
    adv = _check(logp, old_logp, advantages, mask, per_token=True)            # [N, T] Â_it
    log_r = _log_ratio(logp, old_logp, mask)                                  # [N, T] log r_it
    log_s, n_clamped = clamp_log_ratio(masked_mean(log_r, mask, dim=-1).detach())      # [N] sg[log s_i]
    lp = logp.to(log_r.dtype)
    live = torch.where(mask > 0, lp - lp.detach(), torch.zeros_like(lp))      # [N, T] logp − sg[logp]
    s_tok = torch.exp(log_s[:, None] + live)                                  # [N, T] s_it (Eq. 14)
    s_clip = s_tok.clamp(1 - eps_low, 1 + eps_high)                           # [N, T] clip(s_it)
    loss_t = -torch.minimum(s_tok * adv, s_clip * adv)                        # [N, T] ℓ_it (Eq. 13)
    if aggregation == "token-mean":
        _warn_length_reweight()
    loss = aggregate(loss_t, mask, aggregation, num_seqs=num_seqs, num_tokens=num_tokens,
                     token_sum_norm=token_sum_norm)
    low, high = _sign_gated(s_tok, adv, 1 - eps_low, 1 + eps_high)            # [N, T]
    return loss, _stats(torch.exp(log_s), low, high, log_r, mask, n_clamped)


@register("grpo", eps_low=0.2, eps_high=0.27, aggregation="seq-mean-token-mean",
          sequence_level=False,
          paper="arXiv 2402.03300 (Shao et al., GRPO), in the form of arXiv 2507.18071: "
                "gradient Eq. 11; ε 0.2/0.27 as the GSPO paper's GRPO baseline (§5.1)",
          equations="r_it = π_θ(y_it)/π_old(y_it); "
                    "ℓ_it = −min(r_it Â_it, clip(r_it, 1−ε_low, 1+ε_high) Â_it)")
def grpo(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
         eps_low: float, eps_high: float, aggregation: str,
         num_seqs: Count = None, num_tokens: Count = None, token_sum_norm: Count = None):
    """GRPO: PPO's clipped surrogate with a token-level ratio and group advantages.

    r_it = π_θ(y_it) / π_old(y_it)
    ℓ_it = −min(r_it Â_it, clip(r_it, 1−ε_low, 1+ε_high) Â_it)
    Gradient (GSPO paper Eq. 11): −r_it Â_i / |y_i| on ∇log π_θ(y_it) for unclipped tokens, 0 for
    clipped ones. Defaults: ε_low = 0.2, ε_high = 0.27 (GSPO paper's GRPO, §5.1),
    seq-mean-token-mean (arXiv 2402.03300). advantages: [N] or [N, T].
    """
    adv = _check(logp, old_logp, advantages, mask, per_token=True)            # [N, T] Â_it
    raw = _log_ratio(logp, old_logp, mask)                                    # [N, T] log r_it
    log_r, n_clamped = clamp_log_ratio(raw)                                    # [N, T]
    r = torch.exp(log_r)                                                      # [N, T] r_it
    r_clip = r.clamp(1 - eps_low, 1 + eps_high)                               # [N, T] clip(r_it)
    loss_t = -torch.minimum(r * adv, r_clip * adv)                            # [N, T] ℓ_it
    loss = aggregate(loss_t, mask, aggregation, num_seqs=num_seqs, num_tokens=num_tokens,
                     token_sum_norm=token_sum_norm)
    low, high = _sign_gated(r, adv, 1 - eps_low, 1 + eps_high)                # [N, T]
    return loss, _stats(r, low, high, raw, mask, n_clamped)


@register("ppo", eps_low=0.2, eps_high=0.2, aggregation="token-mean", sequence_level=False,
          paper="arXiv 1707.06347 (Schulman et al., PPO) Eq. 7, ε = 0.2; token-mean over the "
                "batch's response tokens as TRL PPOTrainer (masked_mean) and InstructGPT-style RLHF",
          equations="r_t = π_θ(y_t)/π_old(y_t); "
                    "ℓ_t = −min(r_t Â_t, clip(r_t, 1−ε_low, 1+ε_high) Â_t), Â_t from GAE")
def ppo(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
        eps_low: float, eps_high: float, aggregation: str,
        num_seqs: Count = None, num_tokens: Count = None, token_sum_norm: Count = None):
    """PPO's clipped surrogate per token, with per-token (GAE) advantages from a critic.

    ℓ_t = −min(r_t Â_t, clip(r_t, 1−ε, 1+ε) Â_t),  r_t = π_θ(y_t) / π_old(y_t)   (PPO Eq. 7)
    The same math as `grpo` (one implementation, reused); only the defaults differ: symmetric
    ε = 0.2 (PPO §6) and token-mean, every response token weighted alike (TRL PPOTrainer).
    advantages: [N, T] (GAE, gspo.core.advantages.gae) or [N].
    """
    return grpo(logp, old_logp, advantages, mask, eps_low=eps_low, eps_high=eps_high,
                aggregation=aggregation, num_seqs=num_seqs, num_tokens=num_tokens,
                token_sum_norm=token_sum_norm)


@register("sapo", eps_low=0.2, eps_high=0.27, tau_pos=1.0, tau_neg=1.05,
          aggregation="seq-mean-token-mean", sequence_level=False,
          paper="arXiv 2511.20347 (Gao et al., SAPO): soft gate σ(τ(r−1))·4/τ, "
                "τ_pos = 1.0, τ_neg = 1.05 (paper's recommendation, as verl / ms-swift)",
          equations="ℓ_it = −σ(τ_it (r_it − 1)) · 4/τ_it · Â_it, "
                    "τ_it = τ_pos if Â_it > 0 else τ_neg")
def sapo(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
         eps_low: float, eps_high: float, tau_pos: float, tau_neg: float, aggregation: str,
         num_seqs: Count = None, num_tokens: Count = None, token_sum_norm: Count = None):
    """SAPO: a smooth, temperature-controlled gate instead of the hard clip (arXiv 2511.20347).

    f_it(r) = σ(τ_it (r − 1)) · 4/τ_it,   τ_it = τ_pos if Â_it > 0 else τ_neg
    ℓ_it = −f_it(r_it) Â_it
    Gradient: −w_it r_it Â_it on ∇log π_θ(y_it), w_it = 4σ(1 − σ) ∈ (0, 1]: 1 on-policy, decaying
    smoothly as r_it leaves 1 (faster for Â < 0 since τ_neg > τ_pos).
    Defaults: τ_pos = 1.0, τ_neg = 1.05, seq-mean-token-mean (the paper's 1/G Σ_i 1/|y_i| Σ_t).
    ε_low / ε_high do not enter the loss: they set the hard band the clip stats compare against
    (default GRPO's 0.2 / 0.27), so `clip_frac_*` is the share of tokens GRPO would have cut and
    SAPO only attenuates. advantages: [N] or [N, T].
    """
    adv = _check(logp, old_logp, advantages, mask, per_token=True)            # [N, T] Â_it
    raw = _log_ratio(logp, old_logp, mask)                                    # [N, T] log r_it
    log_r, n_clamped = clamp_log_ratio(raw)
    r = torch.exp(log_r)                                                      # [N, T] r_it
    tau = torch.where(adv > 0, adv.new_tensor(tau_pos), adv.new_tensor(tau_neg))  # [N, T] τ_it
    gate = torch.sigmoid(tau * (r - 1)) * 4 / tau                             # [N, T] f_it(r_it)
    loss_t = -gate * adv                                                      # [N, T] ℓ_it
    loss = aggregate(loss_t, mask, aggregation, num_seqs=num_seqs, num_tokens=num_tokens,
                     token_sum_norm=token_sum_norm)
    low, high = _sign_gated(r, adv, 1 - eps_low, 1 + eps_high)                # [N, T]
    return loss, _stats(r, low, high, raw, mask, n_clamped)


@register("cispo", eps_low=1.0, eps_high=4.0, aggregation="token-mean", sequence_level=False,
          paper="arXiv 2506.13585 (MiniMax-M1, CISPO) §3.1: no lower bound (ε_low = 1); "
                "cap 1+ε_high = 5 as ScaleRL (arXiv 2510.13786) / TRL epsilon_high=5.0",
          equations="ℓ_it = −sg[clip(r_it, 1−ε_low, 1+ε_high)] · Â_it · log π_θ(y_it)")
def cispo(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
          eps_low: float, eps_high: float, aggregation: str,
          num_seqs: Count = None, num_tokens: Count = None, token_sum_norm: Count = None):
    """CISPO: REINFORCE with a clipped, stop-gradient IS weight (arXiv 2506.13585, §3.1).

    ŵ_it = sg[clip(r_it, 1−ε_low, 1+ε_high)];  ℓ_it = −ŵ_it Â_it log π_θ(y_it)
    Gradient: −ŵ_it Â_it on ∇log π_θ(y_it); no token ever loses its gradient. The loss VALUE
    contains log π_θ, so it is not comparable with the ratio-based objectives.
    Defaults: ε_low = 1 (the paper sets no lower bound), ε_high = 4 (weight ≤ 5, ScaleRL's ε_max,
    arXiv 2510.13786, TRL's recipe); token-mean (the paper's 1/Σ_i|o_i|).
    Clip stats: a token is clipped when its weight was truncated, whatever the sign of Â
    (low: r < 1−ε_low, high: r > 1+ε_high). advantages: [N] or [N, T].
    """
    adv = _check(logp, old_logp, advantages, mask, per_token=True)            # [N, T] Â_it
    raw = _log_ratio(logp, old_logp, mask)                                    # [N, T] log r_it
    log_r, n_clamped = clamp_log_ratio(raw)
    r = torch.exp(log_r)                                                      # [N, T] r_it
    weight = r.clamp(1 - eps_low, 1 + eps_high).detach()                      # [N, T] ŵ_it
    lp = logp.to(r.dtype)
    lp = torch.where(mask > 0, lp, torch.zeros_like(lp))                      # [N, T] log π_θ(y_it)
    loss_t = -weight * adv * lp                                               # [N, T] ℓ_it
    loss = aggregate(loss_t, mask, aggregation, num_seqs=num_seqs, num_tokens=num_tokens,
                     token_sum_norm=token_sum_norm)
    low, high = r.detach() < 1 - eps_low, r.detach() > 1 + eps_high          # [N, T] truncated
    return loss, _stats(r, low, high, raw, mask, n_clamped)


@register("gmpo", eps_low=0.4, eps_high=0.4, aggregation="seq-mean", sequence_level=True,
          paper="arXiv 2507.20673 (Zhao et al., GMPO): geometric mean of token-clipped ratios; "
                "log-space clip (e^-0.4, e^0.4) §4 and official code (CLIPRANGE=0.4)",
          equations="log ρ̃_it = min(log r_it, ε_high) if Â_i > 0 else max(log r_it, −ε_low); "
                    "ℓ_i = −Â_i exp((1/|y_i|) Σ_t log ρ̃_it)")
def gmpo(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
         eps_low: float, eps_high: float, aggregation: str,
         num_seqs: Count = None, num_tokens: Count = None, token_sum_norm: Count = None):
    """GMPO: maximise the geometric mean of token-level clipped ratios (arXiv 2507.20673).

    log ρ̃_it = min(log r_it, ε_high) if Â_i > 0 else max(log r_it, −ε_low)
               (PPO's min(ρÂ, clip(ρ)Â), per token, in log space)
    ℓ_i = −Â_i G_i,  G_i = exp((1/|y_i|) Σ_t m log ρ̃_it)   (= −sgn(Â_i) Π_t |ρ̃_it Â_i|^{1/|y_i|})
    Gradient: −Â_i G_i / |y_i| on ∇log π_θ(y_it) for unclipped tokens (G_i the geometric mean).
    ε is in LOG space: ratios are clipped to (e^−ε_low, e^ε_high). Defaults ε = 0.4 (paper §4),
    seq-mean (one ratio per response). advantages: [N]. Clip stats per token (sign of Â_i);
    ratio stats over the unclipped geometric mean exp(mean_t log r_it), GSPO's s_i.
    """
    adv = _check(logp, old_logp, advantages, mask, per_token=False)           # [N] Â_i
    log_r = _log_ratio(logp, old_logp, mask)                                  # [N, T] log r_it
    a = adv[:, None].expand(log_r.shape)                                      # [N, T] Â_i per token
    log_rho = torch.where(a > 0, log_r.clamp(max=eps_high), log_r.clamp(min=-eps_low))  # [N, T] log ρ̃
    log_g, n_clamped = clamp_log_ratio(masked_mean(log_rho, mask, dim=-1))             # [N] log G_i
    loss_i = -adv * torch.exp(log_g)                                          # [N] ℓ_i = −Â_i G_i
    loss = aggregate(loss_i, mask, aggregation, num_seqs=num_seqs, num_tokens=num_tokens,
                     token_sum_norm=token_sum_norm)
    low, high = _sign_gated(log_r, a, -eps_low, eps_high)                     # [N, T]
    s = torch.exp(clamp_log_ratio(masked_mean(log_r, mask, dim=-1))[0])                # [N] s_i, unclipped
    return loss, _stats(s, low, high, log_r, mask, n_clamped)


# ----------------------------------------------------------------------------- DPO (pairs)

def sequence_logprobs(logp: Tensor, mask: Tensor) -> Tensor:
    """log π(y_i | x) = Σ_t m[i,t] log π(y_it): one number per response, [N] (padding never read)."""
    lp = logp.to(torch.promote_types(logp.dtype, torch.float32))              # [N, T]
    return torch.where(mask > 0, lp, torch.zeros_like(lp)).sum(-1)            # [N]


def dpo_loss(logp_w: Tensor, logp_l: Tensor, ref_w: Tensor, ref_l: Tensor, *,
             beta: float) -> tuple[Tensor, Stats]:
    """DPO on K preference pairs (Rafailov et al., arXiv 2305.18290, Eq. 7): winner w, loser l.

    ρ_w = β (log π_θ(y_w) − log π_ref(y_w)),  ρ_l likewise   (implicit rewards; sequence log-probs)
    loss = (1/K) Σ_k −log σ(ρ_w,k − ρ_l,k)
    Gradient: ∂loss/∂log π_θ(y_w) = −β σ(ρ_l − ρ_w) / K = −∂loss/∂log π_θ(y_l). The reference
    log-probs carry no gradient. All inputs [K]; K = 0 gives loss 0. Stats: mean implicit rewards
    (`chosen`, `rejected`), their `margin`, and `accuracy` (share of pairs with ρ_w > ρ_l).
    """
    if not (logp_w.dim() == 1 and logp_w.shape == logp_l.shape == ref_w.shape == ref_l.shape):
        raise ValueError("dpo_loss takes four [K] tensors of sequence log-probs; got "
                         f"{[tuple(x.shape) for x in (logp_w, logp_l, ref_w, ref_l)]}")
    chosen = beta * (logp_w - ref_w.detach())                                 # [K] ρ_w
    rejected = beta * (logp_l - ref_l.detach())                               # [K] ρ_l
    margin = chosen - rejected                                                # [K]
    k = max(len(margin), 1)
    loss = -torch.nn.functional.logsigmoid(margin).sum() / k
    with torch.no_grad():
        stats = {"chosen": chosen.sum() / k, "rejected": rejected.sum() / k,
                 "margin": margin.sum() / k, "accuracy": (margin > 0).sum() / k}
    return loss, stats
