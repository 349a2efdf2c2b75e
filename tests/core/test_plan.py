"""The update plan (gspo.core.plan) and what the trainer saves with it: the on-policy first minibatch
reuses its own log-probs as π_old, rows without signal skip their forward/backward, and both give
the update of the plain path (every row, a separate π_old pass). Plus the time breakdown."""

import math

import pytest
import torch

from conftest import UPDATE_REL, update_mismatch
from gspo.models import moe
from gspo.core import objectives
from gspo.core.advantages import group_advantages
from gspo.core.plan import live_rows, plan_update
from gspo.observe.report import build_report
from gspo.observe.timing import PARTS, StepTimer, breakdown
from gspo.training.trainer import Trainer
from gspo.training.old_policy import OldLogprobs


def _parity(reward_module: str) -> str:
    return f"rewards.sources=[{{type: function, fn: '{reward_module}'}}]"


# ----------------------------------------------------------------------------- pure planning

def test_live_rows_need_an_advantage_and_a_loss_token():
    adv = torch.tensor([1.0, 0.0, -2.0, 0.5])
    mask = torch.tensor([[1, 1], [1, 0], [1, 0], [0, 0]]).float()
    assert live_rows(adv, mask).tolist() == [True, False, True, False]
    per_token = torch.tensor([[0.0, 1.0], [0.0, 0.0], [2.0, 0.0], [1.0, 1.0]])   # [N, T]
    assert live_rows(per_token, mask).tolist() == [True, False, True, False]


def test_plain_plan_is_every_row_and_a_full_old_pass():
    mbs = [torch.tensor([3, 0]), torch.tensor([1, 2])]
    plan = plan_update(mbs, None, reuse_first=False)
    assert plan.old_rows is None and not plan.reuse_first and plan.skipped == 0
    assert [p.tolist() for p in plan.trained] == [[0, 1], [0, 1]]


def test_reuse_leaves_the_first_minibatch_out_of_the_old_pass():
    mbs = [torch.tensor([3, 0]), torch.tensor([1, 2]), torch.tensor([5, 4])]
    assert plan_update(mbs, None, reuse_first=True).old_rows.tolist() == [1, 2, 4, 5]
    assert plan_update(mbs[:1], None, reuse_first=True).old_rows.tolist() == []   # M = 1: no pass


def test_rows_without_signal_are_skipped_everywhere():
    mbs = [torch.tensor([3, 0]), torch.tensor([1, 2]), torch.tensor([5, 4])]
    live = torch.tensor([True, False, True, True, False, False])
    plan = plan_update(mbs, live, reuse_first=True)
    assert [p.tolist() for p in plan.trained] == [[0, 1], [1], []]   # positions inside each minibatch
    assert plan.old_rows.tolist() == [2] and plan.skipped == 3


@pytest.mark.parametrize("name", objectives.available())
def test_every_objective_is_zero_at_zero_advantage(name):
    """What skipping rows without signal relies on: loss and gradient exactly 0 where Â = 0."""
    torch.manual_seed(0)
    logp = torch.randn(3, 5, requires_grad=True)
    old = logp.detach() + 0.3 * torch.randn(3, 5)                 # far off-policy, clipped or not
    mask = torch.ones(3, 5)
    loss, _ = objectives.get(name)(logp, old, torch.zeros(3), mask)
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(logp.grad) == 0


# ----------------------------------------------------------------------------- in the trainer

@pytest.fixture
def pair(make_cfg, reward_module, linear_updates):
    """Two identical untrained trainers (parity reward, M = 2), set up, and their first batch.
    Their optimizer is SGD with momentum (conftest.linear_optimizer), lr 0.1: the two paths round
    the gradients differently, and only an update linear in the gradient keeps that difference
    rounding-sized in the weights, on any CPU."""
    def build(*overrides):
        made = []
        for run in ("a", "b"):
            t = Trainer(make_cfg("sft.enabled=false", _parity(reward_module), "train.lr=0.1",
                                 *overrides, run=run), log=lambda m: None)
            t.setup()
            made.append(t)
        return made
    return build


def _update(t: Trainer, batch, adv, step: int, speed_paths: bool) -> tuple[dict, torch.Tensor]:
    plan = t.step.plan(batch, adv, step, speed_paths=speed_paths)
    old = t.step.old_logprobs(batch, rows=plan.old_rows)
    return t.step.update(batch, OldLogprobs(old, adv), plan)[0], old


