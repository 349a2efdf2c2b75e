"""The reset/step episode: an environment of another library (textarena, GEM or gymnasium,
OpenEnv) plays every trajectory, the policy's turns its actions, its own reward the row's.

    rollout: {episode: reset_step}
    multiturn:
      params: {make: "textarena:make", kwargs: {env_id: GuessTheNumber-v0}, protocol: textarena}
      on_env_error: end
    rewards: {on_error: drop, sources: [{type: env}]}

Each row builds its environment (``make(**kwargs)``) and resets it with the example's seed (its
``seed`` column, else a stable hash of its prompt), so the G rows of a prompt start in the same
state. The reset's observation is the row's prompt (one user message under ``task.chat``, else
the text as is; the batch's examples carry it as their prompt): the game speaks first, which is why this is an episode over ``turn_loop`` and
not an ``Environment`` of the tool loop, whose prompts are the task's. Each closed turn is one
``step(action)``; the observation it answers is appended (a user message under ``task.chat``),
until the environment says done. The protocols (``PROTOCOLS``):

* ``textarena`` (0.7): ``reset(num_players=1, seed=)``, ``get_observation() -> (player, obs)``,
  ``step(action) -> (done, info)``, ``close() -> rewards`` ((rewards, game_info) in 0.7.4); the
  reward is player 0's at the end. A cumulative observation (its LLM wrappers repeat the whole
  history) is cut to what is new; a raw one (a list of (sender, message, type)) is joined
  without the player's own messages. Single-player games only.
* ``gym`` (GEM, gymnasium): ``reset(seed=) -> (obs, info)``, ``step(action) -> (obs, reward,
  terminated, truncated, info)``; the reward is the sum of the step rewards.
* ``openenv``: ``reset(seed=)`` and ``step(Action)`` answer a ``StepResult`` (a client:
  ``.observation``, ``.reward``, ``.done``; an async ``EnvClient`` is driven through its
  ``.sync()``) or an ``Observation`` (a local ``Environment``: ``.reward``, ``.done`` on it); the
  action is ``action(**{action_field: text})``, the text of a typed observation (or of a dict's)
  its ``observation_field``; the reward is the sum of the step rewards.

The environment's reward is the record's (``rewards.sources: [{type: env}]``); a row that got none
(a textarena game not finished, a first turn cut short) is a reward failure (``rewards.on_error``).
A turn cut by a budget is not sent. The environment is user code under ``gspo.envs.guard``: its
make, reset and every step under ``multiturn.env_timeout_s``; one that raises or hangs ends its
row ``env_error``, counted (``multiturn/env_errors_mean``), and the run goes on. This module
imports none of those libraries: ``make`` names the callable that builds the environment.
"""

from __future__ import annotations

import inspect
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from gspo.envs import Observation, Reply, Turn
from gspo.envs.guard import Failed, Guard, GuardedEnv
from gspo.errors import RewardFault
from gspo.rollout.episodes.base import register
from gspo.rollout.episodes.tool_loop import as_batch, codec, engine_sampler, observer, turns_of
from gspo.rollout.episodes.turn_loop import (Budgets, episode_metrics, observation_rows_refusal,
                                             run_episodes, to_tensors)
from gspo.rollout.generate import RolloutBatch
from gspo.tasks import Example
from gspo.tasks.custom import load_function

PARAMS = ("make", "kwargs", "protocol", "action", "action_field", "observation_field")
"""The keys of ``multiturn.params`` this episode reads."""


def seed_of(example: Example) -> int:
    """The reset seed of ``example``: its ``seed`` column, else a stable hash of its prompt."""
    seed = example.data.get("seed")
    return seed if type(seed) is int else zlib.crc32(example.prompt.encode()) & 0x7FFFFFFF


def text_of(obs, field_name: str | None) -> str:
    """An observation as text: itself when it is a string, else its field (or key, of a mapping:
    openenv's ``GenericEnvClient`` answers dicts) ``field_name``."""
    if isinstance(obs, str):
        return obs
    if field_name is None:
        raise ValueError(f"the observation is a {type(obs).__name__}, not text: name its text field "
                         f"in multiturn.params.observation_field")
    return str(obs[field_name] if isinstance(obs, Mapping) else getattr(obs, field_name))


class TextArena:
    """textarena 0.7: rewards at the end of a single-player game."""

    def __init__(self, env, **_):
        self.env, self.shown = env, ""

    def reset(self, seed: int) -> str:
        self.env.reset(num_players=1, seed=seed)
        return self.observe()

    def observe(self) -> str:
        player, obs = self.env.get_observation()
        if player != 0:
            raise ValueError(f"player {player} is to move: only single-player games are served")
        if not isinstance(obs, str):          # raw: [(sender, message, type)], new ones only
            return "\n".join(str(m[1]) for m in obs if m[0] != player)
        new = obs[len(self.shown):] if obs.startswith(self.shown) else obs   # cumulative wrappers
        self.shown = obs
        return new

    def step(self, text: str) -> tuple[str | None, float | None, bool]:
        done, _ = self.env.step(text)
        if not done:
            return self.observe(), None, False
        rewards = self.env.close()
        rewards = rewards[0] if isinstance(rewards, tuple) else rewards     # 0.7.4: (rewards, info)
        return None, float(rewards[0]), True


