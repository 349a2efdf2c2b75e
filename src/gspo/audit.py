"""Rollout records and their offline audit: prove masks, ratios, clipping and loss after the fact.

Training (``audit.every: K``) writes, for every K-th RL step, ``RUN/audit/step_NNNNNN/``::

    batch.safetensors   token ids, masks, rewards, advantages, π_old log-probs, the log-probs
                        each row was trained on, π_new log-probs, per-row ratio and clip share
                        as the objective computed them, minibatch of each row (+ generator
                        log-probs, MoE routing when present)
    record.json         objective + resolved hyper-parameters + aggregation, sampling
                        parameters, seeds, minibatch losses, the step's logged metrics, prompts
    policy_old/         π_old (the model before this step's updates): a transformers checkpoint
    policy_new/         π_new (right after them, before the guard looked at the step)

``gspo audit RUN_DIR [--step N]`` reloads both policies and recomputes, with code independent of
the trainer where it matters: the mask / EOS / padding invariants, rewards (re-scored) and
advantages, π_old and π_new log-probs, GSPO's log s_i = mean of token log-ratios, the clip
decisions, and the loss of every minibatch. It prints a table and exits 0 when all agree within
tolerance, 1 otherwise, naming the step and the field. Tensors only through safetensors, the rest
JSON: nothing is pickled. It is not a replay of training (the optimizer is not re-run).

Shapes: N sequences, T response positions, L prompt + response columns.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from gspo import objectives
from gspo.isolation import drop_aware
from gspo.models import save_model

FORMAT = 1
AUDIT_DIR = "audit"
PREFIX = "step_"
EXIT_MISMATCH = 1


def record_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / AUDIT_DIR / f"{PREFIX}{step:06d}"


def list_records(run_dir: str | Path) -> list[int]:
    root = Path(run_dir) / AUDIT_DIR
    if not root.is_dir():
        return []
    return sorted(int(p.name[len(PREFIX):]) for p in root.iterdir()
                  if p.is_dir() and p.name.startswith(PREFIX) and (p / "record.json").is_file())


# ----------------------------------------------------------------------------- recording

class Recorder:
    """Writes the audit record of every ``every``-th RL step (the trainer calls begin / finish)."""

    def __init__(self, every: int, run_dir: str | Path):
        self.every, self.run_dir = every, Path(run_dir)

    def due(self, step: int) -> bool:
        """``step`` 0-based; records are named by the logged (1-based) step."""
        return self.every > 0 and (step + 1) % self.every == 0

    def _tmp(self, step: int) -> Path:
        final = record_dir(self.run_dir, step + 1)
        return final.with_name(f".{final.name}.tmp")

    def begin(self, trainer, step: int) -> None:
        """Before the updates: save π_old."""
        if not self.due(step):
            return
        tmp = self._tmp(step)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_model(trainer.model, trainer.tokenizer, tmp / "policy_old")

    @torch.no_grad()
    def finish(self, trainer, step: int, batch, rewards: Tensor, advantages: Tensor,
               old_logp: Tensor, record: dict, metrics: dict) -> None:
        """After the updates: save π_new, the batch and what the trainer computed, then publish."""
        if not self.due(step):
            return
        tmp, cfg = self._tmp(step), trainer.cfg
        save_model(trainer.model, trainer.tokenizer, tmp / "policy_new")
        was_training = trainer.model.training
        trainer.model.eval()
        with trainer.routing_context(batch):
            new_logp = trainer._logprobs(trainer.model, batch, with_entropy=False).logp   # [N, T]
        trainer.model.train(was_training)
        kwargs = trainer.objective_kwargs(0)
        ratio, clip = per_row_stats(trainer.objective, record["logp"], old_logp, advantages,
                                    record["mask"], kwargs)
        tensors = {
            "input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
            "response_mask": batch.response_mask, "truncated": batch.truncated,
            "lengths": batch.lengths, "rewards": rewards, "advantages": advantages,
            "old_logp": old_logp, "loss_mask": record["mask"], "used_logp": record["logp"],
            "minibatch": record["minibatch"], "new_logp": new_logp,
            "row_ratio": ratio, "row_clip_frac": clip,
        }
        if batch.rollout_logp is not None:
            tensors["rollout_logp"] = batch.rollout_logp
        if "routing" in batch.extras:
            tensors["routing"] = batch.extras["routing"]
        if "dropped" in batch.extras:  # reward.on_error=drop: rows left out of the loss
            tensors["dropped"] = batch.extras["dropped"]
        save_file({k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()},
                  str(tmp / "batch.safetensors"))
        spec = trainer.spec
        meta = {
            "format": FORMAT, "step": step + 1, "run_seed": cfg.seed,
            "objective": {"name": spec.name, "sequence_level": spec.sequence_level,
                          "kwargs": {**dict(spec.defaults), **kwargs}},
            "token_aggregation": trainer.token_aggregation(),
            "train": {k: getattr(cfg.train, k) for k in
                      ("old_logprobs", "mask_truncated", "minibatches", "beta", "entropy_coef",
                       "logprob_chunk")},
            "advantage": {"estimator": cfg.advantage.estimator, "scale": cfg.advantage.scale,
                          "eps": cfg.advantage.eps, "group_size": cfg.rollout.group_size},
            "moe": cfg.moe.model_dump(),
            "sampling": asdict(trainer.sampling),
            "seeds": {"generation": trainer.rollout_seed(step, 0),
                      "refill_rounds": int(metrics.get("reward/refill_rounds", 0)),
                      "dynamic_sampling": cfg.train.dynamic_sampling,
                      "minibatch": trainer.minibatch_seed(step)},
            "tokens": {"eos_id": trainer.tokenizer.eos_token_id,
                       "pad_id": trainer.tokenizer.pad_token_id},
            "policy_old": "policy_old", "policy_new": "policy_new",
            "minibatch_loss": [float(x) for x in record["loss"]],
            "logged": {k: v for k, v in metrics.items()
                       if isinstance(v, (int, float)) and math.isfinite(v)},
            "completions": batch.completions,
            "examples": [{"prompt": e.prompt, "answer": e.answer, "data": e.data}
                         for e in batch.examples],
        }
        (tmp / "record.json").write_text(json.dumps(meta, indent=1, default=str))
        final = record_dir(self.run_dir, step + 1)
        shutil.rmtree(final, ignore_errors=True)         # a step redone after a roll-back
        tmp.rename(final)


def per_row_stats(objective, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                  kwargs: dict) -> tuple[Tensor, Tensor]:
    """The objective's own ratio_mean and clip_frac_tokens, one row at a time: [N], [N]."""
    ratio, clip = [], []
    for i in range(len(advantages)):
        _, s = objective(logp[i:i + 1], old_logp[i:i + 1], advantages[i:i + 1], mask[i:i + 1],
                         **kwargs)
        ratio.append(s["ratio_mean"])
        clip.append(s["clip_frac_tokens"])
    return torch.stack(ratio).float(), torch.stack(clip).float()


