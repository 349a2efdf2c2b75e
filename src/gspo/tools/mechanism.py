"""`gspo mechanism`: GSPO's mechanism claim measured on a fixed sampled batch, for any checkpoint.

The claim (GSPO paper §3-4; docs/mechanism.md): token-level importance weights under-correct a
response's distribution shift and put each token's local fluctuation into the gradient, so that
their noise grows with response length, with how far the policy moved from the sampler, and, in a
MoE, with how much of its routing changed; the sequence-level ratio (a length-normalised mean of
the token log-ratios) stays in range. This module holds one sampled batch (a `Probe`) fixed and
measures, per objective (gspo, grpo, gspo_token at their paper clip ranges, and gspo and grpo
with the clip opened, `UNCLIPPED`, to see the weighting apart from the clip):

* the per-response gradients g_i = Σ_t c_it ∇θ log π_θ(y_it) (one backward per response and
  distinct weighting; c from gspo.core.grad_noise.token_loss_weights), then the signal-to-noise of a
  minibatch's gradient (B = N / train.minibatches responses) and its cosine to the full-batch one;
* the token log-ratios' spread within a response against the sequence ratio's deviation, and the
  shares of tokens and responses outside each clip range (gspo.core.grad_noise.ratio_dispersion);

at policies moved from the sampler in two ways (`MOVES`): k optimizer steps on the batch's
minibatches (the off-policy degree of minibatch m = k + 1 under M > 1), and, on a MoE, router
noise that changes a target share of (token, layer) expert choices at fixed dense weights, with
and without Routing Replay.

The policy is moved the same way whatever objective is measured (AdamW on the plain policy
gradient −Â_i mean_t log π_θ, every objective's gradient at ratio 1), so the objectives are
compared on the same π_θ: what differs is only their estimator. This module deliberately is not
a training loop and writes nothing into the run it reads.

Shapes: N responses, L prompt + response columns, T response positions, D parameters.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from gspo.config import load_config
from gspo.core import objectives
from gspo.core.advantages import group_advantages
from gspo.core.grad_noise import minibatch_noise, ratio_dispersion, token_loss_weights
from gspo.core.logprobs import response_logprobs
from gspo.models import moe
from gspo.models.presets import DTYPES, load_model
from gspo.registry import Registry
from gspo.rewards.sources import build_rewards
from gspo.rollout.data import build_task
from gspo.rollout.generate import SamplingParams, generate
from gspo.tools.compare_stats import compare_means, mean_std, pm
from gspo.training.checkpoint import list_checkpoints

OBJECTIVES = ("gspo", "grpo", "gspo_token")
"""Measured by default at their paper clip ranges: the sequence-level ratio, the token-level one,
and GSPO-token."""
UNCLIPPED = {"gspo_noclip": "gspo", "grpo_noclip": "grpo"}
"""Also measured: the same weights with the clip opened (ε_low = 1, ε_high = ∞), so that the
weighting's own noise is seen apart from what the clip removes."""
NO_CLIP = {"eps_low": 1.0, "eps_high": math.inf}
PAIR_NO_CLIP = ("grpo_noclip", "gspo_noclip")
"""(token-level, sequence-level) weights without a clip."""
STEPS = (0, 1, 2, 4, 8)
"""Off-policy degrees: optimizer steps between the sampler and the measured policy."""
ROUTING = (0.0, 0.05, 0.10, 0.20, 0.30)
"""Target shares of (token, layer) pairs whose top-k expert set the router noise changes."""


# ----------------------------------------------------------------------------- the fixed batch

@dataclass
class Probe:
    """One sampled batch, held fixed while the policy moves."""
    input_ids: Tensor        # [N, L] prompt (left-padded) + response (right-padded)
    attention_mask: Tensor   # [N, L]
    response_mask: Tensor    # [N, T]
    advantages: Tensor       # [N] group advantages of the run's rewards
    old_logp: Tensor         # [N, T] the sampler's log-probs (π_old), recomputed
    routing: Tensor | None   # [N, L, layers, k] π_old's experts (MoE), for replay
    temperature: float
    minibatch: int           # B = N / train.minibatches


def logprobs(model: nn.Module, probe: Probe, rows: slice = slice(None), *, replay: bool = False,
             grad: bool = False) -> Tensor:
    """[n, T] log π of the probe's `rows` (with graph when `grad`), replaying π_old's experts."""
    ids, att, rm = probe.input_ids[rows], probe.attention_mask[rows], probe.response_mask[rows]
    ctx = moe.replay_routing(model, probe.routing[rows]) if replay else contextlib.nullcontext()
    with ctx, torch.set_grad_enabled(grad):
        return response_logprobs(model, ids, att, rm, temperature=probe.temperature,
                                 with_entropy=False, trim=not replay).logp


