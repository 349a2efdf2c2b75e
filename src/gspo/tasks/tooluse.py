"""Tasks where a tool or an environment's feedback genuinely pays, small enough for a 2-core CPU
(character tokenizer, ``bracket`` tool calls: ``[calc 48213+90577]``, answered ``=138790``).

* ``calculator``: ``A 48213+90577:`` -> ``#138790``. The numbers are too long for a tiny model
  to add reliably in its head; the tool ``calc`` adds exactly. ``call_fraction`` of the
  demonstrations call it (``[calc 48213+90577]``, then ``#138790`` after the answer), the rest
  answer directly, so the cold start calls the tool only some of the time.
* ``lookup``: ``K qzfx:`` -> ``#7342``: the value exists only behind the tool ``lookup`` (a hash of
  the key and the task's seed), so without the tool a policy is at chance (1 in 10^digits).
* ``guess``: ``G qzf:`` -> find a hidden number in 1..``2^bits``: each guess is answered ``<``
  (the number is smaller), ``>`` or ends the episode when right (``gspo.envs`` ``guess``); the
  demonstrations bisect, so they take up to ``bits`` + 1 turns of feedback.

``call_format: hermes`` (calculator, lookup) writes the demonstrations' calls as a chat model does,
``<tool_call>{"name": "calc", "arguments": {"expression": "48213+90577"}}</tool_call>``, for a run
under a chat template with ``multiturn.call_format: hermes``.

Each example's ``data["turns"]`` holds the demonstration's policy turns (the environment's
answers between them are produced by the environment itself, in SFT as in RL), and the answer
is the last turn. The reward reads only the final turn: 1.0 when it is ``#`` + the right value
(``guess``: the right number), else 0.0. Plain Python: the tools are plain functions here too.
"""

from __future__ import annotations

import json
import random
import re
import string
import zlib

from gspo.tasks.base import Example, make_splits, pick_split, register

_SUM = re.compile(r"^\s*(\d+)\s*\+\s*(\d+)\s*$")


def calc(expression: str) -> str:
    """Add two non-negative integers written as 'a+b'.

    Args:
        expression: the sum to compute, e.g. '48213+90577'.
    """
    match = _SUM.match(expression)
    if not match:
        raise ValueError(f"calc adds two numbers written a+b, got {expression!r:.40}")
    return str(int(match[1]) + int(match[2]))


def lookup_value(key: str, seed: int = 0, digits: int = 4) -> str:
    """The value stored under ``key``: a fixed hash of the key and the seed, ``digits`` long."""
    return str(zlib.crc32(f"{seed}:{key}".encode()) % 10 ** digits).zfill(digits)


def lookup(key: str) -> str:
    """Look up the value stored under a key (the lookup task's table, seed 0).

    Args:
        key: the key, four lower-case letters.
    """
    if not re.fullmatch(r"[a-z]{1,8}", key):
        raise ValueError(f"keys are lower-case letters, got {key!r:.20}")
    return lookup_value(key)


CALL_FORMATS = ("bracket", "hermes")


def call_text(tool: str, argument: str, value: str, call_format: str = "bracket") -> str:
    """A demonstration's call of ``tool`` with its one argument: ``[calc 1+2]`` (bracket) or the
    hermes ``<tool_call>`` JSON a chat model writes (``multiturn.call_format`` must match)."""
    if call_format == "hermes":
        call = json.dumps({"name": tool, "arguments": {argument: value}})
        return f"<tool_call>\n{call}\n</tool_call>"
    return f"[{tool} {value}]"


def _check_format(task: str, call_format: str) -> None:
    if call_format not in CALL_FORMATS:
        raise ValueError(f"{task}: call_format must be one of {', '.join(CALL_FORMATS)}, got {call_format!r}")


def _calls_tool(prompt: str, fraction: float) -> bool:
    """Whether the demonstration of ``prompt`` calls the tool: a fixed function of the prompt."""
    return zlib.crc32(prompt.encode()) % 1000 < fraction * 1000


def final_answer(completion: str) -> str | None:
    """What follows the last ``#`` of the final turn (None: no ``#``)."""
    return completion.rpartition("#")[2].strip() if "#" in completion else None


class _ToolTask:
    """Shared by the tasks: splits, and a reward that reads ``#value`` of the final turn."""

    name = ""
    splits: dict[str, list[Example]]

    def split(self, name: str) -> list[Example]:
        return pick_split(self.name, self.splits, name)

    def reward(self, completion: str, example: Example) -> float:
        return float(final_answer(completion) == example.data["value"])

    def is_correct(self, completion: str, example: Example) -> bool:
        return self.reward(completion, example) == 1.0