# ----------------------------------------------------------------------------- invariants (pure)

def mask_problems(response_ids: Tensor, mask: Tensor, attention: Tensor, truncated: Tensor,
                  lengths: Tensor, *, eos_id: int, pad_id: int, max_new_tokens: int) -> list[str]:
    """DESIGN.md §1 mask rules, one message per broken rule naming the first bad row.

    mask [N, T] is 0/1, ones then zeros; it ends at the first EOS (a row with EOS has it at
    position |y_i| − 1 and nowhere before); a truncated row has no EOS and |y_i| = max_new_tokens;
    |y_i| = Σ_t mask = the saved length; padding positions hold pad_id; the attention mask over
    the response equals the response mask.
    """
    problems = []

    def first(bad: Tensor, what: str) -> None:
        if bad.any():
            problems.append(f"{what} (row {int(bad.nonzero()[0, 0])}, {int(bad.sum())} rows)")

    binary = (mask == 0) | (mask == 1)
    first(~binary.all(-1), "mask is not 0/1")
    m = mask > 0                                                           # [N, T]
    first((m[:, 1:] & ~m[:, :-1]).any(-1), "mask is not ones-then-zeros")
    n = m.sum(-1)                                                          # [N] |y_i|
    first(n != lengths.long(), "|y_i| differs from the saved length")
    first(n == 0, "empty response")
    is_eos = (response_ids == eos_id) & m                                  # [N, T] masked EOS
    last = (n - 1).clamp(min=0)
    ends_eos = response_ids.gather(1, last[:, None]).squeeze(1) == eos_id  # [N]
    eos_before = (is_eos.cumsum(-1) - is_eos.long()).gather(1, last[:, None]).squeeze(1) > 0
    first(~truncated & ~ends_eos, "mask does not end at an EOS")
    first(eos_before, "an EOS before the end of the mask (must end at the first EOS)")
    first(truncated & is_eos.any(-1), "truncated row holds an EOS")
    first(truncated & (n != max_new_tokens), "truncated row shorter than max_new_tokens")
    first(~truncated & (n > max_new_tokens), "response longer than max_new_tokens")
    first(((response_ids != pad_id) & ~m).any(-1), "padding position holds a non-pad token")
    first((attention.bool() != m).any(-1), "attention mask over the response differs from the mask")
    return problems


