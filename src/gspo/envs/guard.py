"""A user's environment (``multiturn.env: module:Class``) under a deadline and an error policy:
user code, guarded as reward functions and tools are (docs/multiturn.md, *When an environment
fails*).

    guard = Guard("mymod:MyEnv", params, timeout_s=30, on_error="end")
    env = guard(example)            # under on_error=end never raises
    reply = env.step(turn)          # a Reply; after a failure Reply(None, error="...")

A user's environment fails when its constructor or ``step`` raises, does not return within
``timeout_s`` (each call, in a worker thread: ``gspo.rewards.isolation.TimedCaller``), or
``step`` returns something that is not a ``Reply`` holding an ``Observation`` or None. Then:

* ``fail``: ``EnvError``, one line naming the environment, the example and the error (exit 2).
  A cold start's demonstrations and the set-up's check (``strict``) always fail this way;
* ``end``: the episode ends at that turn (``Reply.error`` says why; the rollout loop ends the row
  ``env_error`` and counts it in ``multiturn/env_errors_mean``); the first few are printed.

A ``UserError`` the environment raises (a tool under ``on_tool_error: fail``) stops the run as it
is. This module does not guard the built-in environments (their faults are gspo's bugs), does not
retry, and cannot kill a hung call: its thread is abandoned, ``max_hung`` of them at most.
"""

from __future__ import annotations

import sys

from gspo.envs.base import Environment, Observation, Reply, Turn, build
from gspo.errors import RewardError, RewardFault, UserError
from gspo.rewards.isolation import TimedCaller, describe
from gspo.tasks.base import Example

ON_ENV_ERROR = ("fail", "end")
MAX_LOGGED = 5  # failures printed per run under on_error=end (all are counted)


class EnvError(UserError):
    """A user's environment failed under ``on_env_error: fail`` (or in the cold start): one line."""


class Guard:
    """``guard(example)``: a fresh environment ``name`` built with ``params`` under the deadline
    and the policy (picklable: an asynchronous worker process gets it with the episode)."""

    def __init__(self, name: str, params: dict, *, timeout_s: float = 30.0, on_error: str = "fail",
                 max_hung: int = 8):
        if on_error not in ON_ENV_ERROR:
            raise ValueError(f"on_env_error must be one of {', '.join(ON_ENV_ERROR)}, got {on_error!r}")
        self.name, self.params, self.on_error, self.max_hung = name, params, on_error, max_hung
        self.caller = TimedCaller(timeout_s, max_hung)
        self.logged = 0

    def strict(self) -> "Guard":
        """The same environment under ``on_error=fail`` (the cold start's, the set-up's)."""
        return Guard(self.name, self.params, timeout_s=self.caller.timeout_s, on_error="fail",
                     max_hung=self.max_hung)

    def __call__(self, example: Example) -> Environment:
        try:
            return GuardedEnv(self, self.call(build, self.name, example, **self.params), example)
        except RewardFault as fault:
            return Failed(self.failed(example, "constructor", str(fault)))

    def call(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` under the deadline; RewardFault (one line) when it fails."""
        try:
            return self.caller(fn, *args, **kwargs)
        except RewardError:                            # too many hung calls: the run stops
            raise EnvError(f"environment {self.name!r} hung {self.caller.hung} times "
                           f"(multiturn.env_timeout_s={self.caller.timeout_s:g}); each leaves a "
                           f"thread running, so the run stops here: fix the environment") from None
        except UserError:
            raise
        except (Exception, SystemExit) as err:         # noqa: BLE001  the environment's own
            raise RewardFault(describe(err)) from None

    def failed(self, example: Example, where: str, reason: str) -> str:
        """The one line about a failure: raised under ``fail``, else printed (the first few) and
        returned for the episode's ``Reply.error``."""
        what = (f"environment {self.name!r} failed in {where} (example {example.prompt[:60]!r}): "
                f"{reason}")
        if self.on_error == "fail":
            raise EnvError(f"{what}. multiturn.on_env_error=fail: fix the environment, or set "
                           f"multiturn.on_env_error=end to end such episodes and count them")
        self.logged += 1
        if self.logged <= MAX_LOGGED:
            last = " (further failures are only counted)" if self.logged == MAX_LOGGED else ""
            print(f"warning: {what}; the episode ends (multiturn/env_errors_mean){last}",
                  file=sys.stderr)
        return what


class GuardedEnv:
    """A user's environment whose every ``step`` runs under its guard."""

    def __init__(self, guard: Guard, env: Environment, example: Example):
        self.guard, self.env, self.example, self.turns = guard, env, example, 0

    def step(self, turn: Turn) -> Reply:
        self.turns += 1
        where = f"step (turn {self.turns} {turn.text[:40]!r})"
        try:
            return checked(self.guard.call(self.env.step, turn))
        except RewardFault as fault:
            return Reply(None, error=self.guard.failed(self.example, where, str(fault)))

    def reward(self) -> float | None:
        return self.env.reward() if callable(getattr(self.env, "reward", None)) else None


class Failed:
    """The environment of an episode whose constructor failed (``end``): it ends at turn one."""

    def __init__(self, error: str):
        self.error = error

    def step(self, turn: Turn) -> Reply:
        return Reply(None, error=self.error)

    def reward(self) -> float | None:
        return None


def checked(reply) -> Reply:
    """``reply`` when it is a well-formed ``Reply``, else RewardFault saying what it is."""
    if not isinstance(reply, Reply):
        raise RewardFault(f"step returned {type(reply).__name__}, expected gspo.envs.Reply")
    if reply.observation is not None and not isinstance(reply.observation, Observation):
        raise RewardFault(f"step returned a Reply whose observation is "
                          f"{type(reply.observation).__name__}, expected gspo.envs.Observation or None")
    counts = (reply.tool_calls, reply.tool_errors)
    if not (all(type(c) is int for c in counts) and isinstance(reply.info, dict)):
        raise RewardFault("step returned a Reply whose tool_calls / tool_errors are not int or "
                          "whose info is not a dict")
    return reply
