"""Environments of multi-turn episodes: what answers the policy's turns (``base``), the generic
tool environment with its call formats and typed tools (``tools``), and the built-in ones.

The envs layer never imports anything above it (config, rollout, training): environments see
text in and give text out; below it are only the tasks (examples), the rewards' sandbox and
timed caller (tools run as rewards do), errors and the registry."""

from gspo.envs.base import Environment, Observation, Reply, Turn, available, build, check, register
from gspo.envs import tools  # noqa: E402,F401  registers the tool environment  isort: skip

__all__ = ["Environment", "Observation", "Reply", "Turn", "available", "build", "check", "register"]
