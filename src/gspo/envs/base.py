"""The environment interface: what answers the policy's turns in a multi-turn episode.

An episode starts from a task's example; the policy writes a turn; the environment answers with
an observation (text the policy did not sample, appended to its context with loss mask 0) or
says the episode is done. One environment object is built per trajectory from the example, so
the G members of a group start in the same state and never share one.

    env = build("guess", example)          # or build("mymod:MyEnv", example, **params)
    reply = env.step(Turn(text="16", ended=True))
    reply.observation                      # Observation(text="<") | None when done

Observations are raw ``text`` (appended as the tokenizer encodes it: the character tokenizer,
a model without a chat template) or chat ``messages`` (``{"role": "tool" | "user", "content"}``,
rendered by the chat template, whose rendering decides the ids). An environment may own the
reward (``reward()`` returns a number once done), else the task's reward scores the final turn.

This module deliberately holds no tokenizer and no tensors: environments see text in and give
text out; the rollout loop (``gspo.rollout``) owns the ids, the masks and the budgets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

from gspo.registry import Registry
from gspo.tasks.base import Example, call_kwargs
from gspo.tasks.custom import load_function


@dataclass(frozen=True)
class Turn:
    """One turn of the policy, as the environment sees it."""

    text: str
    """The turn decoded, without its end-of-turn token."""
    ended: bool = True
    """True when the policy closed the turn (its end-of-turn token); False when a budget cut it."""


@dataclass(frozen=True)
class Observation:
    """What the environment answers: raw text, or chat messages for the template to render."""

    text: str | None = None
    """Appended as the tokenizer encodes it (no template)."""
    messages: tuple[dict, ...] = ()
    """Chat messages (role tool or user) rendered by the chat template."""

    def __post_init__(self):
        if (self.text is None) == (not self.messages):
            raise ValueError("an Observation holds either text or messages, exactly one")


@dataclass(frozen=True)
class Reply:
    """The environment's answer to one turn."""

    observation: Observation | None
    """None: the episode is done."""
    tool_calls: int = 0
    """Tool calls this turn made."""
    tool_errors: int = 0
    """Of them, the ones that failed (raised, hung, exceeded a limit, could not be parsed)."""
    parse_errors: int = 0
    """Tool calls this turn that could not be parsed (malformed, unclosed)."""
    info: dict = field(default_factory=dict)
    """Anything else to keep with the trajectory (e.g. the calls, for reward functions)."""
    error: str | None = None
    """Set by ``gspo.envs.guard`` only: the environment failed (why, one line); the episode ends."""


@runtime_checkable
class Environment(Protocol):
    """One trajectory's environment, built from its example."""

    def step(self, turn: Turn) -> Reply: ...

    def reward(self) -> float | None:
        """The environment's own reward of the finished episode, or None (the task's reward)."""
        ...


# ------------------------------------------------------------------------------------ registry

_REGISTRY: Registry[Callable[..., Environment]] = Registry("environment", valid="valid environments")


def register(name: str):
    """Class decorator: ``@register("guess")`` makes ``Cls(example, **params)`` buildable by name."""
    return _REGISTRY.register(name)


def available() -> list[str]:
    """Names of the built-in environments, sorted."""
    return _REGISTRY.names()


def factory(name: str) -> Callable[..., Environment]:
    """The class of a built-in environment, or ``module:Class`` imported (ValueError, one line)."""
    if ":" not in name:
        return _REGISTRY.get(name)
    try:
        return load_function(name)      # the one resolver of module:attribute specs
    except ValueError as err:
        raise ValueError(f"environment {name!r}: {err}") from None


def check(name: str, params: dict) -> None:
    """Refuse, before anything is built, a name that does not resolve or params it does not take."""
    call_kwargs(factory(name), params, what=f"environment {name!r}", args=(None,))


def build(name: str, example: Example, **params) -> Environment:
    """A fresh environment for one trajectory of ``example``."""
    env = factory(name)(example, **params)
    if not callable(getattr(env, "step", None)):
        raise ValueError(f"environment {name!r} has no step(turn) method")
    return env


@register("single")
class SingleTurn:
    """The trivial episode: done after the policy's first turn (the single-turn rollouts)."""

    def __init__(self, example: Example):
        self.example = example

    def step(self, turn: Turn) -> Reply:
        return Reply(None)

    def reward(self) -> float | None:
        return None


@register("guess")
class GuessEnv:
    """The ``guess`` task's feedback: each guess is answered ``<`` (the hidden number is smaller)
    or ``>`` (larger), a newline after it; the episode ends at the right guess, at a turn that is
    not a number, or at a turn a budget cut."""

    def __init__(self, example: Example):
        self.target = int(example.data["target"])

    def step(self, turn: Turn) -> Reply:
        guess = turn.text.strip()
        if not turn.ended or not guess.isdigit() or int(guess) == self.target:
            return Reply(None)
        return Reply(Observation(text="<\n" if self.target < int(guess) else ">\n"))

    def reward(self) -> float | None:
        return None