# ----------------------------------------------------------------------------- independent math

def seq_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """log s_i = (Σ_t m (logp − old)) / Σ_t m (GSPO Eq. 7), written out here on its own. [N]"""
    m = mask.double()
    return ((logp.double() - old_logp.double()) * m).sum(-1) / m.sum(-1).clamp(min=1)


def _token_ratio_mean(logp, old_logp, mask):
    m = mask.double()
    return (torch.exp(logp.double() - old_logp.double()) * m).sum(-1) / m.sum(-1).clamp(min=1)


def _seq_ratio_mean(logp, old_logp, mask):
    return torch.exp(seq_log_ratio(logp, old_logp, mask))


def _sign_gated(x, adv, low, high):
    return ((adv < 0) & (x < low)) | ((adv > 0) & (x > high))


def _clip_seq(logp, old, adv, mask, k):
    """GSPO / GSPO-token: the whole response is clipped when s_i left the range on Â's side."""
    s = _seq_ratio_mean(logp, old, mask)
    return _sign_gated(s, adv.double(), 1 - k["eps_low"], 1 + k["eps_high"]).double()


def _clip_token_frac(gated):
    def clip(logp, old, adv, mask, k):
        m = mask.double()
        lr = logp.double() - old.double()
        a = adv.double()[:, None].expand_as(lr)
        return (gated(lr, a, k).double() * m).sum(-1) / m.sum(-1).clamp(min=1)
    return clip


def _token_gated(lr, a, k):
    return _sign_gated(lr.exp(), a, 1 - k["eps_low"], 1 + k["eps_high"])


CLIP_RULES = {
    "gspo": _clip_seq,
    "gspo_token": _clip_seq,
    "luspo": _clip_seq,              # GSPO's s_i and clip; only the loss is scaled by |y_i|
    # token ratio r = exp(log r), sign-gated (PPO / GRPO / SAPO's reported clip)
    "grpo": _clip_token_frac(_token_gated),
    "sapo": _clip_token_frac(_token_gated),
    # CISPO: the weight was truncated, whatever the sign of Â
    "cispo": _clip_token_frac(
        lambda lr, a, k: (lr.exp() < 1 - k["eps_low"]) | (lr.exp() > 1 + k["eps_high"])),
    # GMPO: sign-gated in log space
    "gmpo": _clip_token_frac(lambda lr, a, k: _sign_gated(lr, a, -k["eps_low"], k["eps_high"])),
}
"""Clip decision per row (share of its tokens) from DESIGN.md §1, independent of objectives.py."""


