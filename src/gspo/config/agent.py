"""The ``agent`` section (``gspo.rollout.episodes.agent``): an agent program of your own, driven
through the recording endpoint (docs/agents.md)."""

from __future__ import annotations

from pydantic import Field

from gspo.config.base import Section


class AgentConfig(Section):
    fn: str | None = None
    """With rollout.episode=agent: module:function (sync or async), fn(base_url, api_key, example) -> reward or (reward, info); or verifiers / verifiers_v1."""
    params: dict = {}
    """Keyword arguments of agent.fn's every call, or a built-in's options (verifiers: env_id, env_args...; verifiers_v1: env, python, max_concurrent)."""
    timeout_s: float = Field(60.0, gt=0)
    """Deadline of one episode, the agent and its scoring: past it the episode is counted (agent/timeouts) and gets no reward."""
    batch_wait_s: float = Field(2.0, gt=0)
    """Calls wait for every live episode's; with none arriving for this long, those waiting are sampled (a partial batch: agent/partial_batches)."""
