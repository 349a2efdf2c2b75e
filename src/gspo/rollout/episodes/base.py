"""The episode interface and its registry: how the prompts of a batch become trajectories.

An episode is handed the sampler (a ``gspo.rollout.engines.Engine``: token ids in, token ids and
log-probs out), the tokenizer, the examples and the sampling parameters, and returns the
``RolloutBatch`` of N = P·G rows in the rollout layout (prompt left-padded, response right-padded),
with each row's episode record when it ran more than one turn (``RolloutBatch.records``).

A new episode is one file in this package: a class registered here with ``@register("name")``
that builds itself from the run's config (``from_config(cfg, task)``), says which configs it cannot serve
(``refuses``) and is called as ``Episode``. The Collector, the step and everything above stay as
they are. This module samples nothing itself.
"""

from __future__ import annotations

from typing import Protocol

from gspo.registry import Registry
from gspo.rollout.generate import RolloutBatch, SamplingParams
from gspo.tasks import Example


class Episode(Protocol):
    """Prompts to trajectories through a sampler."""

    metrics: dict
    """The last batch's episode metrics (multiturn/*; empty for a single turn)."""
    multi_turn: bool
    """Its rows continue after the policy's end-of-turn token with the chat template's ids for
    new messages, so the trainer refuses, at set-up, a template that rewrites sampled turns.
    A class that leaves it out runs one turn (False)."""
    gives_rewards: bool
    """Its rows' records carry a reward of their own (``EpisodeRecord.reward``: the environment's,
    the agent's), which ``rewards.sources: [{type: env}]`` scores. Left out: False."""

    def __call__(self, sampler, tokenizer, examples: list[Example], params: SamplingParams, *,
                 group_size: int, seed: int | None, with_logprobs: bool) -> RolloutBatch: ...

    def close(self) -> None:
        """Release what the episode holds (tools' workers) at the end of the run."""


EPISODES: Registry[type] = Registry("episode", valid="valid episodes")



def register(name: str):
    """Class decorator: ``@register("name")`` makes the class buildable by ``build("name", cfg)``."""
    return EPISODES.register(name)


def names() -> list[str]:
    """The registered episodes, sorted."""
    return EPISODES.names()


def build(name: str, cfg, task=None) -> Episode:
    """The episode ``name`` for the run's config (ValueError listing the valid names); with the
    run's ``task``, an episode may check what it builds from the first training example now."""
    return EPISODES.get(name).from_config(cfg, task)


def gives_rewards(name: str) -> bool:
    """Whether episode ``name``'s records carry rewards of their own (``Episode.gives_rewards``)."""
    return bool(getattr(EPISODES.get(name), "gives_rewards", False))


def refusal(name: str, cfg) -> str | None:
    """Why episode ``name`` cannot serve ``cfg``, or None."""
    return EPISODES.get(name).refuses(cfg)
