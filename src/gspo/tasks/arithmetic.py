"""`arithmetic`: one binary operation on small integers, short exact answers.

Prompt `"37+45="`, answer `"82"`. Subtraction is ordered so results are never negative;
multiplication takes a second operand of at most `max_mul_digits` digits (`"37*8="` → `"296"`).
Reward 1.0 when the stripped completion equals the answer exactly, else 0.0. Not a word problem,
not multi-step: the `multistep` task covers worked steps.
"""

from __future__ import annotations

import operator
import random

from gspo.tasks.base import Example, make_splits, pick_split, register

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@register("arithmetic")
class Arithmetic:
    """`a op b=` → the result, operands drawn uniformly from [0, 10**max_digits)."""

    name = "arithmetic"

    def __init__(
        self,
        seed: int = 0,
        n_train: int = 5000,
        n_test: int = 200,
        n_val: int = 0,
        max_digits: int = 2,
        ops: str = "+-",
        max_mul_digits: int = 1,
    ):
        """
        seed: generator seed; the same seed gives the same splits.
        n_train, n_test, n_val: examples per split (disjoint by prompt; validation is for
            choosing hyper-parameters, e.g. the `gspo compare` grid, never test).
        max_digits: max digits of an operand (2: 0..99).
        ops: the operators to draw from, any of "+-*".
        max_mul_digits: max digits of the second operand of "*" (keeps products short).
        """
        if not ops or set(ops) - set(_OPS):
            raise ValueError(f"arithmetic: ops must be a non-empty subset of '+-*', got {ops!r}")
        if max_digits < 1 or max_mul_digits < 1:
            raise ValueError(f"arithmetic: max_digits, max_mul_digits must be >= 1, got {max_digits}, {max_mul_digits}")
        self.max_digits, self.ops, self.max_mul_digits = max_digits, ops, max_mul_digits
        self._splits = make_splits(self.name, random.Random(seed), self._sample, n_train, n_test, n_val)

    def _sample(self, rng: random.Random) -> Example:
        op = rng.choice(self.ops)
        a = rng.randrange(10**self.max_digits)
        b = rng.randrange(10 ** (self.max_mul_digits if op == "*" else self.max_digits))
        if op == "-" and a < b:
            a, b = b, a  # non-negative results only
        target = _OPS[op](a, b)
        return Example(prompt=f"{a}{op}{b}=", answer=str(target), data={"target": target})

    def split(self, name: str) -> list[Example]:
        return pick_split(self.name, self._splits, name)

    def reward(self, completion: str, example: Example) -> float:
        return 1.0 if completion.strip() == example.answer else 0.0

    def is_correct(self, completion: str, example: Example) -> bool:
        return self.reward(completion, example) == 1.0
