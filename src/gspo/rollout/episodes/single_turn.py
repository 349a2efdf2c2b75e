"""The single-turn episode: G responses to each prompt's token ids, sampled once."""

from __future__ import annotations

from gspo.rollout import engines
from gspo.rollout.episodes.base import register
from gspo.rollout.generate import RolloutBatch


@register("single_turn")
class SingleTurn:
    """One turn: the engine's samples in rollout layout (``engines.generate_batch``); no records
    (a row's record is its completion: ``EpisodeRecord.single``)."""

    metrics: dict = {}
    gives_rewards = False
    multi_turn = False

    @classmethod
    def from_config(cls, cfg, task=None) -> "SingleTurn":
        return cls()

    @staticmethod
    def refuses(cfg) -> str | None:
        if cfg.multiturn.env is not None:
            return f"multiturn.env={cfg.multiturn.env} needs a multi-turn episode (tool_loop)"
        return None

    def __call__(self, sampler, tokenizer, examples, params, *, group_size, seed,
                 with_logprobs) -> RolloutBatch:
        return engines.generate_batch(sampler, tokenizer, examples, params, group_size=group_size,
                                      seed=seed, with_logprobs=with_logprobs)

    def close(self) -> None:
        pass