def _weights(t: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in t.model.named_parameters()}


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_optimized_update_equals_the_plain_one(pair, preset, pack):
    """Half the groups without signal, M = 2: same loss, gradient norm and weights as the plain
    path (every row, one untrimmed padded forward per pass); π_old equal where both computed it;
    the skipped rows are counted; MoE: the same routing metrics from the split forwards' layout
    (padded: trimmed and prompt-shared; packed: each group's prompt packed once)."""
    fast, plain = pair(f"model.preset={preset}", "rollout.prompts_per_step=4", "rollout.group_size=4")
    fast.step.passes.pack = pack
    plain.step.passes.split_forwards = False                  # no trimming, no shared prompts
    plain.step.passes.pack = False                            # padded rows
    batch, rewards, _ = fast.collector.collect(0)
    batch_b, _, _ = plain.collector.collect(0)
    assert torch.equal(batch.input_ids, batch_b.input_ids)
    start = _weights(fast)
    adv = group_advantages(rewards, 4)
    adv.view(-1, 4)[::2] = 0.0                                            # groups 0, 2: no signal
    row_f, old_f = _update(fast, batch, adv, 0, speed_paths=True)
    row_p, old_p = _update(plain, batch_b, adv, 0, speed_paths=False)
    live = adv != 0
    assert row_f["train/rows_skipped"] == (~live).sum().item() and row_p["train/rows_skipped"] == 0
    assert torch.allclose(old_f[live], old_p[live], rtol=0, atol=1e-5)
    for key in ("policy/loss", "optim/grad_norm"):
        assert row_f[key] == pytest.approx(row_p[key], rel=1e-4, abs=1e-7)
    if preset == "tiny-moe":   # π_old's experts at every scored position of the live rows
        T, mask = batch.response_mask.shape[1], batch.response_mask[live].bool()
        old_experts = [moe.response_routing(b.routing, T)[live][mask] for b in (batch, batch_b)]
        assert torch.equal(*old_experts)
    # rows computed in other batch shapes (and prompts run once per group) round differently
    # (~1e-7 of the gradient); SGD carries that into the weights as such
    assert update_mismatch(start, _weights(fast), _weights(plain)) < UPDATE_REL


def test_rows_without_signal_still_get_the_optimizer_step(pair):
    """After a step with signal, a batch with none: the optimizer still moves the weights (its
    momentum; AdamW's as much as SGD's), exactly as the plain path does with its zero gradients."""
    fast, plain = pair()
    start = _weights(fast)
    for t, optimize in ((fast, True), (plain, False)):
        batch, rewards, _ = t.collector.collect(0)
        _update(t, batch, group_advantages(rewards, 4), 0, optimize)
        before = _weights(t)
        row, _ = _update(t, batch, torch.zeros_like(rewards), 1, optimize)
        assert row["optim/grad_norm"] == 0.0
        after = _weights(t)
        assert any(not torch.equal(before[k], after[k]) for k in before)  # momentum moved them
    assert update_mismatch(start, _weights(fast), _weights(plain)) < UPDATE_REL   # (rounding)


def test_one_minibatch_needs_no_old_pass_and_is_on_policy_bit_for_bit(pair, monkeypatch):
    t, _ = pair("train.minibatches=1")
    calls = []
    real = t.step.passes.logprobs
    monkeypatch.setattr(t.step.passes, "logprobs", lambda *a, **k: calls.append(k) or real(*a, **k))
    row = t.step(0)
    assert len(calls) == 1 and calls[0]["with_entropy"]                  # the training forward only
    assert row["policy/ratio_min"] == row["policy/ratio_max"] == 1.0
    assert row["policy/approx_kl"] == 0.0


def test_kl_and_entropy_bonus_train_every_row(pair):
    t, _ = pair("train.beta=0.1", "train.entropy_coef=0.01")
    batch, rewards, _ = t.collector.collect(0)
    plan = t.step.plan(batch, torch.zeros_like(rewards), 0)
    assert plan.skipped == 0                                             # their terms need every row


# ----------------------------------------------------------------------------- time breakdown

def test_timer_sums_sections_and_breakdown_fills_other():
    timer = StepTimer("cpu")
    for _ in range(2):
        with timer.section("optimizer"):
            sum(range(1000))
    seconds = timer.seconds()
    assert seconds["optimizer"] > 0
    out = breakdown({"generate": 1.0, "reward": 0.5}, 2.0)
    assert set(out) == {f"time/{p}_s" for p in PARTS} | {"time/step_s"}
    assert out["time/other_s"] == pytest.approx(0.5) and out["time/optimizer_s"] == 0.0


def test_run_logs_the_breakdown_and_reports_it(make_cfg, reward_module):
    cfg = make_cfg("sft.enabled=false", _parity(reward_module), "train.steps=3")
    Trainer(cfg, log=lambda m: None).run()
    from gspo.observe.metrics import read_metrics
    rows = [r for r in read_metrics(cfg.run.dir) if "time/step_s" in r]
    assert len(rows) == 3
    for row in rows:
        parts = sum(row[f"time/{p}_s"] for p in PARTS)
        assert parts == pytest.approx(row["time/step_s"], rel=1e-6)      # other = step - the rest
        assert row["time/forward_backward_s"] > 0 and row["time/optimizer_s"] > 0
        assert math.isfinite(row["time/other_s"]) and row["time/other_s"] >= 0
    assert rows[0]["time/logging_s"] == 0.0 and rows[1]["time/logging_s"] > 0   # previous row's write
    report = build_report(cfg.run.dir).read_text()
    assert "## Where the time goes" in report and "| forward backward |" in report


def test_run_threads_is_applied_at_setup(make_cfg, reward_module):
    before = torch.get_num_threads()
    try:
        t = Trainer(make_cfg("sft.enabled=false", _parity(reward_module), "run.threads=2"),
                    log=lambda m: None)
        t.setup()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
