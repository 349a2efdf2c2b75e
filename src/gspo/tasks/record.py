"""What one trajectory did, as plain data: the record an episode hands to the rewards.

A reward that reads only the final completion needs none of this. One that judges the whole
conversation (did the policy call the tool, with which arguments, what did the environment
say) reads the row's ``EpisodeRecord``: its transcript, its tool calls, the environment's info
and the environment's own reward. The tool loop fills one per row; a single-turn row's record
is its one assistant turn (``EpisodeRecord.single``).

Reward functions ask for these by keyword (``KEYWORDS``) and get only the ones they name, so
``fn(completion, **row)`` keeps its meaning (``keywords_for``). Plain Python, no tensors: it
travels to a sandbox worker as JSON.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

KEYWORDS = ("transcript", "tool_calls", "info")
"""The record's fields a reward function may name as parameters."""


@dataclass(frozen=True)
class EpisodeRecord:
    """One row's episode: the conversation after the prompt, its calls, and how it ended."""

    transcript: tuple[dict, ...] = ()
    """Messages after the prompt in order: {"role": "assistant", "content": turn} for the policy,
    the environment's answer as its chat messages or {"role": "environment", "content": text}."""
    tool_calls: tuple[dict, ...] = ()
    """The environment's record of the calls (tools: {"call", "result", "failed"} each)."""
    info: dict = field(default_factory=dict)
    """What the environment kept with the trajectory (``Reply.info``, merged turn by turn)."""
    reward: float | None = None
    """The environment's own reward of the finished episode (``Environment.reward()``), if any."""
    end: str = "done"
    """How the episode ended (gspo.rollout.episodes: done | no_eos | turns | budget)."""

    @classmethod
    def single(cls, completion: str, *, truncated: bool = False) -> "EpisodeRecord":
        """A single-turn row: one assistant turn, no environment."""
        return cls(transcript=({"role": "assistant", "content": completion},),
                   end="no_eos" if truncated else "done")

    def keywords(self) -> dict:
        """The fields of ``KEYWORDS`` by name (what a reward function may ask for)."""
        return {"transcript": list(self.transcript), "tool_calls": list(self.tool_calls),
                "info": dict(self.info)}


def named_parameters(fn: Callable) -> set[str]:
    """The parameter names ``fn`` declares (not its ``**kwargs``); empty if it has no signature."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def keywords_for(fn: Callable, row: dict, record: dict) -> dict:
    """``row`` plus the record's fields that ``fn`` names as parameters (a named one overrides a
    data column of the same name); a function taking only ``**row`` gets ``row`` unchanged."""
    asked = named_parameters(fn) & set(KEYWORDS)
    return {**row, **{k: v for k, v in record.items() if k in asked}}
