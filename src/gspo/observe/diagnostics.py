"""Diagnostics beside the loss: length slices and the generator-vs-trainer log-prob mismatch.

Length slices: responses are put in
``n`` equal-width buckets of length over 1..max_new_tokens (fixed edges, so a bucket means the
same thing at every step and in every run); per bucket the share of responses, mean reward,
accuracy, clipped fraction and mean ratio, the last two from the objective itself on the rows of
the bucket, at the log-probs used in training.

Pure functions of tensors (no model, no I/O), plus ``plot_length_slices`` for the report. Not a
second implementation of any objective: clip and ratio figures come from the registry's function.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

# ----------------------------------------------------------------------------- length slices


def length_buckets(max_new_tokens: int, n: int) -> list[tuple[int, int]]:
    """``n`` equal-width (lo, hi) length ranges covering 1..max_new_tokens, fewer if it is short.

    >>> length_buckets(16, 4)
    [(1, 4), (5, 8), (9, 12), (13, 16)]
    """
    n = min(n, max_new_tokens)
    edges = [max_new_tokens * k // n for k in range(n + 1)]
    return [(edges[k] + 1, edges[k + 1]) for k in range(n)]


def bucket_name(lo: int, hi: int) -> str:
    return f"{lo}-{hi}"


def length_slices(lengths: Tensor, rewards: Tensor, correct: Tensor, logp: Tensor,
                  old_logp: Tensor, advantages: Tensor, mask: Tensor, *, objective,
                  objective_kwargs: dict, buckets: list[tuple[int, int]],
                  prefix: str = "length/") -> dict[str, float]:
    """Per length bucket: frac, reward, accuracy, clip_frac (tokens) and ratio (the objective's).

    lengths [N] response lengths |y_i|; rewards [N]; correct [N] bool; logp / old_logp / mask
    [N, T] as the objective receives them (mask: the loss mask); advantages [N].
    A bucket without responses reports only its frac (0).
    """
    N = len(lengths)
    keys, values = [], []
    for lo, hi in buckets:
        key = f"{prefix}{bucket_name(lo, hi)}"
        rows = ((lengths >= lo) & (lengths <= hi)).nonzero().squeeze(-1)        # [n_b]
        keys.append(f"{key}/frac")
        values.append(torch.tensor(len(rows) / max(N, 1)))
        if len(rows) == 0:
            continue
        _, stats = objective(logp[rows], old_logp[rows], advantages[rows], mask[rows],
                             **objective_kwargs)
        keys += [f"{key}/accuracy", f"{key}/clip_frac", f"{key}/ratio"]
        values += [correct[rows].float().mean(), stats["clip_frac_tokens"], stats["ratio_mean"]]
        scored = rewards[rows].float()
        scored = scored[scored.isfinite()]  # NaN: dropped by rewards.on_error=drop (not scored)
        if len(scored):
            keys.append(f"{key}/reward")
            values.append(scored.mean())
    numbers = torch.stack([v.detach().float().cpu() for v in values]).tolist() if values else []
    return dict(zip(keys, numbers))


# ----------------------------------------------------------------------------- mismatch


def logprob_mismatch(rollout_logp: Tensor, trainer_logp: Tensor, mask: Tensor,
                     prefix: str = "mismatch/") -> dict[str, float]:
    """Generator vs trainer log-probs of the same tokens (paper §5.4): token and sequence level.

    token_abs_mean / token_abs_max: |log p_gen − log p_train| over response tokens;
    seq_logratio_abs_mean / _max: |(1/|y_i|) Σ_t m (log p_gen − log p_train)|, the error a
    sequence-level (GSPO) ratio sees.
    """
    m = mask.float()                                                      # [N, T]
    d = (rollout_logp.float() - trainer_logp.float()) * m                 # [N, T]
    seq = d.sum(-1) / m.sum(-1).clamp(min=1)                              # [N]
    values = torch.stack([d.abs().sum() / m.sum().clamp(min=1), d.abs().max(),
                          seq.abs().mean(), seq.abs().max()]).tolist()
    names = ["token_abs_mean", "token_abs_max", "seq_logratio_abs_mean", "seq_logratio_abs_max"]
    return {prefix + k: v for k, v in zip(names, values)}


# ----------------------------------------------------------------------------- plot


SLICE_STATS = [("reward", "reward"), ("accuracy", "accuracy"), ("clip_frac", "clipped tokens"),
               ("ratio", "mean ratio")]


def plot_length_slices(rows: list[dict], path: Path, prefix: str = "length/") -> bool:
    """Four panels (reward, accuracy, clip fraction, ratio), one line per length bucket."""
    buckets = sorted({k[len(prefix):].split("/")[0] for r in rows for k in r if k.startswith(prefix)},
                     key=lambda b: int(b.split("-")[0]))
    if not buckets:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 2, figsize=(9, 6), sharex=True)
    for ax, (stat, title) in zip(axes.flat, SLICE_STATS):
        for b in buckets:
            key = f"{prefix}{b}/{stat}"
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if pts:
                ax.plot(*zip(*pts), marker="o" if len(pts) < 30 else None, lw=1.2, label=f"|y| {b}")
        ax.set_title(f"{title} by response length")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("RL step")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True
