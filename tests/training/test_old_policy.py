"""gspo.training.old_policy: π_old as a strategy. Which strategy a batch gets (by its version
and the config), what each hands the step, and the loss mask set once after the correction."""

import math
import types

import pytest
import torch

from gspo.config import load_config
from gspo.core.plan import plan_update
from gspo.observe.timing import StepTimer
from gspo.rollout.generate import RolloutBatch
from gspo.training.old_policy import Context, OldPolicy, strategy_name
from gspo.training.passes import Minibatch

ASYNC = ["rollout.async=true", "rollout.max_staleness=1"]


@pytest.mark.parametrize("overrides, stale, name", [
    ([], False, "recompute"),
    (["train.old_logprobs=rollout"], False, "rollout"),
    ([*ASYNC], False, "recompute"),                              # on-policy batch of an async run
    ([*ASYNC], True, "proximal"),                                # auto -> decoupled
    ([*ASYNC, "rollout.async_ratio=behaviour"], True, "behaviour"),
    ([*ASYNC, "rollout.async_ratio=behaviour", "train.old_logprobs=rollout"], True, "rollout"),
])
def test_the_strategy_of_a_batch(overrides, stale, name):
    assert strategy_name(load_config(None, overrides), stale) == name


def _batch(rollout_logp=None, version=None):
    # 2 rows, 2 response positions; row 1's response is one token (EOS at position 0)
    return RolloutBatch(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long),
                        torch.tensor([[1.0, 1.0], [1.0, 0.0]]), torch.tensor([False, False]),
                        ["a", "b"], [None, None], rollout_logp=rollout_logp, version=version)


class Passes:
    """Stands in for LogprobPasses: π_old = -0.5 on every response token, rows recorded."""
    model = None

    def __init__(self):
        self.rows = []

    def old_logprobs(self, batch, rows=None):
        self.rows.append(rows)
        return -0.5 * batch.response_mask


def _policy(*overrides):
    cfg = load_config(None, list(overrides))
    return OldPolicy(Context(cfg, Passes(), per_row=True, feed=None)), cfg


def test_pick_reads_the_batch_version():
    policy, _ = _policy(*ASYNC, "rollout.async_ratio=behaviour")
    assert type(policy.pick(_batch(version=3), 3)).__name__ == "Recompute"     # sampled now
    assert type(policy.pick(_batch(version=2), 3)).__name__ == "Behaviour"     # a step old
    assert type(policy.pick(_batch(), 3)).__name__ == "Recompute"              # no version


def test_recompute_without_sampler_logprobs_reads_the_plans_rows_and_reuses_the_first():
    policy, _ = _policy()
    batch = _batch(version=0)
    strategy = policy.pick(batch, 0)
    assert strategy.reuse_first(batch)
    plan = plan_update([torch.tensor([0]), torch.tensor([1])], None, reuse_first=True)
    old = strategy(batch, torch.tensor([1.0, -1.0]), plan, StepTimer(torch.device("cpu")), 0)
    assert policy.ctx.passes.rows[0].tolist() == [1]          # minibatch 2's rows only
    assert old.metrics == {} and torch.equal(batch.loss_mask, batch.response_mask)
    assert old.advantages.tolist() == [1.0, -1.0]


def test_recompute_with_sampler_logprobs_corrects_and_sets_the_loss_mask_once():
    """icepop keeps token t iff 0.5 ≤ ρ_t = π_old/π_rollout ≤ 2: π_old = e^-0.5 per token,
    π_rollout = e^-0.5 (ρ = 1, kept) and e^-2 (ρ = e^1.5 ≈ 4.5, masked) on row 0; row 1 kept."""
    policy, _ = _policy("train.rollout_correction.mode=icepop")
    rollout = torch.tensor([[-0.5, -2.0], [-0.5, 0.0]])
    batch = _batch(rollout_logp=rollout, version=0)
    strategy = policy.pick(batch, 0)
    assert not strategy.reuse_first(batch)                     # π_old needed before the update
    plan = plan_update([torch.tensor([0, 1])], None, reuse_first=False)
    old = strategy(batch, torch.tensor([1.0, 2.0]), plan, StepTimer(torch.device("cpu")), 0)
    assert policy.ctx.passes.rows[0].tolist() == [0, 1]       # every row: mismatch reads them all
    assert batch.loss_mask.tolist() == [[1.0, 0.0], [1.0, 0.0]]
    assert batch.response_mask.tolist() == [[1.0, 1.0], [1.0, 0.0]]   # as generated
    assert old.metrics["mismatch/masked_frac"] == pytest.approx(1 / 3)
    assert old.advantages.tolist() == [1.0, 2.0]               # icepop weighs nothing
    assert math.isfinite(old.metrics["mismatch/kl"])


