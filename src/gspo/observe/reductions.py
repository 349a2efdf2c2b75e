"""How a step metric of every rank becomes one number: each metric declares its reduction here.

Under torchrun each rank measures its own share of the batch; the numbers logged are those of the
whole batch, as one process would log them. A metric is declared by its key, or a family of keys
by a template (``{name}`` stands for one path segment: ``time/{part}``), with one of

* ``SUM``: each rank holds its part of a global value (a loss over global normalisers) or a count;
* ``SAME``: the same on every rank (the norm of the summed gradient): rank 0's;
* ``MAX`` / ``MIN``: an extreme over the ranks that had rows (a rank without rows reports
  placeholders);
* ``MEAN``: weighted by the rank's rows (per-step metrics) or tokens (a minibatch's stats);
* ``MEAN_PER_SEQ``: weighted by the rank's rows (responses) in both;
* ``RATIO_MEAN``: per response for a sequence-level objective, else per token;
* ``BUCKET_MEAN``: a length bucket's stat, weighted by the rows in that bucket (rows x its frac);
* ``POOLED_STD``: the std of the union of the ranks' samples, from each rank's std and mean.

A key nobody declared is a ``MEAN``. Pure Python over numbers: the gathering is the ranks'
(``gspo.training.ranks``); nothing here talks to another process.
"""

from __future__ import annotations

import re

SUM, SAME, MAX, MIN = "sum", "same", "max", "min"
MEAN, MEAN_PER_SEQ, RATIO_MEAN, BUCKET_MEAN, POOLED_STD = (
    "mean", "mean_per_seq", "ratio_mean", "bucket_mean", "pooled_std")

DECLARED: dict[str, str] = {
    # the policy loss and its parts (gspo.core.objectives; global normalisers): summed
    "policy/loss": SUM, "policy/kl_ref": SUM, "policy/log_ratio_clamped": SUM,
    "policy/ratio_max": MAX, "policy/ratio_min": MIN,
    "policy/ratio_mean": RATIO_MEAN, "policy/clip_frac_seqs": MEAN_PER_SEQ,
    "optim/grad_norm": SAME,
    # the step's batch (gspo.rollout.collect, gspo.rewards)
    "reward/errors": SUM, "reward/scorer_errors": SUM, "reward/refill_rounds": MAX, "reward/std": POOLED_STD,
    "response/length_max": MAX,
    # rollout vs trainer log-probs (gspo.core.correction, gspo.observe.diagnostics)
    "mismatch/ratio_max": MAX, "mismatch/ratio_min": MIN,
    "mismatch/token_abs_max": MAX, "mismatch/seq_logratio_abs_max": MAX,
    # the agent episode's counts (gspo.rollout.episodes.agent; its means are MEANs)
    **{f"agent/{count}": SUM for count in (
        "rows_untrained", "fresh_renders", "engine_calls", "partial_batches", "overridden_sampling",
        "timeouts", "errors", "refused", "malformed", "unauthorized", "late_calls")},
    # the step (gspo.training.step)
    "train/rows_skipped": SUM, "train/skipped": MAX,
    "perf/tokens_computed": SUM, "perf/tokens_real": SUM,
    # the ranks' token loads (gspo.training.balance): computed from every rank's counts alike
    "perf/rank_tokens_max_over_mean": SAME, "perf/rank_tokens_max_over_mean_unbalanced": SAME,
    # wall-clock parts (gspo.observe.timing): the slowest rank's
    "time/{part}": MAX,
    # response-length slices (gspo.observe.diagnostics.length_slices)
    "length/{bucket}/frac": MEAN, "length/{bucket}/{stat}": BUCKET_MEAN,
}
"""Metric key or template -> its reduction; a key is looked up exactly, then by the templates in
this order."""


def template(pattern: str) -> re.Pattern:
    """``time/{part}`` -> a regex matching ``time/`` and one path segment."""
    return re.compile("/".join("[^/]+" if re.fullmatch(r"\{\w+\}", part) else re.escape(part)
                               for part in pattern.split("/")))


TEMPLATES = [(template(k), how) for k, how in DECLARED.items() if "{" in k]


def reduction(key: str) -> str:
    """The declared reduction of ``key`` (MEAN when none is)."""
    if key in DECLARED:
        return DECLARED[key]
    return next((how for regex, how in TEMPLATES if regex.fullmatch(key)), MEAN)


def per_seq(key: str, sequence_level: bool) -> bool:
    """Whether a minibatch stat ``key`` is weighted by responses (else by tokens)."""
    how = reduction(key)
    return how == MEAN_PER_SEQ or (how == RATIO_MEAN and sequence_level)


def combine(key: str, rows: list[tuple[float, float]]) -> float:
    """One value from (value, weight) of each rank, as ``key`` declares."""
    how = reduction(key)
    values = [v for v, _ in rows]
    if how == SUM:
        return sum(values)
    if how == SAME:
        return values[0]
    live = [v for v, w in rows if w > 0] or values
    if how == MAX:
        return max(live)
    if how == MIN:
        return min(live)
    total = sum(w for _, w in rows)
    if total <= 0:
        return sum(values) / len(values)
    return sum(v * w for v, w in rows) / total


def reduce_metrics(everyone: list[tuple[dict, float]], own: dict) -> dict:
    """One step-metrics dict from (metrics, rows) of every rank; ``own``: this rank's. Keys
    reported by some ranks only are reduced over those; a key no rank reports as a number keeps
    this rank's value."""
    keys = list(dict.fromkeys(k for m, _ in everyone for k in m))
    out = {}
    for key in keys:
        present = [(m, w) for m, w in everyone if isinstance(m.get(key), (int, float))]
        how = reduction(key)
        mean_key = key[:-3] + "mean"
        if not present:
            out[key] = own.get(key)
        elif how == POOLED_STD and all(mean_key in m for m, _ in present):
            out[key] = pooled_std([(m[key], m[mean_key], w) for m, w in present])
        else:
            out[key] = combine(key, [(m[key], w * bucket_share(m, key)) for m, w in present])
    return out


def bucket_share(metrics: dict, key: str) -> float:
    """A BUCKET_MEAN stat (``length/lo-hi/x``) is weighted by its bucket's rows: its ``frac``."""
    parent = key.rsplit("/", 1)[0]
    if reduction(key) == BUCKET_MEAN and parent + "/frac" in metrics:
        return float(metrics[parent + "/frac"])
    return 1.0


def pooled_std(parts: list[tuple[float, float, float]]) -> float:
    """Bessel-corrected std of the union of the ranks' samples, from each rank's (std, mean, n)."""
    parts = [(s, m, n) for s, m, n in parts if n > 0]
    n = sum(k for _, _, k in parts)
    if n <= 1 or len(parts) == 1:
        return parts[0][0] if parts else float("nan")
    mean = sum(m * k for _, m, k in parts) / n
    sq = sum(((k - 1) * s * s if k > 1 else 0.0) + k * (m - mean) ** 2 for s, m, k in parts)
    return (sq / (n - 1)) ** 0.5
