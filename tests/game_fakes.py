"""Importable by module:callable from the reset/step tests: one guessing game behind each protocol
of ``gspo.rollout.episodes.reset_step``, with the signatures of the real libraries (textarena
0.7.4 ``Env``, GEM 0.1.0 / gymnasium ``Env``, openenv-core 0.3.0 ``Environment`` and its client's
``StepResult``), and games that raise or hang. None of those libraries is needed.

The game: a hidden number in 0..3 (the reset seed modulo 4); each guess is answered "higher" or
"lower"; the right guess ends it with reward 1, and each wrong one costs 0.25 (gym, openenv)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

PROMPT = "Guess my number, 0 to 3."


class Game:
    def __init__(self):
        self.target, self.guesses = None, []

    def start(self, seed):
        self.target, self.guesses = seed % 4, []

    def guess(self, action: str) -> tuple[str, bool]:
        self.guesses.append(action)
        number = int(action.strip()) if action.strip().isdigit() else -1
        if number == self.target:
            return "right", True
        return ("higher" if number < self.target else "lower"), False


# ------------------------------------------------------------------------- textarena 0.7.4
class TextArenaGame:
    """``ta.Env`` with an ``LLMObservationWrapper``: each observation is the whole history so far."""

    def __init__(self, cumulative: bool = True):
        self.game, self.cumulative, self.history, self.new = Game(), cumulative, "", []
        self.rewards = None

    def reset(self, num_players: int, seed: int | None = None):
        assert num_players == 1
        self.game.start(seed)
        self.say(f"[GAME] {PROMPT}")

    def say(self, message: str):
        self.history += message + "\n"
        self.new.append((-1, message, "GAME_MESSAGE"))

    def get_observation(self):
        if self.cumulative:
            return 0, self.history
        new, self.new = self.new, []
        return 0, new

    def step(self, action: str):
        self.new.append((0, action, "PLAYER_ACTION"))
        self.history += f"[Player 0] {action}\n"
        answer, done = self.game.guess(action)
        if done:
            self.rewards = {0: 1}
        else:
            self.say(f"[GAME] {answer}")
        return done, {}

    def close(self):
        return self.rewards, {0: {"role": "Player 0", "invalid_move": False}}


def textarena_make(env_id: str, cumulative: bool = True):
    """``textarena.make(env_id)``."""
    assert env_id == "Guess-v0"
    return TextArenaGame(cumulative)


# ----------------------------------------------------------------- GEM 0.1.0 / gymnasium
class GymGame:
    """``gem.Env``: reset(seed) -> (obs, info); step(action) -> (obs, reward, terminated, truncated, info)."""

    closed = []

    def __init__(self, max_turns: int = 10):
        self.game, self.max_turns = Game(), max_turns

    def reset(self, seed: int | None = None):
        self.game.start(seed)
        return PROMPT, {"suffix": ""}

    def step(self, action: str):
        answer, done = self.game.guess(action)
        truncated = not done and len(self.game.guesses) >= self.max_turns
        return answer, 1.0 if done else -0.25, done, truncated, {}

    def close(self):
        GymGame.closed.append(self.game.target)


# ---------------------------------------------------------------------- openenv-core 0.3.0
@dataclass
class GuessAction:                     # an openenv ``Action`` (pydantic there): keyword fields
    guess: str
    metadata: dict = field(default_factory=dict)


@dataclass
class GuessObservation:                # an openenv ``Observation``: done and reward on it
    feedback: str
    done: bool = False
    reward: float | None = None
    metadata: dict = field(default_factory=dict)


@dataclass
class StepResult:                      # openenv.core.client_types.StepResult
    observation: GuessObservation
    reward: float | None = None
    done: bool = False


class OpenEnvGame:
    """A local ``openenv.core.Environment``: reset(seed, episode_id, **kw) -> Observation;
    step(action, timeout_s, **kw) -> Observation."""

    def __init__(self):
        self.game = Game()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs):
        self.game.start(seed)
        return GuessObservation(PROMPT)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs):
        assert isinstance(action, GuessAction)
        answer, done = self.game.guess(action.guess)
        return GuessObservation(answer, done=done, reward=1.0 if done else -0.25)


class OpenEnvClient(OpenEnvGame):
    """A client (``GenericEnvClient(...).sync()``): the same game answering ``StepResult``s."""

    def reset(self, **kwargs):
        obs = super().reset(**kwargs)
        return StepResult(obs, obs.reward, obs.done)

    def step(self, action, **kwargs):
        obs = super().step(action)
        return StepResult(GuessObservation(obs.feedback), obs.reward, obs.done)


class GenericAction(dict):             # openenv.core.GenericAction: a dict made from keywords
    def __init__(self, **kwargs):
        super().__init__(kwargs)


class OpenEnvAsyncClient:
    """``openenv.core.GenericEnvClient(base_url=...)``: async ``reset``/``step``, whose
    ``StepResult``s hold the observation as a dict; ``.sync()`` is its blocking wrapper."""

    def __init__(self, base_url: str):
        self.game = OpenEnvGame()

    async def reset(self, **kwargs):
        obs = self.game.reset(**kwargs)
        return StepResult({"feedback": obs.feedback}, obs.reward, obs.done)

    async def step(self, action: dict, **kwargs):
        obs = self.game.step(GuessAction(**action))
        return StepResult({"feedback": obs.feedback}, obs.reward, obs.done)

    def sync(self):
        return SyncClient(self)


class SyncClient:
    """``openenv.core.SyncEnvClient``: each call of the async client run to its end."""

    def __init__(self, client):
        self.client = client

    def reset(self, **kwargs):
        return asyncio.run(self.client.reset(**kwargs))

    def step(self, action, **kwargs):
        return asyncio.run(self.client.step(action, **kwargs))


# ------------------------------------------------------------------------------- faults
class Raises(GymGame):
    """Raises at its second guess."""

    def step(self, action: str):
        if self.game.guesses:
            raise KeyError("board")
        return super().step(action)


class Hangs(GymGame):
    """Hangs at its first guess (past the test's multiturn.env_timeout_s)."""

    def step(self, action: str):
        time.sleep(1.5)
        return super().step(action)


class BadReset(GymGame):
    def reset(self, seed: int | None = None):
        raise RuntimeError("no board")
