"""Audit records: what one RL step trained on, written so that ``gspo audit`` can recompute it.

Training (``audit.every: K``) writes, for every K-th RL step, ``RUN/audit/step_NNNNNN/``::

    batch.safetensors   token ids, masks, rewards, advantages, π_old log-probs, the log-probs
                        each row was trained on, π_new log-probs, per-row ratio and clip share
                        as the objective computed them, minibatch of each row (+ generator
                        log-probs, MoE routing when present)
    record.json         objective + resolved hyper-parameters + aggregation, sampling
                        parameters, seeds, minibatch losses, the step's logged metrics, prompts
    policy_old/         π_old (the model before this step's updates): a transformers checkpoint
    policy_new/         π_new (right after them, before the guard looked at the step)

``UpdateRecord`` is what the update notes per row as it trains (also read by the length slices;
the loss mask it trained with is the batch's own, ``batch.loss_mask``, copied into the record);
``Recorder`` writes it out, handed the policy, the objective and the run's constants when built and
the step's tensors when it finishes, never the trainer. The audit that reads the records is
``gspo.tools.audit``. Tensors only through safetensors, the rest JSON: nothing is pickled.
Shapes: N sequences, T response positions, L prompt + response columns.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file
from torch import Tensor

from gspo.core import objectives
from gspo.models.presets import save_model

FORMAT = 1
AUDIT_DIR = "audit"
PREFIX = "step_"


def record_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / AUDIT_DIR / f"{PREFIX}{step:06d}"


def list_records(run_dir: str | Path) -> list[int]:
    root = Path(run_dir) / AUDIT_DIR
    if not root.is_dir():
        return []
    return sorted(int(p.name[len(PREFIX):]) for p in root.iterdir()
                  if p.is_dir() and p.name.startswith(PREFIX) and (p / "record.json").is_file())


@dataclass
class UpdateRecord:
    """One update, per row: the log-probs as trained on and the minibatch; plus the objective's
    loss of each minibatch."""
    logp: Tensor                                   # [N, T] π_θ log-probs at use
    minibatch: Tensor                              # [N] minibatch of each row (-1: none)
    loss: list[Tensor] = field(default_factory=list)

    @classmethod
    def start(cls, mask: Tensor) -> "UpdateRecord":
        """An empty record for a batch whose loss mask is ``mask`` [N, T] (its shape)."""
        return cls(torch.zeros(mask.shape, device=mask.device),
                   torch.full(mask.shape[:1], -1, dtype=torch.long, device=mask.device))

    def add(self, idx: Tensor, logp: Tensor, loss: Tensor) -> None:
        """Note the rows ``idx`` of one minibatch: their log-probs as trained on and its loss."""
        self.logp[idx] = logp.detach().float()
        self.minibatch[idx] = len(self.loss)
        self.loss.append(loss.detach())


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


@dataclass
class Recorder:
    """Writes the audit record of every ``every``-th RL step (the step calls begin / finish)."""
    every: int
    run_dir: Path
    model: torch.nn.Module
    tokenizer: object
    objective: Callable                            # the policy loss, for per-row ratio and clip
    objective_kwargs: dict
    meta: dict
    """The run's constants for record.json: objective, token aggregation, train / advantage /
    moe settings, sampling, token ids, run seed."""

    @classmethod
    def for_run(cls, cfg, run_dir: Path, model, tokenizer, sampling) -> "Recorder":
        """The recorder of a run: ``cfg`` a TrainConfig (audit.every, the objective and the
        settings record.json keeps), ``sampling`` the generator's SamplingParams."""
        spec = objectives.spec(cfg.objective.name) \
            if cfg.objective.name in objectives.available() else None        # sft: no loss
        meta = {"run_seed": cfg.seed, "objective": None if spec is None else {
            "name": spec.name, "sequence_level": spec.sequence_level,
            "kwargs": {**dict(spec.defaults), **cfg.objective_kwargs()}},
            "token_aggregation": cfg.token_aggregation(),
            "train": {k: getattr(cfg.train, k) for k in ("old_logprobs", "mask_truncated",
                      "minibatches", "beta", "entropy_coef", "logprob_chunk")},
            "advantage": {"estimator": cfg.advantage.estimator, "scale": cfg.advantage.scale,
                          "eps": cfg.advantage.eps, "group_size": cfg.rollout.group_size},
            "moe": cfg.moe.model_dump(), "sampling": asdict(sampling),
            "tokens": {"eos_id": tokenizer.eos_token_id, "pad_id": tokenizer.pad_token_id}}
        return cls(cfg.audit.every, Path(run_dir), model, tokenizer, spec and spec.fn,
                   cfg.objective_kwargs(), meta)

    def due(self, step: int) -> bool:
        """``step`` 0-based; records are named by the logged (1-based) step."""
        return self.every > 0 and (step + 1) % self.every == 0

    def tmp(self, step: int) -> Path:
        final = record_dir(self.run_dir, step + 1)
        return final.with_name(f".{final.name}.tmp")

    def begin(self, step: int) -> None:
        """Before the updates: save π_old."""
        if not self.due(step):
            return
        tmp = self.tmp(step)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_model(self.model, self.tokenizer, tmp / "policy_old")

    @torch.no_grad()
    def finish(self, step: int, batch, rewards: Tensor, advantages: Tensor, old_logp: Tensor,
               record: UpdateRecord, metrics: dict, *, new_logprobs: Callable, seeds: dict) -> None:
        """After the updates: save π_new, the batch and what was computed, then publish.
        ``new_logprobs(batch)``: π_new's log-probs [N, T]; ``seeds``: generation and minibatch."""
        if not self.due(step):
            return
        tmp = self.tmp(step)
        save_model(self.model, self.tokenizer, tmp / "policy_new")
        was_training = self.model.training
        self.model.eval()
        new_logp = new_logprobs(batch)                                          # [N, T]
        self.model.train(was_training)
        ratio, clip = per_row_stats(self.objective, record.logp, old_logp, advantages,
                                    batch.loss_mask, self.objective_kwargs)
        tensors = {
            "input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
            "response_mask": batch.response_mask, "truncated": batch.truncated,
            "lengths": batch.lengths, "rewards": rewards, "advantages": advantages,
            "old_logp": old_logp, "loss_mask": batch.loss_mask, "used_logp": record.logp,
            "minibatch": record.minibatch, "new_logp": new_logp,
            "row_ratio": ratio, "row_clip_frac": clip,
        }
        if batch.rollout_logp is not None:
            tensors["rollout_logp"] = batch.rollout_logp
        if batch.routing is not None:
            tensors["routing"] = batch.routing
        if batch.dropped is not None:  # rewards.on_error=drop: rows left out of the loss
            tensors["dropped"] = batch.dropped
        save_file({k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()},
                  str(tmp / "batch.safetensors"))
        meta = {
            "format": FORMAT, "step": step + 1, **self.meta,
            "seeds": {**seeds, "refill_rounds": int(metrics.get("reward/refill_rounds", 0))},
            "policy_old": "policy_old", "policy_new": "policy_new",
            "minibatch_loss": [float(x) for x in record.loss],
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
