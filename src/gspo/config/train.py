"""``TrainConfig``: the sections of ``gspo train`` (and ``gspo sft`` / ``gspo eval``) together,
sections that moved refused with their new name, and the values derived from them that many
places read (``batch_size``, ``objective_kwargs()``...). Validating it checks each section on its
own; the rules across sections, and the values they fill in, are ``gspo.config.resolve``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, model_validator

from gspo import objective_presets as presets
from gspo.config.agent import AgentConfig
from gspo.config.base import Section
from gspo.config.models import ModelConfig, MoEConfig
from gspo.config.multiturn import MultiTurnConfig
from gspo.config.objectives import AdvantageConfig, DPOConfig, ObjectiveConfig, PPOConfig
from gspo.config.observe import AuditConfig, FaultsConfig, GuardConfig, MonitorConfig, RunConfig
from gspo.config.rollout import EvalConfig, RolloutConfig
from gspo.config.tasks import DataConfig, RewardsConfig, TaskConfig
from gspo.config.training import DistConfig, SFTConfig, TrainLoopConfig
from gspo.core import objectives

MOVED = {"reward": "rewards"}
"""Sections renamed or merged (old name -> new one): refused with the new key, e.g.
reward.on_error -> rewards.on_error."""


class TrainConfig(Section):
    seed: int = 0
    """Seeds model init, data order, sampling: same seed, same run (on CPU)."""
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    rewards: RewardsConfig = RewardsConfig()
    """Reward sources and what a failing reward call does to the run: timeouts, on_error policy, sandbox (docs/reliability.md)."""
    data: DataConfig = DataConfig()
    """What a bad training or test example does to the run (docs/reliability.md)."""
    sft: SFTConfig = SFTConfig()
    rollout: RolloutConfig = RolloutConfig()
    multiturn: MultiTurnConfig = MultiTurnConfig()
    """Multi-turn, tool-using episodes: the environment, its tools and the episode's budgets (docs/multiturn.md); off (single-turn) by default."""
    agent: AgentConfig = AgentConfig()
    """An agent program of your own through the recording endpoint (rollout.episode=agent, docs/agents.md); its budgets are multiturn's."""
    objective: ObjectiveConfig = ObjectiveConfig()
    ppo: PPOConfig = PPOConfig()
    """objective.name=ppo: critic, GAE and value loss (docs/baselines.md); ignored otherwise."""
    advantage: AdvantageConfig = AdvantageConfig()
    """How rewards become advantages: the estimator (group | rloo) and its scaling."""
    dpo: DPOConfig = DPOConfig()
    """objective.name=dpo: online DPO on each group's best-vs-worst pair (docs/math.md); ignored otherwise."""
    train: TrainLoopConfig = TrainLoopConfig()
    eval: EvalConfig = EvalConfig()
    moe: MoEConfig = MoEConfig()
    """Mixture-of-Experts switches (only for MoE models, e.g. model.preset=tiny-moe)."""
    guard: GuardConfig = GuardConfig()
    """Stability guard: rules over the step metrics -> warn / skip / pause / rollback (docs/trust.md)."""
    audit: AuditConfig = AuditConfig()
    """Rollout records for offline re-computation of ratios, clipping and loss (docs/trust.md)."""
    monitor: MonitorConfig = MonitorConfig()
    """Extra diagnostics: length slices."""
    faults: FaultsConfig = FaultsConfig()
    """Deliberate faults for testing the guard (off by default)."""
    dist: DistConfig = DistConfig()
    """Data-parallel training under torchrun: strategy ddp | fsdp (docs/distributed.md)."""

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, tree):
        """Refuse a section that moved, naming where its keys went."""
        if not isinstance(tree, dict):
            return tree
        for old, new in MOVED.items():
            if old in tree:
                keys = list(tree[old]) if isinstance(tree[old], dict) else []
                key = f"{old}.{keys[0]}" if keys else old
                raise ValueError(f"unknown key {key!r}; did you mean {new + key[len(old):]!r}? "
                                 f"(section {old!r} is now part of {new!r})")
        if isinstance(tree.get("rewards"), list):
            raise ValueError("rewards is a section now; did you mean rewards.sources? "
                             "(e.g. rewards.sources=[{type: verifier}])")
        return tree

    @model_validator(mode="before")
    @classmethod
    def _expand_preset(cls, data: Any) -> Any:
        """objective.preset: fill every key the config leaves unset with the preset's value."""
        if isinstance(data, dict) and isinstance(data.get("objective"), BaseModel):
            data = {**data, "objective": data["objective"].model_dump(exclude_unset=True)}
        return presets.expand(data)

    @property
    def batch_size(self) -> int:
        """N = P x G sequences per RL step (derived)."""
        return self.rollout.prompts_per_step * self.rollout.group_size

    @property
    def minibatch_unit(self) -> int:
        """Rows dealt together into minibatches (derived): G under train.minibatch_by=groups, else 1."""
        return self.rollout.group_size if self.train.minibatch_by == "groups" else 1

    def objective_kwargs(self) -> dict:
        """Keyword arguments of the policy loss (derived): the clip range and aggregation when
        set (else the objective's paper defaults), objective.params, and token_sum_norm =
        rollout.max_new_tokens (the seq-mean-token-sum-norm constant)."""
        o = self.objective
        kwargs = {k: v for k, v in (("eps_low", o.eps_low), ("eps_high", o.eps_high),
                                    ("aggregation", o.aggregation)) if v is not None}
        return {**kwargs, **o.params, "token_sum_norm": float(self.rollout.max_new_tokens)}

    def token_aggregation(self) -> str:
        """How per-token extras (KL, entropy) are reduced (derived): like the objective, with
        seq-mean read as seq-mean-token-mean."""
        defaults = objectives.spec(self.objective.name).defaults \
            if self.objective.name in objectives.available() else {}
        mode = self.objective.aggregation or defaults.get("aggregation", "seq-mean")
        return "seq-mean-token-mean" if mode == "seq-mean" else mode