def sample_probe(model: nn.Module, tokenizer, cfg, *, prompts: int, seed: int) -> Probe:
    """Sample `prompts` x rollout.group_size responses to training prompts (seeded), score them
    with the run's rewards and compute the group advantages and π_old's log-probs (and experts)."""
    task = build_task(cfg)
    pool = task.split("train")
    pick = torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed))[:prompts]
    examples = [pool[i] for i in pick.tolist()]
    G = cfg.rollout.group_size
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens,
                            temperature=cfg.rollout.temperature)
    with torch.no_grad():
        batch = generate(model, tokenizer, examples, params, group_size=G, seed=seed)
    scorer = build_rewards([r.model_dump() for r in cfg.rewards.sources], task)
    rewards = scorer(batch.completions, batch.examples).total               # [N]
    adv = group_advantages(rewards, G, scale=cfg.advantage.scale, eps=cfg.advantage.eps)
    N = batch.input_ids.shape[0]
    probe = Probe(batch.input_ids, batch.attention_mask, batch.response_mask.float(), adv,
                  old_logp=None, routing=None, temperature=cfg.rollout.temperature,
                  minibatch=max(1, N // cfg.train.minibatches))
    if moe.supports_moe(model):
        with torch.no_grad(), moe.capture_routing(model) as cap:
            out = response_logprobs(model, probe.input_ids, probe.attention_mask, probe.response_mask,
                                    temperature=probe.temperature, with_entropy=False)
        probe.old_logp, probe.routing = out.logp, cap.routing
    else:
        probe.old_logp = logprobs(model, probe)
    return probe


# ----------------------------------------------------------------------------- one policy state

def response_gradients(model: nn.Module, probe: Probe, weights: dict[str, Tensor], *,
                       replay: bool = False) -> dict[str, Tensor]:
    """Per objective [N, D]: g_i = Σ_t c_it ∇θ log π_θ(y_it), one forward per response and one
    backward per distinct weight row (the Jacobian is the same; only c differs: GSPO-token's
    weights equal GSPO's when Â_it = Â_i, and its gradient is then copied, not recomputed)."""
    params = [p for p in model.parameters() if p.requires_grad]
    N = probe.input_ids.shape[0]
    out = {name: torch.zeros(N, sum(p.numel() for p in params)) for name in weights}
    for i in range(N):
        if probe.response_mask[i].sum() == 0:
            continue
        lp = logprobs(model, probe, slice(i, i + 1), replay=replay, grad=True)   # [1, T]
        done: list[str] = []
        for name, c in weights.items():
            twin = next((d for d in done if torch.equal(weights[d][i], c[i])), None)
            if twin is not None:
                out[name][i] = out[twin][i]
            elif c[i].any():
                grads = torch.autograd.grad(lp, params, grad_outputs=c[i:i + 1].to(lp.dtype),
                                            retain_graph=True, allow_unused=True)
                out[name][i] = torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1)
                                          for g, p in zip(grads, params)])
            done.append(name)
    return out


def measure_state(model: nn.Module, probe: Probe, names: tuple[str, ...] = OBJECTIVES, *,
                  unclipped: dict[str, str] = UNCLIPPED, replay: bool = False, seed: int = 0,
                  draws: int = 256) -> dict:
    """Every number of one policy state: ratio dispersion, and per objective (and per `unclipped`
    variant: name -> objective with the clip opened) its clip shares and its minibatch
    gradient's signal-to-noise and cosine to the full-batch gradient."""
    logp = logprobs(model, probe, replay=replay)                               # [N, T]
    mask, adv = probe.response_mask, probe.advantages
    row = {"dispersion": _dispersion(logp, probe, names)}
    weights, stats = {}, {}
    variants = {**{n: (n, {}) for n in names}, **{v: (n, NO_CLIP) for v, n in unclipped.items()}}
    for name, (objective, hyper) in variants.items():
        weights[name], stats[name] = token_loss_weights(objective, logp, probe.old_logp, adv, mask,
                                                        **hyper)
    grads = response_gradients(model, probe, weights, replay=replay)
    for name in variants:
        noise = minibatch_noise(grads[name], probe.minibatch, draws=draws,
                                generator=torch.Generator().manual_seed(seed))
        row[name] = {**{k: float(v) for k, v in noise.items()},
                     "clip_frac_tokens": float(stats[name]["clip_frac_tokens"]),
                     "clip_frac_seqs": float(stats[name]["clip_frac_seqs"])}
    return row


