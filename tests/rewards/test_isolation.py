"""Reward faults are isolated to their sample: an exception, NaN, Inf, None, a string or a hang under
each rewards.on_error policy (zero, drop, fail); the drop policy's advantages by hand; the bound on
hung threads; the guarded task used by evaluation; and the policies inside a training step."""

import math
import threading

import pytest
import torch

from gspo.core.advantages import group_advantages
from gspo.core.trajectory import dropped_rows
from gspo.cli import main
from gspo.errors import RewardError
from gspo.rewards.isolation import IsolatedReward, IsolatedTask, TimedCaller
from gspo.observe.metrics import read_metrics
from gspo.rewards.sources import CombinedReward, FunctionReward
from gspo.rollout.generate import RolloutBatch
from gspo.tasks import Example
from gspo.training.trainer import Trainer
from gspo.training.old_policy import OldLogprobs

FOREVER = threading.Event()  # never set: a hang that costs no CPU


def _faulty(kind: str):
    """A reward that returns 1.0, except on the completion 'bad' where it fails in one way."""
    def fn(completion, **row):
        if completion != "bad":
            return 1.0
        if kind == "exception":
            return 1 / 0
        if kind == "hang":
            FOREVER.wait()
        return {"nan": math.nan, "inf": -math.inf, "none": None, "string": "1.0"}[kind]
    fn.__qualname__ = f"faulty_{kind}"
    return fn


REASONS = {
    "exception": "ZeroDivisionError: division by zero",
    "nan": "non-finite value nan", "inf": "non-finite value -inf",
    "none": "returned NoneType None, expected a number",
    "string": "returned str '1.0', expected a number",
    "hang": "timed out after 0.2 s",
}
COMPLETIONS = ["ok", "bad", "ok", "ok"]
EXAMPLES = [Example(f"{i}+{i}=", str(2 * i)) for i in range(4)]


def _reward(kind: str, on_error: str, log=None) -> IsolatedReward:
    combined = CombinedReward([(FunctionReward(_faulty(kind), name="f"), 2.0)])
    return IsolatedReward(combined, on_error=on_error, timeout_s=0.2, log=log)


@pytest.mark.parametrize("kind", sorted(REASONS))
def test_zero_policy_scores_the_failed_sample_0(kind):
    logs = []
    result = _reward(kind, "zero", logs.append)(COMPLETIONS, EXAMPLES)
    assert result.total.tolist() == [2.0, 0.0, 2.0, 2.0]
    assert result.errors.tolist() == [False, True, False, False]
    assert result.per_source["f"].tolist() == [1.0, 0.0, 1.0, 1.0]
    assert len(logs) == 1 and "reward 'f' failed on sample 1 (prompt '1+1='" in logs[0]
    assert REASONS[kind] in logs[0] and "rewards.on_error=zero" in logs[0]


@pytest.mark.parametrize("kind", sorted(REASONS))
def test_drop_policy_marks_the_failed_sample_nan(kind):
    result = _reward(kind, "drop", lambda m: None)(COMPLETIONS, EXAMPLES)
    total = result.total.tolist()
    assert math.isnan(total[1]) and total[:1] + total[2:] == [2.0, 2.0, 2.0]
    assert result.errors.tolist() == [False, True, False, False]


@pytest.mark.parametrize("kind", sorted(REASONS))
def test_fail_policy_names_the_sample(kind):
    with pytest.raises(RewardError) as info:
        _reward(kind, "fail")(COMPLETIONS, EXAMPLES)
    message = str(info.value)
    assert message.startswith("reward 'f' failed on sample 1 (prompt '1+1=', completion 'bad'): ")
    assert REASONS[kind] in message and "\n" not in message


def test_failures_are_logged_a_few_times_then_only_counted():
    logs = []
    reward = _reward("exception", "zero", logs.append)
    for _ in range(8):
        assert reward(["bad"], EXAMPLES[:1]).errors.tolist() == [True]
    assert len(logs) == 5 and "only counted" in logs[-1]


def test_hung_calls_are_bounded():
    caller = TimedCaller(0.05, max_hung=2)
    for _ in range(2):
        with pytest.raises(Exception, match="timed out after 0.05 s"):
            caller(FOREVER.wait)
    assert caller(lambda: 7) == 7                          # a fresh worker took over
    with pytest.raises(RewardError, match="reward calls hung 3 times"):
        caller(FOREVER.wait)