def gspo_reference_loss(logp, old_logp, adv, mask, k) -> Tensor:
    """GSPO Eq. 5 with seq-mean in float64, from scratch: −(1/N) Σ_i min(s_i Â_i, clip(s_i) Â_i)."""
    present = mask.sum(-1) > 0
    s = _seq_ratio_mean(logp, old_logp, mask)
    a = adv.double()
    li = -torch.minimum(s * a, s.clamp(1 - k["eps_low"], 1 + k["eps_high"]) * a)
    return li[present].sum() / present.sum().clamp(min=1)


# ----------------------------------------------------------------------------- the audit

@dataclass
class Check:
    name: str
    status: str          # ok | FAIL | warn | skip
    diff: float | None = None
    tol: float | None = None
    detail: str = ""


@dataclass
class Tolerances:
    logp: float = 1e-4
    """Recomputed vs saved log-probs (same weights, same code: equal on CPU up to rounding)."""
    ratio: float = 1e-4
    loss: float = 1e-5
    reward: float = 1e-6
    rollout: float = 1e-3
    """Generator vs recomputed log-probs, when π_old came from the generator (old_logprobs=rollout)."""


def _max_diff(a: Tensor, b: Tensor, where: Tensor | None = None) -> tuple[float, str]:
    d = (a.double() - b.double()).abs()
    if where is not None:
        d = torch.where(where, d, torch.zeros_like(d))
    if d.numel() == 0:
        return 0.0, ""
    at = torch.nonzero(d == d.max())[0].tolist() if torch.isfinite(d).all() else \
        torch.nonzero(~torch.isfinite(d))[0].tolist()
    loc = f"row {at[0]}" + (f", t {at[1]}" if len(at) > 1 else "")
    return float(d.max()), loc


def _compare(name: str, a: Tensor, b: Tensor, tol: float, where=None, what: str = "") -> Check:
    diff, loc = _max_diff(a, b, where)
    ok = math.isfinite(diff) and diff <= tol
    detail = what if ok else f"{what}; worst at {loc}".strip("; ")
    return Check(name, "ok" if ok else "FAIL", diff, tol, detail)


class AuditError(ValueError):
    """No record to audit, or a record that cannot be read (a user error: exit 2)."""


def _load_record(path: Path) -> tuple[dict, dict]:
    try:
        meta = json.loads((path / "record.json").read_text())
        tensors = load_file(str(path / "batch.safetensors"))
    except (OSError, ValueError) as err:
        raise AuditError(f"{path}: unreadable audit record ({err})") from None
    return meta, tensors


def _logprobs(model, t: dict, meta: dict, temperature: float) -> Tensor:
    from gspo import moe
    from gspo.logprobs import response_logprobs
    replay = meta["moe"].get("routing_replay", "none") != "none" and "routing" in t
    import contextlib
    ctx = moe.replay_routing(model, t["routing"]) if replay else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        return response_logprobs(model, t["input_ids"], t["attention_mask"], t["response_mask"],
                                 temperature=temperature, chunk_size=meta["train"]["logprob_chunk"],
                                 with_entropy=False).logp


@dataclass
class Recomputed:
    """What the audit recomputes once and every section reads."""
    old: Tensor          # [N, T] π_old log-probs from policy_old
    new: Tensor          # [N, T] π_new log-probs from policy_new
    tokenizer: object