def _dispersion(logp: Tensor, probe: Probe, names: tuple[str, ...]) -> dict:
    """Means over the responses of `ratio_dispersion`, bands per objective's paper clip range."""
    out = {}
    for name in names:
        eps = objectives.resolve(name)
        d = ratio_dispersion(logp, probe.old_logp, probe.response_mask,
                             eps_low=eps["eps_low"], eps_high=eps["eps_high"])
        live = d["length"] > 0
        out[f"token_out/{name}"] = float(d["token_out"][live].mean())
        out[f"seq_out/{name}"] = float(d["seq_out"][live].mean())
    live = probe.response_mask.sum(-1) > 0
    for key in ("token_spread", "token_dev", "seq_dev", "length"):
        out[key] = float(d[key][live].mean())
    return out


# ----------------------------------------------------------------------------- moving the policy

def drift(model: nn.Module, probe: Probe, ks: tuple[int, ...], *, lr: float, grad_clip: float,
          seed: int) -> Iterator[tuple[int, nn.Module]]:
    """A copy of `model` after k AdamW steps for each k in `ks` (ascending), each step on the next
    minibatch of B responses (reshuffled every pass), on the plain policy gradient
    −(1/B) Σ_i Â_i mean_t log π_θ(y_it): every objective's gradient at ratio 1."""
    moved = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in moved.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    N, B = probe.input_ids.shape[0], probe.minibatch
    order: list[int] = []
    done = 0
    for k in sorted(ks):
        while done < k:
            if len(order) < B:
                order += torch.randperm(N, generator=g).tolist()
            rows, order = torch.tensor(order[:B]), order[B:]
            sub = _rows(probe, rows)
            logp = logprobs(moved, sub, grad=True)                             # [B, T]
            m = sub.response_mask
            per_seq = (logp * m).sum(-1) / m.sum(-1).clamp(min=1)               # [B] mean_t log π
            loss = -(sub.advantages * per_seq).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(moved.parameters(), grad_clip)
            opt.step()
            done += 1
        yield k, moved


def _rows(probe: Probe, rows: Tensor) -> Probe:
    """The probe restricted to `rows` (routing too)."""
    pick = lambda t: None if t is None else t[rows]
    return Probe(probe.input_ids[rows], probe.attention_mask[rows], probe.response_mask[rows],
                 probe.advantages[rows], pick(probe.old_logp), pick(probe.routing),
                 probe.temperature, probe.minibatch)


def router_noise(model: nn.Module, sigma: float, seed: int) -> nn.Module:
    """A copy of `model` whose router weights get Gaussian noise of `sigma` x each router's own
    weight std; every other weight (attention, experts, embeddings) unchanged."""
    noisy = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in moe.moe_layers(noisy):
            w = layer.router.weight
            w.add_(torch.randn(w.shape, generator=g).to(w) * (sigma * w.std()))
    return noisy


def routing_change(model: nn.Module, probe: Probe) -> float:
    """Share of the probe's (response token, layer) pairs whose top-k set differs from π_old's."""
    with torch.no_grad(), moe.capture_routing(model) as cap:
        response_logprobs(model, probe.input_ids, probe.attention_mask, probe.response_mask,
                          temperature=probe.temperature, with_entropy=False)
    T = probe.response_mask.shape[1]
    rate, _ = moe.routing_change_rate(moe.response_routing(probe.routing, T),
                                      moe.response_routing(cap.routing, T), probe.response_mask)
    return float(rate)


def calibrate_router_noise(model: nn.Module, probe: Probe, target: float, *, seed: int,
                           iterations: int = 8) -> tuple[float, float]:
    """(sigma, measured change): bisection in log sigma for a routing change near `target`."""
    if target <= 0:
        return 0.0, 0.0
    lo, hi = 1e-3, 4.0
    best = (hi, routing_change(router_noise(model, hi, seed), probe))
    for _ in range(iterations):
        mid = math.sqrt(lo * hi)
        rate = routing_change(router_noise(model, mid, seed), probe)
        if abs(rate - target) < abs(best[1] - target):
            best = (mid, rate)
        lo, hi = (mid, hi) if rate < target else (lo, mid)
    return best


# ----------------------------------------------------------------------------- the two axes

MOVES: Registry[Callable[..., list[dict]]] = Registry("mechanism axis")