def test_map_is_the_calls_one_after_the_other():
    """TimedCaller.map hands a batch to the worker at once: each call's value or error, in order;
    a hung call times out alone and a fresh worker takes the rest; too many hung calls stop it."""
    caller = TimedCaller(0.05, max_hung=2)
    order = []
    def fn(x):
        order.append(x)
        if x == "hang":
            FOREVER.wait()
        return 1 / x
    out = caller.map(fn, [(1,), (0,), ("hang",), (4,), ("hang",), (2,)])
    assert [v for v, _ in out] == [1.0, None, None, 0.25, None, 0.5]
    assert [type(e).__name__ for _, e in out] == ["NoneType", "ZeroDivisionError", "RewardFault",
                                                 "NoneType", "RewardFault", "NoneType"]
    assert order == [1, 0, "hang", 4, "hang", 2] and caller.hung == 2
    with pytest.raises(RewardError, match="reward calls hung 3 times"):
        caller.map(fn, [("hang",), (1,)])
    assert TimedCaller(None).map(fn, [(2,), (0,)])[0] == (0.5, None)   # no timeout: in this thread


def test_guarded_task_is_correct_all_is_is_correct_per_sample():
    class Task:
        name = "t"

        def is_correct(self, completion, example):
            return 1 / 0 if completion == "bad" else completion == "ok"
    task = IsolatedTask(Task(), on_error="zero", timeout_s=1.0)
    completions = ["ok", "bad", "no", "ok"]
    assert task.is_correct_all(completions, EXAMPLES) == [True, False, False, True]
    assert task.is_correct_all(completions, EXAMPLES) == [task.is_correct(c, ex)
                                                         for c, ex in zip(completions, EXAMPLES)]
    with pytest.raises(RewardError, match="task 't' is_correct failed .*ZeroDivisionError"):
        IsolatedTask(Task(), on_error="fail").is_correct_all(completions, EXAMPLES)


def test_batch_source_fails_as_a_batch():
    class Broken:
        name = "rm"

        def __call__(self, completions, examples):
            raise RuntimeError("CUDA out of memory")
    reward = IsolatedReward(CombinedReward([(Broken(), 1.0)]), on_error="zero", log=lambda m: None)
    assert reward(COMPLETIONS, EXAMPLES).errors.tolist() == [True] * 4


# ------------------------------------------------------------------------------- drop: advantages

def _batch(n: int, t: int = 3) -> RolloutBatch:
    return RolloutBatch(input_ids=torch.zeros(n, t, dtype=torch.long),
                        attention_mask=torch.ones(n, t, dtype=torch.long),
                        response_mask=torch.ones(n, t), truncated=torch.zeros(n, dtype=torch.bool),
                        completions=[""] * n, examples=[EXAMPLES[0]] * n)


def advantages_with_drops(batch, rewards, group_size, **options):
    """What the step does with a scored batch: mark the dropped rows, then group advantages."""
    batch.dropped = dropped_rows(rewards)
    return group_advantages(rewards, group_size, **options)


def test_advantages_with_drops_by_hand():
    nan = math.nan
    rewards = torch.tensor([1.0, 0.0, nan, 1.0,      # group 1: 3 remain
                            nan, 1.0, nan, nan,      # group 2: 1 remains -> no signal
                            0.0, 0.0, 1.0, 0.0])     # group 3: intact
    batch = _batch(12)
    adv = advantages_with_drops(batch, rewards, 4, eps=0.0)
    # group 1 over {1, 0, 1}: mean 2/3, Bessel var ((1/3)^2 * 2 + (2/3)^2) / 2 = 1/3
    s = math.sqrt(1 / 3)
    expected = [(1 / 3) / s, (-2 / 3) / s, 0.0, (1 / 3) / s, 0, 0, 0, 0]
    expected += group_advantages(rewards[8:], 4, eps=0.0).tolist()     # untouched group
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)
    assert batch.dropped.nonzero().squeeze(-1).tolist() == [2, 4, 6, 7]
    assert batch.response_mask.sum() == 36                              # as generated


def test_advantages_without_drops_are_the_plain_ones():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0])
    batch = _batch(4)
    assert torch.equal(advantages_with_drops(batch, rewards, 4), group_advantages(rewards, 4))
    assert batch.dropped is None


