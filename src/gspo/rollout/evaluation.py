"""Held-out evaluation: greedy accuracy, mean pass@1 over k samples, and pass@k.

pass@k uses the unbiased estimator of Chen et al. 2021 (arXiv 2107.03374):
``1 - C(n-c, k) / C(n, k)`` for n samples of which c are correct. Mean pass@1 over k samples is
the protocol the GSPO paper uses for AIME. This module judges models; it never trains them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gspo.rewards.isolation import correct_all
from gspo.rollout import engines
from gspo.rollout.episodes import Episode, SingleTurn
from gspo.rollout.generate import RolloutBatch, SamplingParams
from gspo.tasks import Example, Task


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn from n (c correct) is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class EvalResult:
    accuracy: float          # greedy, share of prompts answered correctly
    pass1: float             # mean over prompts of (correct samples / k)
    pass_k: float            # mean over prompts of pass@k with n = k samples
    k: int
    mean_reward: float       # greedy
    mean_length: float       # greedy response length in tokens
    n: int

    def as_metrics(self, prefix: str = "eval/") -> dict[str, float]:
        return {f"{prefix}accuracy": self.accuracy, f"{prefix}pass@1": self.pass1,
                f"{prefix}pass@{self.k}": self.pass_k, f"{prefix}reward": self.mean_reward,
                f"{prefix}length": self.mean_length}

    def as_dict(self) -> dict:
        return {"accuracy": self.accuracy, "pass@1": self.pass1, f"pass@{self.k}": self.pass_k,
                "k": self.k, "reward": self.mean_reward, "length": self.mean_length, "n": self.n}


def _batches(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start:start + size]


def sample_batch(engine: engines.Engine, tokenizer: PreTrainedTokenizerBase, examples: list[Example],
                 params: SamplingParams, episode: Episode, *, group_size: int = 1,
                 seed: int | None = None) -> RolloutBatch:
    """Responses to ``examples`` through ``engine`` and the run's ``episode`` (multi-turn: whole
    trajectories, the final turn scored)."""
    return episode(engine, tokenizer, examples, params, group_size=group_size, seed=seed,
                   with_logprobs=False)


def evaluate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, task: Task,
             examples: list[Example], *, max_new_tokens: int, k: int = 4, temperature: float = 1.0,
             batch_size: int = 256, seed: int = 0, engine: engines.Engine | None = None,
             episode: Episode | None = None) -> EvalResult:
    """Greedy accuracy plus k-sample pass@1 / pass@k on ``examples`` (deterministic in seed),
    sampled through ``engine`` (its weights ``model``'s; None: an hf engine on ``model``), and
    through the run's ``episode`` (None: single turn)."""
    engine = engine or engines.build("hf", model, tokenizer)
    episode = episode or SingleTurn()
    greedy = SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
    sampled = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    correct, rewards, lengths, per_prompt = [], [], [], []
    with torch.random.fork_rng(devices=[]):
        for i, chunk in enumerate(_batches(examples, batch_size)):
            out = sample_batch(engine, tokenizer, chunk, greedy, episode)
            correct += correct_all(task, out.completions, chunk)
            rewards += [task.reward(c, ex) for c, ex in zip(out.completions, chunk)]
            lengths += out.lengths.tolist()
            samples = sample_batch(engine, tokenizer, chunk, sampled, episode, group_size=k,
                                   seed=seed + i)
            hits = correct_all(task, samples.completions, samples.examples)
            per_prompt += [sum(hits[j * k:(j + 1) * k]) for j in range(len(chunk))]
    n = len(examples)
    return EvalResult(
        accuracy=sum(correct) / n, pass1=sum(c / k for c in per_prompt) / n,
        pass_k=sum(pass_at_k(k, c, k) for c in per_prompt) / n, k=k,
        mean_reward=sum(rewards) / n, mean_length=sum(lengths) / n, n=n,
    )
