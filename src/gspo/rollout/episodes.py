"""Episodes: how the prompts of a batch become trajectories through a sampler.

An episode is handed the sampler (a ``gspo.rollout.engines.Engine``: token ids in, token ids and
log-probs out), the tokenizer, the examples and the sampling parameters, and returns the
``RolloutBatch`` of N = P·G rows. ``SingleTurn`` is today's: the prompt's ids, G responses
sampled once, the rollout layout (prompt left-padded, response right-padded). A tool loop is a
second episode: it would sample, parse a call, run the tool, append its observation's tokens
(response mask 1 for attention, and a loss mask 0 for the step: ``Trajectories.loss_mask``) and
sample again, all inside its ``__call__``; the Collector, the step and everything above it stay
as they are (docs/architecture.md, "Where to add a tool loop").

Episodes are registered by name (``get``); the Collector runs ``single_turn`` unless handed
another. This module samples through the engine it is given; it does not score or train.
"""

from __future__ import annotations

from typing import Protocol

from gspo.registry import Registry
from gspo.rollout import engines
from gspo.rollout.generate import RolloutBatch, SamplingParams
from gspo.tasks import Example


class Episode(Protocol):
    """Prompts to trajectories through a sampler."""

    def __call__(self, sampler: engines.Engine, tokenizer, examples: list[Example],
                 params: SamplingParams, *, group_size: int, seed: int | None,
                 with_logprobs: bool) -> RolloutBatch: ...


EPISODES: Registry[type] = Registry("episode")


@EPISODES.register("single_turn")
class SingleTurn:
    """One turn: G responses to each prompt's token ids, sampled once (``engines.generate_batch``)."""

    def __call__(self, sampler, tokenizer, examples, params, *, group_size, seed,
                 with_logprobs) -> RolloutBatch:
        return engines.generate_batch(sampler, tokenizer, examples, params, group_size=group_size,
                                      seed=seed, with_logprobs=with_logprobs)


def get(name: str) -> Episode:
    """The episode registered as ``name`` (ValueError listing the valid ones)."""
    return EPISODES.get(name)()