def audit_step(run_dir: Path, step: int, tol: Tolerances, cfg=None) -> tuple[list[Check], dict]:
    """All checks of one recorded step: inputs, log-probs, then the objective's arithmetic."""
    from gspo.config import load_config
    from gspo.models import load_model
    from gspo.trainer import DTYPES
    path = record_dir(run_dir, step)
    meta, t = _load_record(path)
    cfg = cfg or load_config(run_dir / "config.yaml")
    dtype, temperature = DTYPES[cfg.model.dtype], meta["sampling"]["temperature"]
    old_model, tokenizer = load_model(path / meta["policy_old"], dtype)
    new_model, _ = load_model(path / meta["policy_new"], dtype)
    r = Recomputed(old=_logprobs(old_model.eval(), t, meta, temperature),
                   new=_logprobs(new_model.eval(), t, meta, temperature), tokenizer=tokenizer)
    checks = [_config_check(cfg, meta)]
    checks += _input_checks(cfg, meta, t, r, tol)
    checks += _logprob_checks(meta, t, r, tol)
    checks += _objective_checks(meta, t, r, tol)
    checks.append(_regenerate(old_model, tokenizer, meta, t))
    return checks, meta


def _config_check(cfg, meta: dict) -> Check:
    """The record's objective and hyper-parameters are the run's (config.yaml, resolved)."""
    k, name, o = meta["objective"]["kwargs"], meta["objective"]["name"], cfg.objective
    given = (("eps_low", o.eps_low), ("eps_high", o.eps_high), ("aggregation", o.aggregation))
    expected = {**dict(objectives.spec(o.name).defaults),
                **{key: v for key, v in given if v is not None}, **o.params,
                "token_sum_norm": float(cfg.rollout.max_new_tokens)}
    differ = sorted(key for key in set(expected) | set(k) if expected.get(key) != k.get(key))
    if name != o.name:
        differ.insert(0, "name")
    return Check("config", "FAIL" if differ else "ok", detail=(
        f"record vs config.yaml differ in objective {', '.join(differ)}" if differ else
        f"{name}, {k['aggregation']}, eps {k['eps_low']:g}/{k['eps_high']:g}"))


def _input_checks(cfg, meta: dict, t: dict, r: Recomputed, tol: Tolerances) -> list[Check]:
    """Masks, completions, rewards and advantages: what the loss was fed besides log-probs."""
    from gspo.rollout import decode
    T = t["response_mask"].shape[1]
    response_ids = t["input_ids"][:, -T:]
    problems = mask_problems(response_ids, t["response_mask"], t["attention_mask"][:, -T:],
                             t["truncated"].bool(), t["lengths"], eos_id=meta["tokens"]["eos_id"],
                             pad_id=meta["tokens"]["pad_id"],
                             max_new_tokens=meta["sampling"]["max_new_tokens"])
    checks = [Check("mask", "FAIL" if problems else "ok", detail="; ".join(problems) or
                    "ones-then-zeros, ends at first EOS, |y|=Σmask, padding masked")]
    loss_mask = t["response_mask"] * (~t["truncated"].bool()).float()[:, None] \
        if meta["train"]["mask_truncated"] else t["response_mask"]
    if "dropped" in t:  # samples whose reward failed under reward.on_error=drop
        loss_mask = loss_mask * (~t["dropped"].bool()).float()[:, None]
    checks.append(_compare("loss_mask", t["loss_mask"], loss_mask, 0.0,
                           what="response mask (minus truncated rows if mask_truncated)"))
    completions = decode(r.tokenizer, response_ids, t["response_mask"])
    bad = [i for i, (a, b) in enumerate(zip(completions, meta["completions"])) if a != b]
    checks.append(Check("completions", "FAIL" if bad else "ok", detail=(
        f"{len(bad)} rows decode differently from the saved text (row {bad[0]})" if bad else
        "token ids decode to the saved text")))
    checks.append(_rescore(cfg, meta, completions, t["rewards"], tol.reward))
    a = meta["advantage"]
    estimator = a.get("estimator", "group")                 # records before rloo: group
    adv = drop_aware(estimator)(t["rewards"], a["group_size"], scale=a["scale"], eps=a["eps"])
    checks.append(_compare("advantages", t["advantages"], adv, 1e-5,
                           what=f"{estimator} advantages of the saved rewards"))
    return checks


