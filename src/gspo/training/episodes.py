"""The run's episode from its config: single-turn rollouts, or the tool loop of ``multiturn``
(its environment per trajectory, its tools' runner, its budgets). Built once per run, before the
cold start, whose multi-turn demonstrations run through the same environments."""

from __future__ import annotations

from dataclasses import dataclass

from gspo import envs
from gspo.envs.tools import ToolRunner
from gspo.rewards.sandbox import Limits
from gspo.rollout.episodes import SingleTurn
from gspo.rollout.multiturn import Budgets, ToolLoop


def tool_runner(cfg) -> ToolRunner | None:
    """``multiturn.tools`` loaded and checked (None without them); sandboxed when asked."""
    m = cfg.multiturn
    if not m.tools:
        return None
    limits = Limits(wall_s=m.timeout_s, cpu_s=m.sandbox_cpu_s, memory_mb=m.sandbox_memory_mb,
                    key="multiturn.sandbox") if m.sandbox else None
    return ToolRunner(m.tools, sandbox=limits, timeout_s=m.timeout_s, on_tool_error=m.on_tool_error)


@dataclass(frozen=True)
class EnvFactory:
    """``factory(example)``: a fresh environment ``name`` with ``params`` (picklable, so that an
    asynchronous worker process gets the episode with the collector)."""

    name: str
    params: dict

    def __call__(self, example):
        return envs.build(self.name, example, **self.params)


def build_episode(cfg):
    """``SingleTurn`` when ``multiturn.env`` is None, else a ``ToolLoop`` over its environment."""
    m = cfg.multiturn
    if m.env is None:
        return SingleTurn()
    runner = tool_runner(cfg)
    params = {"runner": runner, "call_format": m.call_format} if m.env == "tools" else dict(m.params)
    budgets = Budgets(max_turns=m.max_turns, max_new_tokens=cfg.rollout.max_new_tokens,
                      max_total_tokens=m.max_total_tokens, max_observation_tokens=m.max_observation_tokens)
    return ToolLoop(EnvFactory(m.env, params), budgets, runner=runner,
                    template_kwargs=dict(cfg.task.chat_template_kwargs))
