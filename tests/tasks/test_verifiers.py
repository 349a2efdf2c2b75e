"""Math answers by value (math-verify) and the <think> layout: a table of hand-written cases,
equal and unequal values in each notation, scored through the `math` reward source."""

import json
from pathlib import Path

import pytest

from gspo.rewards.sources import build_rewards
from gspo.tasks import Example
from gspo.tasks.verifiers import final_answer, math_equal, think_format

DATA = Path(__file__).parents[1] / "data" / "gsm8k_style.jsonl"

# (completion, reference answer, equal by value?)
MATH_CASES = [
    (r"\boxed{1/2}", "0.5", True),
    (r"\boxed{\frac{1}{2}}", "1/2", True),
    ("0.5", "#### 1/2", True),
    ("1/2", r"\boxed{0.5}", True),
    ("The answer is 0.50", "Half of it.\n#### 0.5", True),
    ("So she has 24 - 5 = 19 rolls.\n#### 19", "#### 19", True),
    ("#### 3/2", "1.5", True),
    ("-5", "#### -5", True),
    ("#### 1,000", "1000", True),
    ("<think>2.5 * 6 = 15</think> 15", "#### 15", True),
    (r"\boxed{1/3}", "0.5", False),
    ("0.6", "#### 1/2", False),
    ("2/1", r"\boxed{1/2}", False),
    (r"\boxed{0.5}", "#### 5", False),
    ("5", "#### -5", False),
    ("#### 18", "She has 24 - 5 = 19 rolls.\n#### 19", False),
    ("<think>the answer is 15</think> 16", "15", False),
    ("no number here", "#### 7", False),
    ("", "#### 7", False),
]


@pytest.mark.parametrize("completion, answer, equal", MATH_CASES)
def test_math_equal_table(completion, answer, equal):
    assert math_equal(completion, answer) is equal


def test_math_reward_source_scores_the_table():
    reward = build_rewards([{"type": "math"}])
    completions = [c for c, _, _ in MATH_CASES]
    examples = [Example(prompt="q", answer=a) for _, a, _ in MATH_CASES]
    result = reward(completions, examples)
    assert result.per_source["math"].tolist() == [float(e) for _, _, e in MATH_CASES]


def test_math_runs_in_a_worker_thread():
    """The reward layer calls rewards in threads; math-verify's signal timeouts would fail there."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(math_equal, r"\boxed{1/2}", "#### 0.5").result() is True


def test_final_answer_keeps_what_follows_think_and_the_last_marker():
    assert final_answer("<think>3 #### 4</think> x #### 5") == "5"
    assert final_answer("a\n#### 2\n#### 3") == "3"
    assert final_answer(" 7 ") == "7"


def test_shipped_gsm8k_style_file_verifies_against_itself():
    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    assert len(rows) == 12
    for row in rows:  # the full solution matches its own final line, not the first number in it
        last = row["solution"].rsplit("####", 1)[1].strip()
        assert math_equal(row["solution"], last), row
        assert math_equal(last, row["solution"]), row
    assert math_equal("#### 1.5", rows[3]["solution"])       # 3/2
    assert not math_equal("#### 0.5", rows[3]["solution"])   # an intermediate value


@pytest.mark.parametrize("completion, score", [
    ("<think>6 / 4 = 1.5</think> 1.5", 1.0),
    ("<think>\nsteps\n</think>\n#### 15", 1.0),
    ("  <think>x</think>y", 1.0),
    ("1.5", 0.0),
    ("<think>6 / 4 = 1.5</think>", 0.0),                    # no answer after the reasoning
    ("<think></think> 1.5", 0.0),                             # no reasoning
    ("so <think>x</think> 1.5", 0.0),                         # text before the think block
    ("<think>a</think> b <think>c</think> d", 0.0),           # two think blocks
    ("<think>a <think>b</think> c", 0.0),
    ("<think>unclosed 1.5", 0.0),
])
def test_think_format(completion, score):
    assert think_format(completion) == score
    assert build_rewards([{"type": "think_format"}])([completion], [Example("q", "a")]).total.item() == score