def _logprob_checks(meta: dict, t: dict, r: Recomputed, tol: Tolerances) -> list[Check]:
    """π_old and π_new log-probs recomputed from the saved policies vs the saved ones."""
    m = t["response_mask"] > 0
    rollout_mode = meta["train"]["old_logprobs"] == "rollout"
    checks = [_compare("old_logp", t["old_logp"], r.old, tol.rollout if rollout_mode else tol.logp,
                       m, "policy_old recomputed vs saved π_old log-probs"
                       + (" (generator's)" if rollout_mode else ""))]
    if "rollout_logp" in t:
        diff, _ = _max_diff(t["rollout_logp"], r.old, m)
        checks.append(Check("mismatch", "ok" if diff <= tol.rollout else "warn", diff, tol.rollout,
                            "generator vs recomputed log-probs (info)"))
    if not rollout_mode and meta["moe"].get("routing_replay", "none") == "none":
        first_mb = (t["minibatch"] == 0)[:, None] & (t["loss_mask"] > 0)
        checks.append(_compare("on_policy", t["used_logp"], r.old, tol.logp, first_mb,
                               "first minibatch trained on π_old exactly"))
    checks.append(_compare("new_logp", t["new_logp"], r.new, tol.logp, m,
                           "policy_new recomputed vs saved π_new log-probs"))
    return checks


def _objective_checks(meta: dict, t: dict, r: Recomputed, tol: Tolerances) -> list[Check]:
    """Ratios (length normalisation), clip decisions and minibatch losses, recomputed."""
    k, name = meta["objective"]["kwargs"], meta["objective"]["name"]
    lm, used, old = t["loss_mask"], t["used_logp"], r.old
    present = lm.sum(-1) > 0
    seq_level = meta["objective"]["sequence_level"]
    ref_ratio = (_seq_ratio_mean if seq_level else _token_ratio_mean)(used, old, lm)
    checks = [_compare("ratio", t["row_ratio"], ref_ratio, tol.ratio, present,
                       "objective's ratio vs " + ("exp(mean_t log r) = s_i (length-normalised)"
                                                  if seq_level else "mean_t r_it"))]
    checks.append(_compare("seq_ratio_new", seq_log_ratio(t["new_logp"], t["old_logp"], lm),
                           seq_log_ratio(r.new, old, lm), tol.ratio, present,
                           "log s_i(π_new / π_old): saved vs recomputed"))
    rule = CLIP_RULES.get(name)
    if rule is None:
        checks.append(Check("clip", "skip", detail=f"no independent clip rule for {name}"))
    else:
        ref_clip = rule(used, old, t["advantages"], lm, k)
        bad = present & ((ref_clip - t["row_clip_frac"].double()).abs() > 1e-6)
        checks.append(Check("clip", "FAIL" if bad.any() else "ok", float(bad.sum()), 0.0, (
            f"{int(bad.sum())} rows decided differently (row {int(bad.nonzero()[0, 0])})" if bad.any()
            else f"{int((ref_clip[present] > 0).sum())}/{int(present.sum())} rows clipped, as logged")))
    minibatches = [(t["minibatch"] == mb).nonzero().squeeze(-1)
                   for mb in range(len(meta["minibatch_loss"]))]
    objective = objectives.get(name)
    losses = torch.stack([objective(used[i], old[i], t["advantages"][i], lm[i], **k)[0]
                          for i in minibatches]) if minibatches else torch.zeros(0)
    checks.append(_compare("loss", torch.tensor(meta["minibatch_loss"]), losses, tol.loss,
                           what=f"{len(losses)} minibatch losses recomputed ({k['aggregation']})"))
    logged = meta["logged"].get("policy/loss")
    if logged is not None and meta["moe"].get("aux_loss_coef", 0) == 0:
        checks.append(_compare("loss_logged", torch.tensor([logged]), losses.mean()[None], tol.loss,
                               what="mean minibatch loss vs logged policy/loss"))
    if name == "gspo" and k["aggregation"] == "seq-mean":
        ref = torch.stack([gspo_reference_loss(used[i], old[i], t["advantages"][i], lm[i], k)
                           for i in minibatches])
        checks.append(_compare("loss_reference", losses, ref, tol.loss,
                               what="objective vs from-scratch GSPO Eq. 5 (float64)"))
    return checks


