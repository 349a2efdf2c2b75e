"""The importance-weighting mechanism, measured: ratio dispersion and minibatch gradient noise.

Pure functions of tensors for `gspo mechanism` (gspo.tools.mechanism), which holds a sampled batch
fixed, moves the policy (optimizer steps, or router noise on a MoE) and asks how each objective's
gradient estimate behaves. Three pieces:

* `ratio_dispersion`: within one response, the spread of the token log-ratios log r_it against
  the deviation of the sequence log-ratio log s_i = mean_t log r_it (GSPO Eq. 7), and the share of
  tokens and of responses whose ratio lies outside a clip range.
* `token_loss_weights`: c_it = ∂ℓ_i/∂log π_θ(y_it) of a registered objective, so that the
  gradient of response i is g_i = Σ_t c_it ∇θ log π_θ(y_it); the model's Jacobian is shared by all
  objectives, only c differs (GSPO: −s_i Â_i/|y_i| for every token, Eq. 10; GRPO: −r_it Â_i/|y_i|
  per token, Eq. 11; 0 where clipped).
* `minibatch_noise`: from per-response gradients g_i [N, D], the signal-to-noise of the gradient
  of a minibatch of B responses drawn without replacement, in closed form over all such draws,
  and its mean cosine to the full-batch gradient.

Only objectives whose loss is a sum of per-response terms over a fixed count (the seq-mean and
seq-mean-token-mean aggregations) split into per-response gradients exactly; `token_loss_weights`
refuses the others. This module deliberately is not a model wrapper: it never runs a forward pass.

Shapes: N responses, T response positions, D parameters, R drawn minibatches.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gspo.core import objectives

__all__ = ["PER_RESPONSE_AGGREGATIONS", "minibatch_noise", "ratio_dispersion", "token_loss_weights",
           "worked_example"]

PER_RESPONSE_AGGREGATIONS = ("seq-mean", "seq-mean-token-mean")
"""Aggregations whose loss is (1/N) Σ_i ℓ_i: the gradient splits into per-response terms."""


def worked_example(p: Tensor, q: Tensor) -> dict[str, Tensor]:
    """Token weights p_t/q_t, the raw sequence weight Π_t p_t/q_t and GSPO's length-normalised one.

    p, q: [T] token probabilities under the target policy and the sampler. The sequence weight is
    the product of the token weights; GSPO uses its |y|-th root, the geometric mean (Eq. 7).
    """
    token = p / q                                               # [T] r_t
    log_seq = torch.log(token).sum()                            # log Π_t r_t
    return {"token": token, "sequence": torch.exp(log_seq),
            "normalised": torch.exp(log_seq / token.numel())}   # s = (Π_t r_t)^(1/|y|)


def ratio_dispersion(logp: Tensor, old_logp: Tensor, mask: Tensor, *, eps_low: float,
                     eps_high: float) -> dict[str, Tensor]:
    """Per response [N]: the token log-ratios' spread against the sequence log-ratio's deviation.

    log r_it = log π_θ − log π_old; log s_i = mean_t log r_it (GSPO Eq. 7)
    token_spread_i = sqrt(mean_t (log r_it − log s_i)²)   (population std over the response)
    token_dev_i = sqrt(mean_t (log r_it)²)                 (how far a token ratio is from 1)
    seq_dev_i = |log s_i|                                  (how far the sequence ratio is from 1)
    token_out_i = share of tokens with r_it outside [1−ε_low, 1+ε_high]; seq_out_i = 1 when s_i is.
    Out of range regardless of the advantage's sign (the clip band, not the clip decision).
    """
    keep = mask > 0                                             # [N, T]
    n = keep.sum(-1).clamp(min=1)                               # [N] |y_i|
    log_r = torch.where(keep, logp.double() - old_logp.double(), 0.0)  # [N, T] log r_it
    log_s = log_r.sum(-1) / n                                   # [N] log s_i
    centred = torch.where(keep, log_r - log_s[:, None], 0.0)    # [N, T]
    low, high = math.log1p(-eps_low), math.log1p(eps_high)      # the band in log space
    out_tok = keep & ((log_r < low) | (log_r > high))           # [N, T]
    return {
        "token_spread": (centred.square().sum(-1) / n).sqrt(),  # [N]
        "token_dev": (log_r.square().sum(-1) / n).sqrt(),       # [N]
        "seq_dev": log_s.abs(),                                 # [N]
        "token_out": out_tok.sum(-1) / n,                       # [N]
        "seq_out": ((log_s < low) | (log_s > high)).double(),   # [N]
        "length": keep.sum(-1).double(),                        # [N]
    }


def token_loss_weights(name: str, logp: Tensor, old_logp: Tensor, advantages: Tensor,
                       mask: Tensor, **hyper) -> tuple[Tensor, dict[str, Tensor]]:
    """c_it = ∂ℓ_i/∂log π_θ(y_it) of objective `name` at (logp, old_logp), and its stats.

    The loss is taken with num_seqs = 1, i.e. Σ_i ℓ_i, so row i of c is response i's own weights:
    its gradient is g_i = Σ_t c_it ∇θ log π_θ(y_it). `hyper`: the objective's hyper-parameters
    (omitted: its paper defaults). Raises ValueError for a loss that does not split by response.
    """
    aggregation = objectives.resolve(name, **hyper)["aggregation"]
    if aggregation not in PER_RESPONSE_AGGREGATIONS:
        raise ValueError(f"{name}: aggregation {aggregation!r} does not split into per-response "
                         f"gradients; use one of {', '.join(PER_RESPONSE_AGGREGATIONS)}")
    lp = logp.detach().float().requires_grad_(True)            # [N, T]
    loss, stats = objectives.get(name)(lp, old_logp.detach().float(), advantages, mask,
                                       num_seqs=1.0, **hyper)   # Σ_i ℓ_i
    (weights,) = torch.autograd.grad(loss, lp)                  # [N, T] c_it
    return torch.where(mask > 0, weights, 0.0), stats


def minibatch_noise(grads: Tensor, batch: int, *, draws: int = 256,
                    generator: torch.Generator | None = None,
                    subsets: Tensor | None = None) -> dict[str, Tensor]:
    """Noise of the mean gradient of B of the N responses, drawn without replacement.

    grads: [N, D] per-response gradients g_i; the full-batch gradient is ḡ = mean_i g_i, and a
    minibatch S of B gives g_S = mean_{i∈S} g_i. Over all such S (exact, sampling without
    replacement): E[g_S] = ḡ and
        E‖g_S − ḡ‖² = (N − B) / (B (N − 1)) · (1/N) Σ_i ‖g_i − ḡ‖²
    snr = ‖ḡ‖ / sqrt(E‖g_S − ḡ‖²) (inf when every response has the same gradient; 0 when ḡ = 0).
    cosine: mean over `draws` random S (or the given `subsets` [R, B] of row indices) of
    cos(g_S, ḡ), from the Gram matrix G = g gᵀ: cos = 1_Sᵀ G 1 / (B N ‖g_S‖ ‖ḡ‖). A minibatch whose
    gradient is 0 (e.g. every Â_i = 0 in it) has cosine 0: it moves nothing along ḡ.
    """
    N = grads.shape[0]
    if not 1 <= batch <= N:
        raise ValueError(f"minibatch of {batch} out of N = {N} responses")
    g = grads.double()                                          # [N, D]
    gram = g @ g.T                                              # [N, N] g_i·g_j
    mean_sq = gram.sum() / N**2                                 # ‖ḡ‖²
    spread_sq = gram.diagonal().sum() / N - mean_sq             # (1/N) Σ ‖g_i − ḡ‖²
    var = spread_sq.clamp(min=0) * ((N - batch) / (batch * (N - 1)) if N > 1 else 0.0)
    signal = mean_sq.clamp(min=0).sqrt()
    snr = signal / var.sqrt() if var > 0 else torch.tensor(math.inf if signal > 0 else 0.0)
    if subsets is None:
        subsets = torch.rand(draws, N, generator=generator).argsort(-1)[:, :batch]  # [R, B]
    pick = torch.zeros(subsets.shape[0], N, dtype=g.dtype).scatter_(1, subsets, 1.0) / batch  # [R, N]
    dot = pick @ gram.sum(1) / N                                # [R] g_S·ḡ
    norm_s = ((pick @ gram) * pick).sum(-1).clamp(min=0).sqrt()  # [R] ‖g_S‖
    denom = norm_s * signal
    cosine = torch.where(denom > 0, dot / denom.clamp(min=1e-300), 0.0).mean()
    return {"snr": snr.double(), "signal": signal, "noise": var.sqrt(), "cosine": cosine}
