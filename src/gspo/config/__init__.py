"""Validated configuration: YAML files plus dotted ``key=value`` command-line overrides.

One pydantic model per command (``TrainConfig`` for ``gspo train``; ``gspo sft`` and
``gspo eval`` read the same sections). Every field carries a docstring that says what it does,
unknown keys are errors with a "did you mean", keys that moved are refused naming their new
place (``MOVED``), and all of it is checked before any model is built. ``ConfigError`` carries a
one-line, user-facing message; the CLI prints it and exits 2. The field defaults are the base
every config file overrides; the main job is ``configs/default.yaml``, shipped in the package
(``shipped_config()``), which ``gspo train`` / ``sft`` / ``eval`` read when no file is given.

Modules, each section beside the others that configure the same package:

* ``base``: ``ConfigError``, ``one_of``, ``Section``; ``reference``: every field with its one line;
* ``models`` (gspo.models), ``tasks`` (gspo.tasks, gspo.rewards), ``rollout`` (gspo.rollout),
  ``objectives`` (gspo.core, the baselines' switches), ``training`` (gspo.training),
  ``observe`` (the run folder, the guard, the audit);
* ``train``: ``TrainConfig``, the sections together, and its derived properties;
* ``resolve``: the rules across sections, ``resolve(config, environment)``: pure, and labels
  what it derives;
* ``loading``: overrides, YAML in and out, one-line errors, ``load_config``.

Layer: above the registries it validates names against (``gspo.core``, ``gspo.models``,
``gspo.tasks``, ``gspo.rewards``, ``gspo.observe``, and ``gspo.rollout.engines``) and below what
builds from a config (``gspo.training``, ``gspo.tools``, the CLI). It never imports those.
"""

from gspo.config.base import ConfigError, Section, one_of
from gspo.config.loading import (apply_override, config_hash, dump_yaml, format_validation_error,
                                 load_config, parse_override, read_yaml, shipped_config)
from gspo.config.models import LoRAConfig, ModelConfig, MoEConfig
from gspo.config.multiturn import MultiTurnConfig
from gspo.config.objectives import (BASELINES, AdvantageConfig, DPOConfig, ObjectiveConfig,
                                    PPOConfig, RolloutCorrectionConfig, objective_names)
from gspo.config.observe import (AuditConfig, FaultsConfig, GuardConfig, GuardRule, MonitorConfig,
                                 RunConfig)
from gspo.config.resolve import Environment, Resolved, resolve
from gspo.config.rollout import EvalConfig, RolloutConfig
from gspo.config.tasks import DataConfig, RewardsConfig, RewardSpec, TaskConfig
from gspo.config.train import MOVED, TrainConfig
from gspo.config.training import DistConfig, SFTConfig, TrainLoopConfig

__all__ = [
    "BASELINES", "MOVED", "AdvantageConfig", "AuditConfig", "ConfigError", "DPOConfig",
    "DataConfig", "DistConfig", "Environment", "EvalConfig", "FaultsConfig", "GuardConfig",
    "GuardRule", "LoRAConfig", "ModelConfig", "MoEConfig", "MonitorConfig", "MultiTurnConfig", "ObjectiveConfig",
    "PPOConfig", "Resolved", "RewardSpec", "RewardsConfig", "RolloutConfig",
    "RolloutCorrectionConfig", "RunConfig", "SFTConfig", "Section", "TaskConfig", "TrainConfig",
    "TrainLoopConfig", "apply_override", "config_hash", "dump_yaml", "format_validation_error",
    "load_config", "objective_names", "one_of", "parse_override", "read_yaml", "resolve",
    "shipped_config",
]