@MOVES.register("steps")
def steps_axis(model, probe, cfg, *, seed: int, ks: tuple[int, ...] = STEPS, log=print) -> list[dict]:
    """One row per off-policy degree k (optimizer steps at train.lr away from the sampler)."""
    rows = []
    for k, moved in drift(model, probe, ks, lr=cfg.train.lr, grad_clip=cfg.train.grad_clip, seed=seed):
        rows.append({"axis": "steps", "level": k, **measure_state(moved, probe, seed=seed)})
        log(f"  steps k={k}: done")
    return rows


@MOVES.register("routing")
def routing_axis(model, probe, cfg, *, seed: int, targets: tuple[float, ...] = ROUTING,
                 log=print) -> list[dict]:
    """One row per target routing change and replay setting (router noise at fixed dense weights)."""
    rows = []
    for target in targets:
        sigma, rate = calibrate_router_noise(model, probe, target, seed=seed)
        noisy = router_noise(model, sigma, seed) if sigma > 0 else model
        for replay in (False, True):
            rows.append({"axis": "routing", "level": target, "replay": replay, "sigma": sigma,
                         "routing_change": rate,
                         **measure_state(noisy, probe, replay=replay, seed=seed)})
        log(f"  routing target {target:.2f}: sigma {sigma:.3g}, change {rate:.3f}")
    return rows


# ----------------------------------------------------------------------------- user entry

def load_target(target: str | Path, config: str | None = None, overrides: list[str] = ()):
    """(cfg, model, tokenizer) of a run folder (its config.yaml, its latest checkpoint) or of a
    checkpoint directory (with `config`, or the config.yaml of the run folder it sits in)."""
    path = Path(target)
    if (path / "config.json").is_file():                  # a checkpoint (or any transformers dir)
        run_cfg = path.parent.parent / "config.yaml"
        cfg_path = config or (run_cfg if run_cfg.is_file() else None)
        ckpt = path
    else:
        cfg_path = config or path / "config.yaml"
        found = list_checkpoints(path)
        if not found:
            raise FileNotFoundError(f"{path}: no checkpoints/ (and not a checkpoint directory)")
        ckpt = found[-1]
    if cfg_path is None or not Path(cfg_path).is_file():
        raise FileNotFoundError(f"{target}: no config.yaml beside it; pass --config")
    cfg = load_config(cfg_path, list(overrides))
    model, tokenizer = load_model(ckpt, DTYPES[cfg.model.dtype], key="checkpoint")
    return cfg, model.train(False), tokenizer


def measure(cfg, model: nn.Module, tokenizer, *, seeds: tuple[int, ...] = (0, 1, 2, 3, 4),
            prompts: int = 4, axes: tuple[str, ...] | None = None, log=print) -> dict:
    """Measure `model` under the run config `cfg` at every seed: a fresh batch per seed, then
    every axis (default: steps, and routing when the model is a MoE)."""
    axes = axes or (("steps", "routing") if moe.supports_moe(model) else ("steps",))
    rows = []
    for seed in seeds:
        probe = sample_probe(model, tokenizer, cfg, prompts=prompts, seed=seed)
        log(f"seed {seed}: N = {probe.input_ids.shape[0]}, mean length "
            f"{float(probe.response_mask.sum(-1).mean()):.1f}, B = {probe.minibatch}")
        for axis in axes:
            rows += [{"seed": seed, **r} for r in MOVES.get(axis)(model, probe, cfg, seed=seed, log=log)]
    return {"objectives": list(OBJECTIVES), "unclipped": UNCLIPPED, "axes": list(axes), "prompts": prompts,
            "group_size": cfg.rollout.group_size, "minibatches": cfg.train.minibatches,
            "lr": cfg.train.lr, "rows": rows}


# ----------------------------------------------------------------------------- summaries

