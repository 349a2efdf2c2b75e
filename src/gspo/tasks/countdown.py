"""`countdown` (as in TinyZero): combine the given numbers with + - * / to reach a target.

Prompt `"3 5 7>22:"` (the numbers sorted, then `>` and the target), answer `"3*5+7"`. As in
TinyZero each given number must be used exactly once (`use_all=True`); `use_all=False` relaxes
that to at most once. Reward: 1.0 for a valid expression equal to the target, `format_reward`
(0.1, TinyZero's format score) for a valid expression with the right numbers but another value
(or a division by zero), 0.0 for anything else: unparsable text, a number used twice or not
given. Expressions are parsed with `ast` against a whitelist (integer literals, + - * /,
parentheses) and evaluated exactly with `Fraction`; nothing is `eval`-ed. Not a search solver:
the generator builds each instance from a random expression, which becomes the SFT answer.
"""

from __future__ import annotations

import ast
import operator
import random
from collections import Counter
from fractions import Fraction

from gspo.tasks.base import Example, make_splits, pick_split, register

MAX_CHARS = 100  # longer completions are rejected before parsing (bounds ast depth)
MAX_LITERAL = 10**6  # largest integer literal accepted
MAX_MAGNITUDE = 10**12  # largest |numerator| / denominator of any intermediate value
_CHARS = set("0123456789+-*/() ")
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


class ExpressionError(ValueError):
    """Text that is not a whitelisted arithmetic expression, or that cannot be evaluated."""


def parse_expression(text: str) -> ast.expr:
    """Parse `text` into an AST of integer literals and + - * / only; else ExpressionError."""
    if len(text) > MAX_CHARS:
        raise ExpressionError(f"expression longer than {MAX_CHARS} characters")
    if bad := set(text) - _CHARS:
        raise ExpressionError(f"characters not allowed: {''.join(sorted(bad))!r}")
    try:
        body = ast.parse(text, mode="eval").body
    except SyntaxError as e:
        raise ExpressionError(f"not an expression: {e.msg}") from None
    _check(body)
    return body


def _check(node: ast.AST) -> None:
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        _check(node.left)
        _check(node.right)
    elif isinstance(node, ast.Constant) and type(node.value) is int:
        if node.value > MAX_LITERAL:
            raise ExpressionError(f"literal {node.value} larger than {MAX_LITERAL}")
    else:
        raise ExpressionError(f"not allowed: {type(node).__name__}")


def literals(node: ast.expr) -> list[int]:
    """The integer literals of a parsed expression, left to right."""
    if isinstance(node, ast.Constant):
        return [node.value]
    return literals(node.left) + literals(node.right)


def evaluate(node: ast.expr) -> Fraction:
    """Exact value of a parsed expression; ExpressionError on division by zero or overflow."""
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    left, right = evaluate(node.left), evaluate(node.right)
    if isinstance(node.op, ast.Div) and right == 0:
        raise ExpressionError("division by zero")
    value = _BINOPS[type(node.op)](left, right)
    if abs(value.numerator) > MAX_MAGNITUDE or value.denominator > MAX_MAGNITUDE:
        raise ExpressionError(f"intermediate value beyond {MAX_MAGNITUDE}")
    return value


# ---------------------------------------------------------------------------------------------
# generator: a random expression tree over the numbers; nodes are (value, text, precedence)

_ATOM, _MUL, _ADD = 3, 2, 1  # precedence levels


def _wrap(text: str, paren: bool) -> str:
    return f"({text})" if paren else text


def _combine(left: tuple, right: tuple, op: str) -> tuple | None:
    """Join two nodes with `op`, keeping intermediates non-negative integers; minimal parens."""
    (a, ta, pa), (b, tb, pb) = left, right
    if op == "+":
        return a + b, f"{ta}+{tb}", _ADD
    if op == "-":
        return None if a < b else (a - b, f"{ta}-{_wrap(tb, pb == _ADD)}", _ADD)
    if op == "*":
        return a * b, f"{_wrap(ta, pa == _ADD)}*{_wrap(tb, pb == _ADD)}", _MUL
    if b == 0 or a % b:  # "/": exact integer division only
        return None
    return a // b, f"{_wrap(ta, pa == _ADD)}/{_wrap(tb, pb != _ATOM)}", _MUL


def _random_expr(rng: random.Random, nums: list[int]) -> tuple | None:
    if len(nums) == 1:
        return nums[0], str(nums[0]), _ATOM
    k = rng.randint(1, len(nums) - 1)
    left, right = _random_expr(rng, nums[:k]), _random_expr(rng, nums[k:])
    if left is None or right is None:
        return None
    for op in rng.sample("+-*/", 4):
        if (node := _combine(left, right, op)) is not None:
            return node
    return None


@register("countdown")
class Countdown:
    """`sorted numbers>target:` → an expression over the numbers equal to the target."""

    name = "countdown"

    def __init__(
        self,
        seed: int = 0,
        n_train: int = 5000,
        n_test: int = 200,
        n_val: int = 0,
        min_numbers: int = 3,
        max_numbers: int = 4,
        max_number: int = 20,
        max_target: int = 100,
        use_all: bool = True,
        format_reward: float = 0.1,
    ):
        """
        seed: generator seed; the same seed gives the same splits.
        n_train, n_test, n_val: examples per split (disjoint by prompt; validation is for
            choosing hyper-parameters, e.g. the `gspo compare` grid, never test).
        min_numbers, max_numbers: how many numbers are given (TinyZero: 3-4).
        max_number: given numbers are drawn from 1..max_number (TinyZero: 1..99).
        max_target: targets lie in 1..max_target.
        use_all: each number exactly once (TinyZero) if True, at most once if False.
        format_reward: reward of a valid expression with the wrong value (TinyZero: 0.1).
        """
        if not 2 <= min_numbers <= max_numbers:
            raise ValueError(f"countdown: need 2 <= min_numbers <= max_numbers, got {min_numbers}, {max_numbers}")
        if max_number < 1 or max_target < 1:
            raise ValueError(f"countdown: max_number and max_target must be >= 1, got {max_number}, {max_target}")
        self.min_numbers, self.max_numbers = min_numbers, max_numbers
        self.max_number, self.max_target = max_number, max_target
        self.use_all, self.format_reward = use_all, format_reward
        self._splits = make_splits(self.name, random.Random(seed), self._sample, n_train, n_test, n_val)

    def _sample(self, rng: random.Random) -> Example:
        while True:
            k = rng.randint(self.min_numbers, self.max_numbers)
            nums = sorted(rng.randint(1, self.max_number) for _ in range(k))
            for _ in range(20):
                node = _random_expr(rng, rng.sample(nums, k))
                if node is not None and 1 <= node[0] <= self.max_target:
                    target, text, _ = node
                    prompt = " ".join(map(str, nums)) + f">{target}:"
                    return Example(prompt=prompt, answer=text, data={"numbers": nums, "target": target})

    def split(self, name: str) -> list[Example]:
        return pick_split(self.name, self._splits, name)

    def reward(self, completion: str, example: Example) -> float:
        try:
            node = parse_expression(completion.strip())
        except ExpressionError:
            return 0.0
        used, given = Counter(literals(node)), Counter(example.data["numbers"])
        if not (used == given if self.use_all else used <= given):
            return 0.0
        try:
            value = evaluate(node)
        except ExpressionError:
            return self.format_reward
        return 1.0 if value == example.data["target"] else self.format_reward

    def is_correct(self, completion: str, example: Example) -> bool:
        return self.reward(completion, example) == 1.0
