"""Sections for the loss (``gspo.core``: objectives, advantages, the rollout correction) and the
baselines' own switches (``gspo.training.algorithms``): objective, ppo, advantage, dpo,
train.rollout_correction."""

from __future__ import annotations

import difflib
from typing import Literal

from pydantic import Field, field_validator, model_validator

from gspo import objective_presets as presets
from gspo.config.base import Section, one_of
from gspo.core import advantages, correction, objectives

BASELINES = ("dpo", "sft")
"""objective.name values that are not a policy loss: online DPO and continued SFT at RL's budget
(gspo.training.algorithms implements them and checks at import that this names exactly its
algorithms outside gspo.core.objectives; that registry sits above this layer)."""


def objective_names() -> list[str]:
    """Every valid ``objective.name``: the policy-loss registry plus ``BASELINES``."""
    return sorted(set(objectives.available()) | set(BASELINES))


class ObjectiveConfig(Section):
    name: str = "gspo"
    """Policy loss (gspo.core.objectives.available()) or a baseline: ppo | sft | dpo (docs/baselines.md)."""
    eps_low: float | None = Field(None, gt=0)
    """Lower clip range (None: the objective's paper default; GSPO 3e-4)."""
    eps_high: float | None = Field(None, gt=0)
    """Upper clip range (None: the objective's paper default; GSPO 4e-4)."""
    aggregation: Literal["seq-mean", "seq-mean-token-mean", "token-mean",
                         "seq-mean-token-sum-norm"] | None = None
    """Loss aggregation (None: the objective's paper default)."""
    params: dict[str, float] = {}
    """Extra objective hyper-parameters (e.g. {tau_pos: 1.0, tau_neg: 1.05} for sapo)."""
    preset: str | None = None
    """A named recipe expanded into config values when loaded: dapo | dr_grpo (docs/math.md)."""

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        return one_of("objective", name, objective_names())

    @field_validator("preset")
    @classmethod
    def _preset(cls, name: str | None) -> str | None:
        return None if name is None else one_of("objective preset", name, presets.available())

    @field_validator("params")
    @classmethod
    def _params(cls, params: dict, info) -> dict:
        name = info.data.get("name")
        if name is None:  # the name itself failed
            return params
        defaults = objectives.spec(name).defaults if name in objectives.available() else {}  # sft: none
        valid = sorted(set(defaults) - {"eps_low", "eps_high", "aggregation"})
        for key in params:
            if key not in valid:
                close = difflib.get_close_matches(key, valid, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ValueError(f"objective {name!r} has no hyper-parameter {key!r}; {hint}"
                                 f"valid: {', '.join(valid) or 'none'}")
        return params


class PPOConfig(Section):
    gamma: float = Field(1.0, ge=0, le=1)
    """GAE discount γ (1.0 as TRL PPOConfig: one episode per response, the reward at its end)."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE λ (0.95 as TRL PPOConfig and cleanrl)."""
    value_clip: float | None = Field(0.2, gt=0)
    """Clip of the value update around the rollout-time values (TRL cliprange_value 0.2); null: unclipped."""
    critic_lr: float | None = Field(None, gt=0)
    """Critic learning rate (null: train.lr); AdamW with the policy's schedule, warm-up, weight decay and grad_clip."""
    whiten_advantages: bool = True
    """Normalise the GAE advantages to mean 0, std 1 over the batch's response tokens (cleanrl norm_adv, TRL whiten)."""
    kl_in_reward: bool = False
    """Put the KL to the reference policy in the per-token reward, −kl_coef·(log π_old − log π_ref) (TRL / InstructGPT), instead of (or besides) the train.beta loss."""
    kl_coef: float = Field(0.05, ge=0)
    """kl_in_reward: the penalty's coefficient (0.05 as TRL PPOConfig.kl_coef)."""


class AdvantageConfig(Section):
    estimator: str = "group"
    """Baseline of the group-relative advantage: group (GSPO Eq. 6) | rloo (arXiv 2402.14740); docs/math.md."""
    scale: Literal["group", "batch", "none"] | None = None
    """Divide centred rewards by the group std | batch std | none (unset: the estimator's own); docs/math.md."""
    eps: float = Field(1e-6, gt=0)
    """Added to the std before dividing."""

    @field_validator("estimator")
    @classmethod
    def _estimator(cls, name: str) -> str:
        return one_of("advantage estimator", name, advantages.available())

    @model_validator(mode="after")
    def _rloo_scale(self) -> "AdvantageConfig":
        if self.estimator == "rloo" and self.scale == "batch":
            raise ValueError("advantage.estimator=rloo takes advantage.scale none or group, not batch")
        return self


class DPOConfig(Section):
    beta: float = Field(0.1, gt=0)
    """objective.name=dpo: β of the DPO loss (0.1 as arXiv 2305.18290 and TRL); docs/math.md."""


class RolloutCorrectionConfig(Section):
    mode: str | None = None
    """Weight or mask the loss by π_old/π_rollout: none | tis | seq_tis | seq_mask | icepop (None: the engine's default)."""
    cap: float | None = Field(None, gt=0)
    """tis, seq_tis: the truncation C of the importance weight (None: 2.0)."""
    low: float | None = Field(None, ge=0)
    """seq_mask, icepop: the lowest ratio kept (None: 0.5)."""
    high: float | None = Field(None, gt=0)
    """seq_mask, icepop: the highest ratio kept (None: 2.0)."""

    @field_validator("mode")
    @classmethod
    def _mode(cls, name: str | None) -> str | None:
        return None if name is None else one_of("rollout correction", name, correction.available())

    @model_validator(mode="after")
    def _params(self) -> "RolloutCorrectionConfig":
        if self.mode not in correction.available():  # the mode itself failed
            return self
        defaults = correction.spec(self.mode).defaults
        for key in ("cap", "low", "high"):
            if getattr(self, key) is not None and key not in defaults:
                raise ValueError(f"rollout correction {self.mode!r} has no parameter {key!r}; "
                                 f"valid: {', '.join(defaults) or 'none'}")
        params = self.params()
        if "low" in params and params["low"] >= params["high"]:
            raise ValueError(f"rollout correction {self.mode!r}: low={params['low']} must be "
                             f"below high={params['high']}")
        return self

    def params(self) -> dict[str, float]:
        """The mode's parameters, defaults filled in."""
        defaults = correction.spec(self.mode).defaults
        return {k: v if getattr(self, k) is None else getattr(self, k) for k, v in defaults.items()}
