"""The ``agent`` section (``gspo.rollout.episodes.agent``): an agent program of your own, driven
through the recording endpoint (docs/agents.md)."""

from __future__ import annotations

from pydantic import Field

from gspo.config.base import Section


class AgentConfig(Section):
    fn: str | None = None
    """With rollout.episode=agent: module:function (sync or async), called as fn(base_url, api_key, example) -> reward or (reward, info); or a built-in: verifiers (its classic API, 0.3) or verifiers_v1 (its v1 API, 0.4)."""
    params: dict = {}
    """Keyword arguments of agent.fn's every call, or the options of a built-in agent (verifiers: env_id, env_args, sampling_args; verifiers_v1: env, verifiers' environment config, and python: trainer | uv)."""
    timeout_s: float = Field(60.0, gt=0)
    """Deadline of one episode, the agent and its scoring: past it the episode is counted (agent/timeouts) and gets no reward."""
    batch_wait_s: float = Field(2.0, gt=0)
    """Calls wait for every live episode's; with none arriving for this long, those waiting are sampled (a partial batch: agent/partial_batches)."""