def test_behaviour_hands_over_the_workers_logprobs():
    policy, _ = _policy(*ASYNC, "rollout.async_ratio=behaviour")
    batch = _batch(version=0)
    batch.behaviour_logp = torch.full((2, 2), -1.25)
    strategy = policy.pick(batch, 1)
    plan = plan_update([torch.tensor([0, 1])], None, reuse_first=False)
    old = strategy(batch, torch.ones(2), plan, StepTimer(torch.device("cpu")), 1)
    assert old.logp is batch.behaviour_logp and policy.ctx.passes.rows == []   # no pass here
    batch.behaviour_logp = None
    with pytest.raises(RuntimeError, match="without the behaviour policy's log-probs"):
        strategy(batch, torch.ones(2), plan, StepTimer(torch.device("cpu")), 1)


def test_proximal_waits_for_the_worker_after_minibatch_one():
    """Minibatch 1's forward is its π_prox (written in); minibatch 2 waits for the worker's."""
    cfg = load_config(None, ASYNC)
    fetched = []
    got = types.SimpleNamespace(rows=torch.tensor([1]), logp=torch.tensor([[-0.25, 0.0]]),
                                seconds={})
    feed = types.SimpleNamespace(proximal=lambda step: lambda: fetched.append(step) or got)
    policy = OldPolicy(Context(cfg, Passes(), per_row=True, feed=feed))
    batch = _batch(rollout_logp=torch.tensor([[-0.5, -0.5], [-0.25, 0.0]]), version=0)
    strategy = policy.pick(batch, 1)
    assert strategy.reuse_first(batch)
    plan = plan_update([torch.tensor([0]), torch.tensor([1])], None, reuse_first=True)
    old = strategy(batch, torch.tensor([1.0, -1.0]), plan, StepTimer(torch.device("cpu")), 1)
    first = Minibatch(torch.tensor([0]), torch.tensor([0]), torch.tensor([0]), batch.loss_mask, True)
    pi = old.minibatch(first, torch.tensor([[-0.5, -0.75]]), reused=True)
    assert fetched == [] and pi.logp.tolist() == [[-0.5, -0.75]]      # its own forward
    assert old.logp[1].abs().sum() == 0
    second = Minibatch(torch.tensor([1]), torch.tensor([0]), torch.tensor([1]), batch.loss_mask, True)
    pi = old.minibatch(second, torch.tensor([[-9.0, -9.0]]), reused=False)
    assert fetched == [1] and pi.logp.tolist() == [[-0.25, 0.0]]      # the worker's, not π_θ's
    assert pi.advantages.tolist() == [-1.0]                          # ρ = 1: weight 1


def test_known_old_logprobs_are_handed_over_unchanged():
    """recompute: the minibatch's π_old, advantages and mask are the batch's rows, whatever the
    forward computed (no reuse), and asking twice changes nothing."""
    policy, _ = _policy()
    batch = _batch(version=0)
    plan = plan_update([torch.tensor([1, 0])], None, reuse_first=False)
    old = policy.pick(batch, 0)(batch, torch.tensor([1.0, -1.0]), plan,
                                StepTimer(torch.device("cpu")), 0)
    mb = Minibatch(torch.tensor([1, 0]), torch.tensor([0, 1]), torch.tensor([1, 0]),
                   batch.loss_mask, True)
    for _ in range(2):
        pi = old.minibatch(mb, torch.full((2, 2), -3.0), reused=False)
        assert pi.logp.tolist() == [[-0.5, 0.0], [-0.5, -0.5]]
        assert pi.advantages.tolist() == [-1.0, 1.0]
        assert pi.mask.tolist() == [[1.0, 0.0], [1.0, 1.0]]


def test_proximal_corrects_the_loss_mask_not_the_response_mask():
    """icepop under the decoupled ratio: row 1's token has ρ = π_prox/π_v = e^-0.25/e^-2 = e^1.75
    > 2, so it leaves the loss mask when minibatch 2 is corrected; what was generated (the
    response mask: attention and length) stays as it was."""
    cfg = load_config(None, [*ASYNC, "train.rollout_correction.mode=icepop"])
    got = types.SimpleNamespace(rows=torch.tensor([1]), logp=torch.tensor([[-0.25, 0.0]]),
                                seconds={})
    feed = types.SimpleNamespace(proximal=lambda step: lambda: got)
    policy = OldPolicy(Context(cfg, Passes(), per_row=False, feed=feed))
    batch = _batch(rollout_logp=torch.tensor([[-0.5, -0.5], [-2.0, 0.0]]), version=0)
    plan = plan_update([torch.tensor([0]), torch.tensor([1])], None, reuse_first=True)
    old = policy.pick(batch, 1)(batch, torch.tensor([1.0, -1.0]), plan,
                                StepTimer(torch.device("cpu")), 1)
    mb = Minibatch(torch.tensor([1]), torch.tensor([0]), torch.tensor([1]), batch.loss_mask, True)
    pi = old.minibatch(mb, torch.zeros(1, 2), reused=False)
    assert pi.mask.tolist() == [[0.0, 0.0]]
    assert batch.loss_mask.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    assert batch.response_mask.tolist() == [[1.0, 1.0], [1.0, 0.0]]
