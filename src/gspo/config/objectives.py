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
    """Policy loss from the registry (gspo.core.objectives.available()), with group-relative advantages; or a baseline (gspo.training.algorithms, docs/baselines.md): ppo (GAE from a critic, see the ppo section) | sft (continued SFT on demonstrations at the same step and token budget) | dpo (online DPO on each group's best-vs-worst pair, see the dpo section)."""
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
    """A named recipe (gspo.objective_presets.available()): dapo | dr_grpo. Expanded into config values when the config is loaded (objective name, clip range, aggregation, advantage scale, trainer switches; docs/math.md): in a YAML file the file's own keys win; as a key=value override it stands for the preset's overrides at its place (over the file and earlier overrides, under later ones). The run's config.yaml shows the expanded values."""

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
    """Baseline of the group-relative advantage (gspo.core.advantages.available()): group (r_i − group mean, GSPO Eq. 6) | rloo (r_i − mean of the other responses of the group, arXiv 2402.14740). For the group-relative objectives; ppo uses GAE, sft and dpo no advantages."""
    scale: Literal["group", "batch", "none"] | None = None
    """Divide the centred rewards by the group std (paper Eq. 6), the batch std, or nothing. Unset: the estimator's own (group: group; rloo: none), filled in when the config is resolved. rloo takes group or none."""
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
    """objective.name=dpo: β of the DPO loss −log σ(β[(log π_θ − log π_ref)(y_w) − (log π_θ − log π_ref)(y_l)]) (0.1, as arXiv 2305.18290's experiments and TRL's DPOConfig)."""


class RolloutCorrectionConfig(Section):
    mode: str | None = None
    """None: the engine's default (Engine.default_correction of gspo.rollout.engines: none for hf, tis for vllm; none under train.old_logprobs=rollout), filled in when the config is resolved; a run's config.yaml shows the value used. Weight or mask the policy loss by π_old/π_rollout, the trainer's recomputed log-probs over the sampler's (gspo.core.correction, docs/math.md): none | tis (token weight min(ρ_t, cap)) | seq_tis (response weight min(ρ_i, cap), ρ_i the geometric mean) | seq_mask (drop a response unless low ≤ ρ_i ≤ high) | icepop (drop a token unless low ≤ ρ_t ≤ high). Anything but none asks the sampler for its log-probs and logs mismatch/kl, ratio_min, ratio_max, masked_frac, is_weight_mean."""
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