def cells(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Rows grouped by (axis, level, replay): one list over seeds per cell."""
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault((r["axis"], r["level"], r.get("replay", False)), []).append(r)
    return out


def stat(rows: list[dict], get: Callable[[dict], float]) -> dict:
    """mean_std over seeds of a finite per-row value (inf and NaN left out)."""
    values = [get(r) for r in rows]
    return mean_std([v for v in values if v is not None and math.isfinite(v)])


def noise_gap(row: dict, token: str = "grpo", sequence: str = "gspo") -> float | None:
    """snr(sequence) / snr(token): above 1 when the token-level estimate is the noisier one."""
    if sequence not in row or token not in row:
        return None
    a, b = row[sequence]["snr"], row[token]["snr"]
    return a / b if b > 0 and math.isfinite(a) and math.isfinite(b) else None


VERDICT_WORDS = {"better": "yes", "worse": "no (the opposite)", "within": "within the seed spread"}
"""compare_means' outcome as an answer to "is the token-level estimate the noisier one?"."""
EXACT_ONE = {"mean": 1.0, "std": 0.0, "min": 1.0, "max": 1.0, "n": 2}
"""The gap on-policy: every ratio is 1, every objective has the same gradient (std 0)."""


def gap_verdict(rows: list[dict], token: str = "grpo", sequence: str = "gspo") -> dict:
    """Is the token-level estimate noisier than the sequence-level one on these rows (one cell,
    one row a seed)? The per-seed gap snr(sequence)/snr(token) is paired on the same batch and
    the same π_θ; on-policy it is exactly 1. Verdict as in `gspo compare`: 'yes' when its mean
    exceeds 1 by more than its seed std, 'no (the opposite)' when it is below 1 by more."""
    gap = mean_std([noise_gap(r, token, sequence) for r in rows])
    return {"gap": gap, "verdict": VERDICT_WORDS[compare_means(gap, EXACT_ONE)]}


def verdicts(rows: list[dict]) -> list[str]:
    """One line per axis: the gap at its farthest level (and with and without replay)."""
    lines = []
    for (axis, level, replay), rs in sorted(cells(rows).items()):
        top = max(r["level"] for r in rows if r["axis"] == axis)
        if level != top:
            continue
        where = f"{axis} = {level:g}" + (f", {'with' if replay else 'without'} replay" if axis == "routing" else "")
        pairs = [("grpo", "gspo")] + ([PAIR_NO_CLIP] if PAIR_NO_CLIP[0] in rs[0] else [])
        for token, sequence in pairs:
            v = gap_verdict(rs, token, sequence)
            lines.append(f"* {where}: snr {sequence} / snr {token} = {pm(v['gap'], '.3g')}; "
                         f"token-level noisier beyond the seed spread? **{v['verdict']}**")
    return lines


def write(results: dict, out: str | Path) -> Path:
    """OUT/mechanism.json and OUT/mechanism.md (the tables and the verdict lines)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mechanism.json").write_text(json.dumps(results, indent=1))
    lines = [*table(results["rows"]), "", *verdicts(results["rows"])]
    (out / "mechanism.md").write_text("\n".join(lines) + "\n")
    return out / "mechanism.md"


def table(rows: list[dict], names: tuple[str, ...] = (*OBJECTIVES, *UNCLIPPED)) -> list[str]:
    """Two tables, one line per cell (mean ± std over seeds): each objective's snr and cosine;
    then the ratio dispersion, the band shares and the clip decisions."""
    key = lambda rs: sorted(cells(rs).items())
    where = lambda axis, level, replay, rs: (f"| {axis} | {level:g} | {'yes' if replay else 'no'} "
                                             f"| {len(rs)} |")
    head = ("| axis | level | replay | seeds | " + " | ".join(f"snr {n}" for n in names) + " | "
            + " | ".join(f"cos {n}" for n in names) + " |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for (axis, level, replay), rs in key(rows):
        snr = [pm(stat(rs, lambda r, n=n: r.get(n, {}).get("snr")), ".3g") for n in names]
        cos = [pm(stat(rs, lambda r, n=n: r.get(n, {}).get("cosine")), ".3f") for n in names]
        lines.append(where(axis, level, replay, rs) + " " + " | ".join(snr + cos) + " |")
    head = ("| axis | level | replay | seeds | token spread | token dev | seq dev | tokens out (grpo) "
            "| seqs out (gspo) | clipped tokens grpo | clipped seqs gspo | routing change |")
    lines += ["", head, "|" + "---|" * (head.count("|") - 1)]
    for (axis, level, replay), rs in key(rows):
        d = lambda k: pm(stat(rs, lambda r: r["dispersion"][k]), ".3g")
        c = lambda n, k: pm(stat(rs, lambda r: r[n][k]), ".3g")
        change = pm(stat(rs, lambda r: r.get("routing_change")), ".3f", "–")
        lines.append(where(axis, level, replay, rs) + f" {d('token_spread')} | {d('token_dev')} | "
                     f"{d('seq_dev')} | {d('token_out/grpo')} | {d('seq_out/gspo')} | "
                     f"{c('grpo', 'clip_frac_tokens')} | {c('gspo', 'clip_frac_seqs')} | {change} |")
    return lines


def median_length(rows: list[dict]) -> float:
    """Median of the rows' mean response lengths."""
    return statistics.median(r["dispersion"]["length"] for r in rows)
