"""The ``multiturn`` section (``gspo.envs``, ``gspo.rollout.episodes``): the environment every
trajectory runs in, its tools, and the budgets of an episode (docs/multiturn.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from gspo.config.base import Section, one_of
from gspo import envs
from gspo.envs.tools import CALL_FORMATS


class MultiTurnConfig(Section):
    env: str | None = None
    """Environment of each trajectory: single | tools | guess (gspo.envs) or module:Class; None: single-turn (docs/multiturn.md)."""
    params: dict = {}
    """Keyword arguments of a module:Class environment; with rollout.episode=reset_step, its make, kwargs and protocol (docs/agents.md)."""
    tools: list[str] = []
    """multiturn.env=tools: the tools, typed Python functions as module:function (docs/multiturn.md)."""
    tools_in_prompt: bool = True
    """task.chat: describe the tools to the model, their JSON schemas passed to the chat template as tools= (hermes: the <tools> block)."""
    call_format: str = "hermes"
    """How a turn writes its tool calls: hermes (<tool_call>JSON</tool_call>) | bracket ([name arg ...]); docs/multiturn.md."""
    sandbox: bool = False
    """Run each tool in the reward sandbox's limited worker process (killable; CPU, memory and file limits; no network) instead of in-process with a timeout."""
    timeout_s: float = Field(10.0, gt=0)
    """Wall-clock limit of one tool call; past it the call answers an error."""
    sandbox_cpu_s: float = Field(10.0, gt=0)
    """multiturn.sandbox: CPU seconds per tool call."""
    sandbox_memory_mb: int = Field(1024, ge=64)
    """multiturn.sandbox: address-space limit of a tool's worker process."""
    on_tool_error: Literal["observe", "fail"] = "observe"
    """A tool that raises, hangs or gets bad arguments: observe (the error is the observation) | fail (stop the run)."""
    on_env_error: Literal["fail", "end"] = "fail"
    """A module:Class environment that raises, hangs or answers no Reply: fail (the run stops, one line) | end (its episode ends; multiturn/env_errors_mean)."""
    env_timeout_s: float = Field(30.0, gt=0)
    """Wall-clock limit of a module:Class environment's constructor and of each of its steps."""
    max_turns: int = Field(4, ge=1)
    """Policy turns per trajectory; a row whose last allowed turn still gets an answer ends 'turns'."""
    max_total_tokens: int = Field(256, ge=2)
    """Tokens after the prompt, policy and environment together (each turn is also limited by rollout.max_new_tokens)."""
    max_observation_tokens: int = Field(64, ge=1)
    """Tokens of one observation; a longer one ends the row ('budget') and is not appended."""

    @field_validator("env")
    @classmethod
    def _env(cls, name: str | None) -> str | None:
        if name is None or ":" in name:      # module:Class is imported by the resolve step
            return name
        return one_of("environment", name, envs.available())

    @field_validator("call_format")
    @classmethod
    def _call_format(cls, name: str) -> str:
        return one_of("tool call format", name, CALL_FORMATS.names())
