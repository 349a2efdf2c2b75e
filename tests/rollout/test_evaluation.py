"""pass@k against hand-computed cases; evaluate() on a tiny model with verifiers of known outcome."""

import pytest
import torch

from gspo.rollout.evaluation import EvalResult, evaluate, pass_at_k
from gspo.rollout.generate import SamplingParams, generate

# ------------------------------------------------------------------------------- pass@k


@pytest.mark.parametrize("n, c, k, expected", [
    (4, 1, 1, 0.25),   # 1 - C(3,1)/C(4,1) = 1 - 3/4
    (4, 1, 2, 0.5),    # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (5, 2, 3, 0.9),    # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (10, 3, 1, 0.3),   # pass@1 = c/n
    (4, 0, 4, 0.0),    # nothing correct
    (4, 2, 3, 1.0),    # n-c = 2 < k = 3: every draw of 3 contains a correct one
    (4, 4, 1, 1.0),
    (1, 1, 1, 1.0),
])
def test_pass_at_k_hand_cases(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_invalid(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


# ------------------------------------------------------------------------------- evaluate

class FakeTask:
    """A Task whose verdict is a given function of (completion, example); records its calls."""

    name = "fake"

    def __init__(self, verdict):
        self.verdict, self.seen = verdict, []

    def split(self, name):
        return []

    def is_correct(self, completion, example):
        self.seen.append(completion)
        return bool(self.verdict(completion, example))

    def reward(self, completion, example):
        return float(self.verdict(completion, example))


def _parity(completion, example):
    return bool(completion) and ord(completion[0]) % 2 == 0


@pytest.fixture(scope="module")
def examples(arith):
    return arith.split("test")[:6]


def _eval(tiny, task, examples, **kw):
    model, tok = tiny
    return evaluate(model, tok, task, examples, **{"max_new_tokens": 3, "k": 3, "seed": 0, **kw})


@pytest.mark.parametrize("verdict, expected", [(True, 1.0), (False, 0.0)])
def test_always_right_or_wrong(tiny, examples, verdict, expected):
    result = _eval(tiny, FakeTask(lambda c, ex: verdict), examples)
    assert isinstance(result, EvalResult)
    assert (result.accuracy, result.pass1, result.pass_k) == (expected, expected, expected)
    assert result.mean_reward == expected
    assert (result.n, result.k) == (6, 3)
    assert 1.0 <= result.mean_length <= 3.0


def test_verdict_from_the_prompt(tiny, examples):
    """Correct iff the example's target is even: every sample of a prompt gets the same verdict,
    so accuracy = pass@1 = pass@k = the share of even targets."""
    expected = sum(ex.data["target"] % 2 == 0 for ex in examples) / len(examples)
    assert 0 < expected < 1, "pick examples with both parities"
    result = _eval(tiny, FakeTask(lambda c, ex: ex.data["target"] % 2 == 0), examples)
    assert result.accuracy == pytest.approx(expected)
    assert result.pass1 == pytest.approx(expected)
    assert result.pass_k == pytest.approx(expected)


def test_verdict_from_the_completion_aggregates_consistently(tiny, examples):
    """Correct iff the completion starts with an even character. Regenerate the greedy and the
    sampled completions (same seed) and aggregate by hand."""
    model, tok = tiny
    k = 3
    task = FakeTask(_parity)
    result = _eval(tiny, task, examples, k=k)
    with torch.random.fork_rng(devices=[]):
        greedy = generate(model, tok, examples, SamplingParams(3, greedy=True))
        sampled = generate(model, tok, examples, SamplingParams(3, temperature=1.0), group_size=k,
                           seed=0)  # evaluate uses seed + batch index, one batch here
    acc = sum(_parity(c, None) for c in greedy.completions) / len(examples)
    hits = [sum(_parity(c, None) for c in sampled.completions[j * k:(j + 1) * k])
            for j in range(len(examples))]
    assert sorted(task.seen) == sorted(greedy.completions + sampled.completions)
    assert result.accuracy == pytest.approx(acc)
    assert result.pass1 == pytest.approx(sum(h / k for h in hits) / len(examples))
    # pass@k with n = k samples: 1 if any of the k is correct, else 0
    assert result.pass_k == pytest.approx(sum(h > 0 for h in hits) / len(examples))
    assert 0 < result.pass1 < result.pass_k, "this seed must give a discriminating case"
    assert result.mean_length == pytest.approx(greedy.lengths.float().mean().item())


def test_k1_pass_k_equals_pass1_and_deterministic(tiny, examples):
    a = _eval(tiny, FakeTask(_parity), examples, k=1)
    assert a.pass_k == a.pass1
    assert _eval(tiny, FakeTask(_parity), examples, k=1) == a


def test_evaluate_leaves_global_rng_and_mode_alone(tiny, examples):
    model, _ = tiny
    state = torch.random.get_rng_state()
    model.train()
    try:
        _eval(tiny, FakeTask(_parity), examples[:2], k=2)
        assert model.training
    finally:
        model.eval()
    assert torch.equal(torch.random.get_rng_state(), state)


def test_metric_names():
    r = EvalResult(accuracy=0.5, pass1=0.25, pass_k=0.75, k=4, mean_reward=0.5, mean_length=3.0, n=8)
    assert r.as_metrics() == {"eval/accuracy": 0.5, "eval/pass@1": 0.25, "eval/pass@4": 0.75,
                              "eval/reward": 0.5, "eval/length": 3.0}
    assert r.as_dict()["pass@4"] == 0.75 and r.as_dict()["n"] == 8