def test_dropped_samples_leave_the_loss_mask(make_cfg, reward_module):
    """update() drops marked rows from the loss exactly as mask_truncated drops truncated ones."""
    t = Trainer(make_cfg("sft.enabled=false", f"rewards.sources=[{{type: function, fn: '{reward_module}'}}]",
                         "train.minibatches=1"), log=lambda m: None)
    t.setup()
    batch, rewards, _ = t.collector.collect(0)
    batch.dropped = torch.ones(len(rewards), dtype=torch.bool)   # everything dropped
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    adv = group_advantages(rewards, 4)
    row, _ = t.step.update(batch, OldLogprobs(t.step.old_logprobs(batch), adv),
                           t.step.plan(batch, adv, 0, speed_paths=False))
    assert row["policy/loss"] == 0.0 and row["optim/grad_norm"] == 0.0
    assert all(torch.equal(before[n], p) for n, p in t.model.named_parameters())


# ------------------------------------------------------------------------------- guarded task

def test_guarded_task_scores_failures_0_and_incorrect():
    class Task:
        name = "t"

        def reward(self, completion, example):
            return None if completion == "bad" else 1.0

        def is_correct(self, completion, example):
            return 1 / 0 if completion == "bad" else True
    task = IsolatedTask(Task(), on_error="zero", timeout_s=1.0)
    assert (task.reward("ok", EXAMPLES[0]), task.reward("bad", EXAMPLES[0])) == (1.0, 0.0)
    assert (task.is_correct("ok", EXAMPLES[0]), task.is_correct("bad", EXAMPLES[0])) == (True, False)
    with pytest.raises(RewardError, match="task 't' is_correct failed .*ZeroDivisionError"):
        IsolatedTask(Task(), on_error="fail").is_correct("bad", EXAMPLES[0])


# ------------------------------------------------------------------------------- in training

@pytest.fixture
def flaky(tmp_path, monkeypatch):
    """'flaky:reward': parity of the first character, raising on completions that start with a
    capital letter (never a demonstration: arithmetic answers are digits)."""
    (tmp_path / "flaky.py").write_text(
        "def reward(completion, **row):\n"
        "    if completion[:1].isupper():\n"
        "        raise ValueError('capitals are not allowed')\n"
        "    return float(ord(completion[0]) % 2) if completion else 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "rewards.sources=[{type: function, fn: 'flaky:reward'}]"


def test_drop_policy_in_a_training_step(make_cfg, flaky):
    t = Trainer(make_cfg("sft.enabled=false", flaky, "rewards.on_error=drop", "train.minibatches=1",
                         "rollout.group_size=8", "rollout.prompts_per_step=4"), log=lambda m: None)
    t.setup()
    batch, rewards, stats = t.collector.collect(0)
    failed = ~torch.isfinite(rewards)
    assert 0 < stats["reward/errors"] == int(failed.sum()) < len(rewards), "this seed must mix"
    assert math.isfinite(stats["reward/mean"])
    adv = advantages_with_drops(batch, rewards, 8)
    assert torch.equal(batch.dropped, failed)
    assert torch.all(adv[failed] == 0) and torch.all(adv[~failed] != 0)
    row = t.step(1)                                                  # a whole step: finite, applied
    assert row["reward/errors"] > 0 and math.isfinite(row["reward/mean"])
    assert math.isfinite(row["policy/loss"]) and row["optim/skipped_nonfinite"] == 0


def test_default_metrics_count_zero_errors(make_cfg, reward_module):
    t = Trainer(make_cfg("sft.enabled=false", f"rewards.sources=[{{type: function, fn: '{reward_module}'}}]"),
                log=lambda m: None)
    t.setup()
    assert t.step(0)["reward/errors"] == 0


def test_fail_policy_stops_training_with_one_line(capsys, tmp_path, flaky):
    code = main(["train", flaky, "sft.enabled=false", "run.progress=false", "run.tensorboard=false",
                 "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4",
                 "train.minibatches=2", "task.n_train=50", "task.n_test=10", "eval.n=4", "eval.k=1",
                 f"run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("gspo: error: reward 'flaky.reward' failed on sample ")
    assert "ValueError: capitals are not allowed. rewards.on_error=fail" in last
    assert read_metrics(tmp_path / "run")[0]["step"] == 0          # stopped inside step 1


def test_drop_policy_through_guard_and_audit(capsys, make_cfg, flaky):
    """Dropped samples are no NaN to the stability guard, and `gspo audit` accounts for them."""
    cfg = make_cfg("sft.enabled=false", flaky, "rewards.on_error=drop", "rollout.group_size=8",
                   "audit.every=1")
    Trainer(cfg, log=lambda m: None).run()
    rows = read_metrics(cfg.run.dir)[1:]
    assert sum(r["reward/errors"] for r in rows) > 0
    assert all(r.get("guard/skipped", 0) == 0 for r in rows)
    assert main(["audit", cfg.run.dir]) == 0
    assert "audit passed: 2 step(s)" in capsys.readouterr().out