class Gym:
    """GEM and gymnasium: a reward every step."""

    def __init__(self, env, observation_field=None, **_):
        self.env, self.field = env, observation_field

    def reset(self, seed: int) -> str:
        obs, _ = self.env.reset(seed=seed)
        return text_of(obs, self.field)

    def step(self, text: str) -> tuple[str | None, float | None, bool]:
        obs, reward, terminated, truncated, _ = self.env.step(text)
        done = bool(terminated or truncated)
        return None if done else text_of(obs, self.field), float(reward), done


class OpenEnv:
    """OpenEnv: a client's ``StepResult`` or a local environment's ``Observation``; typed actions.
    openenv's clients (``EnvClient``) are async: one is driven through its blocking ``.sync()``."""

    def __init__(self, env, action=None, action_field=None, observation_field=None, **_):
        if inspect.iscoroutinefunction(getattr(env, "reset", None)) and callable(getattr(env, "sync", None)):
            env = env.sync()
        self.env, self.action, self.action_field, self.field = env, action, action_field, observation_field

    def read(self, result) -> tuple[str, float | None, bool]:
        obs = getattr(result, "observation", result)
        reward = getattr(result, "reward", None)
        return text_of(obs, self.field), None if reward is None else float(reward), bool(getattr(result, "done", False))

    def reset(self, seed: int) -> str:
        return self.read(self.env.reset(seed=seed))[0]

    def step(self, text: str) -> tuple[str | None, float | None, bool]:
        obs, reward, done = self.read(self.env.step(self.action(**{self.action_field: text})))
        return None if done else obs, reward, done


PROTOCOLS = {"textarena": TextArena, "gym": Gym, "openenv": OpenEnv}


class ResetStepEnv:
    """One row's environment of another library, made and reset, as a gspo ``Environment``; its
    ``opening`` is the reset's observation."""

    def __init__(self, example: Example, make: str, protocol: str, kwargs: dict | None = None,
                 chat: bool = False, action: str | None = None, **options):
        env = load_function(make)(**(kwargs or {}))
        self.env = PROTOCOLS[protocol](env, action=action and load_function(action), **options)
        self.chat, self.total, self.done = chat, None, False
        self.opening = self.env.reset(seed_of(example))

    def step(self, turn: Turn) -> Reply:
        if not turn.ended:                    # a turn cut by a budget is not an action
            return Reply(None)
        obs, reward, self.done = self.env.step(turn.text)
        if reward is not None:
            self.total = (self.total or 0.0) + reward
        if obs is None:
            return Reply(None)
        return Reply(Observation(messages=({"role": "user", "content": obs},)) if self.chat
                     else Observation(text=obs))

    def reward(self) -> float | None:
        return self.total

    def close(self) -> None:
        close = getattr(self.env.env, "close", None)
        if callable(close) and not isinstance(self.env, TextArena):   # textarena's close is its reward
            close()


def refusal(params: dict) -> str | None:
    """Why ``multiturn.params`` cannot make a reset/step environment, or None (imports ``make``)."""
    if unknown := sorted(set(params) - set(PARAMS)):
        return f"multiturn.params.{unknown[0]} is not a reset_step parameter ({', '.join(PARAMS)})"
    if not isinstance(params.get("make"), str):
        return "set multiturn.params.make, the module:callable that builds the environment (e.g. textarena:make)"
    if params.get("protocol") not in PROTOCOLS:
        return f"set multiturn.params.protocol to one of {', '.join(PROTOCOLS)}, got {params.get('protocol')!r}"
    if not isinstance(params.get("kwargs", {}), dict):
        return "multiturn.params.kwargs must be a mapping (the keyword arguments of make)"
    if params["protocol"] == "openenv" and not (isinstance(params.get("action"), str) and params.get("action_field")):
        return ("protocol openenv needs multiturn.params.action (the Action class, module:Class) and "
                "action_field (its field that holds the turn's text)")
    try:
        for spec in (params["make"], params.get("action")):
            if spec is not None:
                load_function(spec)
    except ValueError as err:
        return f"multiturn.params: {err}"
    return None