@register("calculator")
class Calculator(_ToolTask):
    """`A a+b:` -> `#sum`, with the tool `calc` on `call_fraction` of the demonstrations."""

    name = "calculator"

    def __init__(self, seed: int = 0, n_train: int = 5000, n_test: int = 200, n_val: int = 0,
                 digits: int = 5, call_fraction: float = 0.3, call_format: str = "bracket"):
        """
        seed: generator seed; the same seed gives the same splits.
        n_train, n_test, n_val: examples per split (disjoint by prompt).
        digits: length of each number (the first digit is not 0).
        call_fraction: share of demonstrations that call the tool (by a checksum of the prompt).
        call_format: how the demonstrations call it: bracket | hermes (chat models, Qwen3).
        """
        _check_format(self.name, call_format)
        if digits < 1 or not 0.0 <= call_fraction <= 1.0:
            raise ValueError(f"calculator: digits >= 1 and 0 <= call_fraction <= 1, got {digits}, {call_fraction}")
        low, high = 10 ** (digits - 1), 10 ** digits - 1

        def sample(rng: random.Random) -> Example:
            a, b = rng.randint(low, high), rng.randint(low, high)
            prompt, value = f"A {a}+{b}:", str(a + b)
            turns = ([call_text("calc", "expression", f"{a}+{b}", call_format), f"#{value}"]
                     if _calls_tool(prompt, call_fraction)
                     else [f"#{value}"])
            return Example(prompt, turns[-1], {"value": value, "turns": turns})

        self.splits = make_splits(self.name, random.Random(seed), sample, n_train, n_test, n_val)


@register("lookup")
class Lookup(_ToolTask):
    """`K key:` -> `#value`, the value only behind the tool `lookup`."""

    name = "lookup"

    def __init__(self, seed: int = 0, n_train: int = 5000, n_test: int = 200, n_val: int = 0,
                 call_fraction: float = 1.0, call_format: str = "bracket"):
        """
        seed: generator seed of the keys (the values are the tool's, seed 0).
        n_train, n_test, n_val: examples per split (disjoint by key).
        call_fraction: share of demonstrations that call the tool; the others guess a value.
        call_format: how the demonstrations call it: bracket | hermes (chat models, Qwen3).
        """
        _check_format(self.name, call_format)

        def sample(rng: random.Random) -> Example:
            key = "".join(rng.choice(string.ascii_lowercase) for _ in range(4))
            prompt, value = f"K {key}:", lookup_value(key)
            guess = str(rng.randrange(10_000)).zfill(4)
            turns = ([call_text("lookup", "key", key, call_format), f"#{value}"]
                     if _calls_tool(prompt, call_fraction) else [f"#{guess}"])
            return Example(prompt, turns[-1], {"value": value, "turns": turns})

        self.splits = make_splits(self.name, random.Random(seed), sample, n_train, n_test, n_val)


def bisect_turns(target: int, high: int) -> list[str]:
    """The guesses of a bisection of 1..high for ``target``, the right one last."""
    low, turns = 1, []
    while True:
        guess = (low + high) // 2
        turns.append(str(guess))
        if guess == target:
            return turns
        low, high = (low, guess - 1) if target < guess else (guess + 1, high)


@register("guess")
class Guess(_ToolTask):
    """`G key:` -> find the hidden number in 1..2^bits from `<` / `>` answers."""

    name = "guess"

    def __init__(self, seed: int = 0, n_train: int = 5000, n_test: int = 200, n_val: int = 0,
                 bits: int = 4):
        """
        seed: generator seed of the keys; the hidden number is a hash of the key.
        n_train, n_test, n_val: examples per split (disjoint by key).
        bits: the number is in 1..2^bits; bisection needs at most bits + 1 guesses.
        """
        high = 2 ** bits

        def sample(rng: random.Random) -> Example:
            key = "".join(rng.choice(string.ascii_lowercase) for _ in range(3))
            target = zlib.crc32(f"guess:{key}".encode()) % high + 1
            turns = bisect_turns(target, high)
            return Example(f"G {key}:", turns[-1], {"value": str(target), "target": target,
                                                    "high": high, "turns": turns})

        self.splits = make_splits(self.name, random.Random(seed), sample, n_train, n_test, n_val)

    def reward(self, completion: str, example: Example) -> float:
        return float(completion.strip() == example.data["value"])
