"""The tool-loop episode: every trajectory runs in its own environment (``multiturn.env``),
turn after turn, through the run's engine (``ToolLoop``).

Turn 1 is sampled as a single-turn rollout samples it (G per prompt, prompts shared); later turns
continue each live row from its own ids (``engine_sampler``); the token-level loop, the masks and
the budgets are ``turn_loop``'s. Observations become ids through the tokenizer (``observer``):
text as encoded, chat messages through the template after the policy's end-of-turn token
(``gspo.rollout.turns``). Each row's ``EpisodeRecord`` (transcript, calls, info, the
environment's reward) travels with the batch to the rewards. The cold start replays the
demonstrations through the same environments (``ToolLoop.demonstrations``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from gspo import envs
from gspo.envs import Environment, Observation
from gspo.envs.guard import Guard
from gspo.envs.tools import ToolRunner
from gspo.rewards.sandbox import Limits
from gspo.rollout.episodes.base import register
from gspo.rollout.episodes.turn_loop import (
    Budgets, Sampler, demonstrations, episode_metrics, run_episodes, text_observer, to_tensors)
from gspo.rollout.generate import RolloutBatch
from gspo.rollout.turns import observation_ids
from gspo.tasks import Example


def turns_of(samples) -> list[tuple[list[int], list[float]]]:
    """An engine's ``Samples`` as per-row (ids, log-probs): each row's tokens up to and including
    its EOS (all of them when it has none)."""
    out = []
    for n in range(samples.response_ids.shape[0]):
        k = int(samples.response_mask[n].sum())
        logp = samples.logp[n, :k].tolist() if samples.logp is not None else [0.0] * k
        out.append((samples.response_ids[n, :k].tolist(), logp))
    return out


def engine_sampler(engine, params, seed: int | None) -> Sampler:
    """A later-turn sampler over ``engine``: every live row its own context, one sample each, as
    many new tokens as the roomiest row may take (each row then cut to its own room). Turn k's
    seed is ``seed + k·TURN_SEED_STRIDE`` (so turns do not repeat turn 1's random draws)."""
    calls = [0]

    def sample(contexts, room, rows):
        calls[0] += 1
        turn_seed = None if seed is None else seed + calls[0] * TURN_SEED_STRIDE
        got = engine.generate(contexts, 1, replace(params, max_new_tokens=max(room)), seed=turn_seed,
                              with_logprobs=True)
        return [(ids[:r], logp[:r]) for (ids, logp), r in zip(turns_of(got), room)]

    return sample


TURN_SEED_STRIDE = 1_000_003  # a prime beyond any batch's prompt count


def collect_episodes(engine, tokenizer, examples, group_size: int, params, make_env,
                     observe: Callable[[Observation], list[int]], budgets: Budgets,
                     seed: int | None = None):
    """One multi-turn batch: turn 1 as a single-turn rollout samples it (G per prompt, prompts
    shared), later turns through ``engine_sampler``; ``make_env(example)`` builds each row's
    environment. Returns (the tensors of ``to_tensors`` plus ``completions`` (each row's final
    turn) and ``examples``, the rows)."""
    prompts = [tokenizer(ex.prompt)["input_ids"] for ex in examples]
    first = turns_of(engine.generate(prompts, group_size, replace(
        params, max_new_tokens=min(params.max_new_tokens, budgets.max_new_tokens, budgets.max_total_tokens)),
        seed=seed, with_logprobs=True))
    later = engine_sampler(engine, params, seed)
    turn = [0]

    def sample(contexts, room, rows):
        turn[0] += 1
        return [first[i] for i in rows] if turn[0] == 1 else later(contexts, room, rows)

    rows_prompts = [p for p in prompts for _ in range(group_size)]
    row_examples = [ex for ex in examples for _ in range(group_size)]
    environments = [make_env(ex) for ex in row_examples]
    encode, decode = codec(tokenizer)
    rows = run_episodes(sample, rows_prompts, environments, observe, decode, tokenizer.eos_token_id,
                        budgets, encode=encode)
    batch = to_tensors(rows, tokenizer.pad_token_id)
    batch.update(completions=[r.final_turn for r in rows], examples=row_examples,
                 records=[r.record() for r in rows])
    return batch, rows


# ---------------------------------------------------------------------------- the episode
def codec(tokenizer) -> tuple[Callable[[str], list[int]], Callable[[list[int]], str]]:
    """(encode, decode) of a turn's or an observation's text with ``tokenizer``: no special tokens
    added, none kept."""
    return (lambda text: tokenizer(text, add_special_tokens=False)["input_ids"],
            lambda ids: tokenizer.decode(ids, skip_special_tokens=True))


def observer(tokenizer, template_kwargs: dict | None = None) -> Callable[[Observation], list[int]]:
    """How observations become ids with ``tokenizer``: text encoded as is; messages rendered by its
    chat template (with ``template_kwargs``) after the policy's end-of-turn token
    (``gspo.rollout.turns``), refused without one."""
    as_text = text_observer(codec(tokenizer)[0])
    has_template = bool(getattr(tokenizer, "chat_template", None))

    def observe(obs: Observation) -> list[int]:
        if obs.text is not None:
            return as_text(obs)
        if not has_template:
            raise ValueError("the environment answered chat messages, but the tokenizer has no chat "
                             "template: answer text (e.g. multiturn.call_format=bracket)")
        return observation_ids(tokenizer, obs.messages, tokenizer.eos_token_id,
                               template_kwargs=template_kwargs)

    return observe


def as_batch(batch: dict, device) -> RolloutBatch:
    """``collect_episodes``' tensors and rows as a ``RolloutBatch`` on ``device``."""
    return RolloutBatch(
        input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
        response_mask=batch["response_mask"].to(device), truncated=batch["truncated"].to(device),
        completions=batch["completions"], examples=batch["examples"], records=batch["records"],
        rollout_logp=batch["rollout_logp"].to(device))


def tool_runner(m) -> ToolRunner | None:
    """The ``multiturn`` section's tools loaded and checked (None without them); sandboxed when
    asked."""
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


@register("tool_loop")
@dataclass
class ToolLoop:
    """The multi-turn episode: every trajectory runs in its own environment from
    ``make_env(example)`` under ``budgets``; ``metrics`` holds the last batch's
    ``episode_metrics``. Each turn is sampled with its log-probs; the batch carries them only when
    asked (``with_logprobs``), as the single turn does."""

    make_env: Callable[[Example], Environment]
    budgets: Budgets
    metrics: dict = field(default_factory=dict)
    runner: object = None
    """The tools' runner the environments share (closed at the end of the run), if any."""
    template_kwargs: dict = field(default_factory=dict)
    """The chat template's extra variables (``task.chat_template_kwargs``) for tool turns."""
    demonstration_env: Callable[[Example], Environment] | None = None
    """The environments of the cold start's demonstrations (default ``make_env``): a user's
    environment under ``on_env_error=fail`` whatever the run's setting."""
    gives_rewards = True
    multi_turn = True

    @classmethod
    def from_config(cls, cfg, task=None) -> "ToolLoop":
        """The ``multiturn`` section's environment, tools and budgets (rollout.max_new_tokens per
        turn). A user's environment (module:Class) runs under ``Guard`` (multiturn.on_env_error,
        env_timeout_s), its demonstrations strictly; with ``task``, one is built for its first
        training example now, so a constructor that fails is one line at set-up (EnvError)."""
        m = cfg.multiturn
        budgets = Budgets(max_turns=m.max_turns, max_new_tokens=cfg.rollout.max_new_tokens,
                          max_total_tokens=m.max_total_tokens,
                          max_observation_tokens=m.max_observation_tokens)
        template_kwargs = dict(cfg.task.chat_template_kwargs)
        if ":" in m.env:                                    # user code: guarded
            guard = Guard(m.env, dict(m.params), timeout_s=m.env_timeout_s, on_error=m.on_env_error)
            for example in task.split("train")[:1] if task is not None else []:
                guard.strict()(example)                     # EnvError now, not at step 1
            return cls(guard, budgets, template_kwargs=template_kwargs,
                       demonstration_env=guard.strict())
        runner = tool_runner(m)
        params = {"runner": runner, "call_format": m.call_format} if m.env == "tools" else dict(m.params)
        return cls(EnvFactory(m.env, params), budgets, runner=runner, template_kwargs=template_kwargs)

    @staticmethod
    def refuses(cfg) -> str | None:
        if cfg.multiturn.env is None:
            return "the tool loop needs an environment: set multiturn.env"
        return None

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()

    def __call__(self, sampler, tokenizer, examples, params, *, group_size, seed,
                 with_logprobs) -> RolloutBatch:
        batch, rows = collect_episodes(sampler, tokenizer, examples, group_size, params,
                                       self.make_env, observer(tokenizer, self.template_kwargs),
                                       self.budgets, seed)
        self.metrics = episode_metrics(rows)
        out = as_batch(batch, sampler.device)
        if not with_logprobs:   # sampled with them (each turn), handed on only when asked for
            out.rollout_logp = None
        return out

    def demonstrations(self, tokenizer, examples, device) -> RolloutBatch:
        """Multi-turn SFT rows of ``examples`` (their ``data["turns"]``, else the answer as one
        turn) through their environments: the loss mask is the policy's turns only."""
        prompts = [tokenizer(ex.prompt)["input_ids"] for ex in examples]
        turns = [ex.data.get("turns") or [ex.answer] for ex in examples]
        encode, decode = codec(tokenizer)
        make_env = self.demonstration_env or self.make_env
        rows = demonstrations(prompts, turns, [make_env(ex) for ex in examples],
                              observer(tokenizer, self.template_kwargs), encode, decode,
                              tokenizer.eos_token_id, self.budgets)
        batch = to_tensors(rows, tokenizer.pad_token_id)
        batch.update(completions=[r.final_turn for r in rows], examples=list(examples),
                     records=[r.record() for r in rows])
        return as_batch(batch, device)