@register("reset_step")
@dataclass
class ResetStep:
    """Each trajectory a reset/step environment of another library (``multiturn.params``);
    ``metrics`` holds the last batch's multiturn/* and ``reset_step/unfinished``."""

    params: dict
    budgets: Budgets
    guard: Guard
    chat: bool = False
    template_kwargs: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    gives_rewards = True
    multi_turn = True

    @classmethod
    def from_config(cls, cfg, task=None) -> "ResetStep":
        """multiturn's params, budgets and guard; with ``task``, one environment is made and reset
        for its first training example now (a failure is one line at set-up, EnvError)."""
        m = cfg.multiturn
        budgets = Budgets(max_turns=m.max_turns, max_new_tokens=cfg.rollout.max_new_tokens,
                          max_total_tokens=m.max_total_tokens, max_observation_tokens=m.max_observation_tokens)
        guard = Guard(m.params["make"], {}, timeout_s=m.env_timeout_s, on_error=m.on_env_error)
        episode = cls(dict(m.params), budgets, guard, chat=cfg.task.chat,
                      template_kwargs=dict(cfg.task.chat_template_kwargs or {}))
        for example in task.split("train")[:1] if task is not None else []:
            episode.start(example, guard.strict())
        return episode

    @staticmethod
    def refuses(cfg) -> str | None:
        if cfg.multiturn.env is not None:
            return f"the environment is multiturn.params.make: unset multiturn.env={cfg.multiturn.env}"
        if why := refusal(dict(cfg.multiturn.params)):
            return why
        if why := observation_rows_refusal(cfg):
            return why
        if cfg.sft.enabled and cfg.sft.steps > 0:
            return ("the prompts are the environment's openings, which the task's demonstrations do not "
                    "hold: set sft.enabled=false")
        if cfg.multiturn.on_env_error == "fail":
            return ("an environment of another library that fails must not stop the run: set "
                    "multiturn.on_env_error=end (its episode ends, counted)")
        if cfg.rewards.on_error == "fail":
            return ("a game that ends without a reward (unfinished, failed) is a reward failure: set "
                    "rewards.on_error=drop or zero")
        return None

    def close(self) -> None:
        pass

    def start(self, example: Example, guard: Guard):
        """(the row's guarded environment, its adapter, its opening text): made and reset under
        ``guard``; one that fails is (Failed, None, None): its row ends at turn 1."""
        try:
            env = guard.call(ResetStepEnv, example, chat=self.chat, **self.params)
        except RewardFault as fault:
            return Failed(guard.failed(example, "make or reset", str(fault))), None, None
        return GuardedEnv(guard, env, example), env, env.opening

    def prompt(self, tokenizer, opening: str | None, example: Example) -> tuple[str, list[int]]:
        """The opening as the row's prompt (text, ids): one user message through the chat template
        under ``task.chat``, else the text as the tokenizer encodes it; without one (its
        environment failed), the example's prompt."""
        if opening is None or not self.chat:
            text = example.prompt if opening is None else opening
            return text, tokenizer(text)["input_ids"]
        text = tokenizer.apply_chat_template([{"role": "user", "content": opening}], tokenize=False,
                                             add_generation_prompt=True, **self.template_kwargs)
        return text, tokenizer(text, add_special_tokens=False)["input_ids"]

    def first_turns(self, sampler, prompts: list[list[int]], group_size: int, params, seed):
        """Turn 1 of every row: G samples of each prompt when the G rows of every group share one
        (a deterministic reset), else one sample of each row's."""
        first_params = replace(params, max_new_tokens=min(params.max_new_tokens, self.budgets.max_new_tokens,
                                                          self.budgets.max_total_tokens))
        shared = all(prompts[i] == prompts[i - i % group_size] for i in range(len(prompts)))
        return turns_of(sampler.generate(prompts[::group_size] if shared else prompts,
                                         group_size if shared else 1, first_params, seed=seed,
                                         with_logprobs=True))

    def release(self, adapters: list[ResetStepEnv]) -> None:
        """Close each environment (gym, openenv) under the guard; a failure leaves its row as it is."""
        for env in adapters:
            try:
                self.guard.call(env.close)
            except RewardFault:
                pass

    def __call__(self, sampler, tokenizer, examples, params, *, group_size, seed,
                 with_logprobs) -> RolloutBatch:
        rows_examples = [ex for ex in examples for _ in range(group_size)]
        started = [self.start(ex, self.guard) for ex in rows_examples]
        texts, prompts = map(list, zip(*(self.prompt(tokenizer, opening, ex)
                                          for (_, _, opening), ex in zip(started, rows_examples))))
        rows_examples = [replace(ex, prompt=text) for ex, text in zip(rows_examples, texts)]  # as given
        first = self.first_turns(sampler, prompts, group_size, params, seed)
        later, turn = engine_sampler(sampler, params, seed), [0]

        def sample(contexts, room, rows):
            turn[0] += 1
            return [first[i] for i in rows] if turn[0] == 1 else later(contexts, room, rows)

        encode, decode = codec(tokenizer)
        rows = run_episodes(sample, prompts, [env for env, _, _ in started],
                            observer(tokenizer, self.template_kwargs), decode, tokenizer.eos_token_id,
                            self.budgets, encode=encode)
        self.release([env for _, env, _ in started if env is not None])
        batch = to_tensors(rows, tokenizer.pad_token_id)
        batch.update(completions=[r.final_turn for r in rows], examples=rows_examples,
                     records=[r.record() for r in rows])
        unfinished = sum(env is None or not env.done for _, env, _ in started)
        self.metrics = {**episode_metrics(rows), "reset_step/unfinished": unfinished / max(1, len(rows))}
        out = as_batch(batch, sampler.device)
        if not with_logprobs:
            out.rollout_logp = None
        return out
