"""Answer checks shared by tasks and reward sources: math answers by value, the think layout.

``math_equal(completion, answer)`` compares the final answers of two texts by value with
Hugging Face's ``math-verify`` (``parse`` then ``verify``), so ``\\boxed{1/2}``, ``0.5``, ``1/2``,
``\\frac{1}{2}`` and GSM8K's ``#### 0.5`` are one answer. Before parsing, the text after a
``</think>`` is kept (the reasoning is not the answer) and, when a ``####`` marker is present,
only what follows the last one (GSM8K's final-answer line; the worked steps before it hold other
numbers). ``think_format(completion)`` is 1 when a completion is laid out as
``<think>reasoning</think> answer``.

math-verify's own timeouts use ``signal.alarm``, which works only in the main thread; the reward
layer runs calls in worker threads with its own timeout (``gspo.rewards.isolation``), so they are off here.
math-verify is an optional dependency (``pip install 'gspo[data]'``).
"""

from __future__ import annotations

import logging
import re

from gspo.optional import require

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
GSM8K_MARKER = "####"
# <think>, some reasoning, </think>, then a non-empty answer; nothing before <think>
THINK_LAYOUT = re.compile(r"\s*<think>(?P<reasoning>.+?)</think>(?P<answer>.*\S.*)", re.DOTALL)


class _NoTimeoutNotice(logging.Filter):
    """math-verify logs a notice on every call made without its signal timeout; we time calls
    ourselves, so the notice is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_NoTimeoutNotice())


def math_verify():
    """The math_verify module (imported on first use); UserError when it is not installed."""
    return require("math_verify", "math answers (the math reward, the dataset task's verifier)")


def final_answer(text: str) -> str:
    """The part of ``text`` that holds its final answer: after ``</think>``, after the last ``####``."""
    if THINK_CLOSE in text:
        text = text.rsplit(THINK_CLOSE, 1)[1]
    if GSM8K_MARKER in text:
        text = text.rsplit(GSM8K_MARKER, 1)[1]
    return text.strip()


def parse_answer(text: str) -> list:
    """math-verify's parse of ``text``'s final answer ([] when it holds none)."""
    return math_verify().parse(final_answer(text), parsing_timeout=None)


def math_equal(completion: str, answer: str) -> bool:
    """The completion's final answer equals the reference answer's by value."""
    gold, pred = parse_answer(answer), parse_answer(completion)
    if not gold or not pred:
        return False
    return bool(math_verify().verify(gold, pred, timeout_seconds=None))


def think_format(completion: str) -> float:
    """1.0 for ``<think>reasoning</think> answer`` (one think block, first, then an answer), else 0."""
    match = THINK_LAYOUT.fullmatch(completion)
    if match is None or THINK_OPEN in match["reasoning"] or THINK_OPEN in match["answer"] \
            or THINK_CLOSE in match["answer"]:
        return 0.0
    return 1.0