def _rescore(cfg, meta, completions, rewards, tol) -> Check:
    from gspo.rewards import build_rewards
    from gspo.tasks import Example
    from gspo.trainer import build_task
    try:
        task = build_task(cfg)
        scorer = build_rewards([r.model_dump() for r in cfg.rewards], task)
        examples = [Example(e["prompt"], e["answer"], e["data"]) for e in meta["examples"]]
        again = scorer(completions, examples).total
    except Exception as err:  # noqa: BLE001 - a reward that cannot be rebuilt here is reported
        return Check("rewards", "skip", detail=f"cannot re-score ({type(err).__name__}: {err})")
    return _compare("rewards", rewards, again, tol, what="re-scored by the run's rewards")


def _regenerate(model, tokenizer, meta, t) -> Check:
    from gspo.rollout import SamplingParams, generate
    from gspo.tasks import Example
    seeds = meta["seeds"]
    if seeds["dynamic_sampling"] or seeds["refill_rounds"]:
        return Check("regenerate", "skip", detail="dynamic sampling: batch assembled from rounds")
    G = meta["advantage"]["group_size"]
    examples = [Example(e["prompt"], e["answer"], e["data"]) for e in meta["examples"][::G]]
    with torch.random.fork_rng(devices=[]):
        again = generate(model, tokenizer, examples, SamplingParams(**meta["sampling"]),
                         group_size=G, seed=seeds["generation"])
    same = again.input_ids.shape == t["input_ids"].shape and torch.equal(again.input_ids, t["input_ids"])
    return Check("regenerate", "ok" if same else "warn", detail=(
        "π_old + prompts + sampling + seed reproduce the token ids" if same else
        "re-sampling gave other tokens (expected on non-deterministic devices)"))


def format_table(step: int, checks: list[Check], meta: dict) -> str:
    k = meta["objective"]["kwargs"]
    head = (f"step {step}: {meta['objective']['name']}, {k['aggregation']}, "
            f"N={len(meta['completions'])}, "
            f"minibatches={len(meta['minibatch_loss'])}")
    lines = [head, f"  {'check':<15}{'result':<7}{'max |diff|':>12}{'tol':>10}  detail"]
    for c in checks:
        diff = "" if c.diff is None else f"{c.diff:.3g}"
        tol = "" if c.tol is None else f"{c.tol:.0e}"
        lines.append(f"  {c.name:<15}{c.status:<7}{diff:>12}{tol:>10}  {c.detail}")
    return "\n".join(lines)


def run_audit(run_dir: str | Path, step: int | None = None, tol: Tolerances | None = None,
              out=print) -> bool:
    """Audit one recorded step (or all); print tables; True when every check passes."""
    run_dir = Path(run_dir)
    steps = list_records(run_dir)
    if not steps:
        raise AuditError(f"{run_dir}: no audit records (train with audit.every=K)")
    if step is not None and step not in steps:
        raise AuditError(f"{run_dir}: no audit record for step {step}; recorded: "
                         f"{', '.join(map(str, steps))}")
    failures = []
    for s in [step] if step is not None else steps:
        checks, meta = audit_step(run_dir, s, tol or Tolerances())
        out(format_table(s, checks, meta))
        failures += [f"step {s}: {c.name} ({c.detail})" for c in checks if c.status == "FAIL"]
    if failures:
        out("audit FAILED: " + "; ".join(failures))
        return False
    out(f"audit passed: {len(steps) if step is None else 1} step(s) of {run_dir}")
    return True
