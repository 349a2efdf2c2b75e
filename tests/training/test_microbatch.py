"""Token-budget micro-batches (train.max_tokens_per_microbatch): rows grouped by length into
forwards of at most the budget's tokens, each loss carrying the minibatch's global normalisers, so
that the summed gradient before the optimizer step is the one-forward gradient (float64 weights,
float32 log-softmax: equal to its rounding, 1e-6 of the largest entry), with the same loss and
stats; and the padding share of the positions the
trainer's forwards compute (perf/padding_frac), which the grouping lowers (not under MoE routing
replay, whose forwards keep every column of the batch)."""

import pytest
import torch

from conftest import parity_rewards
from gspo.core.advantages import group_advantages
from gspo.core.plan import forward_tokens, token_microbatches
from gspo.training.old_policy import OldLogprobs
from gspo.training.trainer import Trainer


def test_rows_grouped_by_length_within_the_budget():
    prompt = torch.tensor([4, 4, 4, 4, 4, 4])
    response = torch.tensor([2, 20, 3, 18, 1, 30])             # totals 6 24 7 22 5 34
    parts = token_microbatches(prompt, response, budget=50)
    assert sorted(torch.cat(parts).tolist()) == list(range(6))  # a partition
    # longest first: [5] alone (2 x 34 > 50), [1, 3]: 2 x 24 = 48, [2, 0, 4]: 3 x 7 = 21 tokens
    assert [p.tolist() for p in parts] == [[5], [1, 3], [2, 0, 4]]
    assert all(forward_tokens(prompt[p], response[p]) <= 50 for p in parts[1:])
    assert token_microbatches(prompt, response, budget=1) == [torch.tensor([i]) for i in
                                                               [5, 1, 3, 2, 0, 4]]


def test_a_forward_computes_rows_times_the_longest():
    prompt, response = torch.tensor([3, 1]), torch.tensor([1, 5])
    # one forward: 2 rows x (3 + 5) = 16 tokens; alone: 4 + 6 = 10, no padding
    assert forward_tokens(prompt, response) == 16
    assert forward_tokens(prompt[:1], response[:1]) + forward_tokens(prompt[1:], response[1:]) == 10
    assert forward_tokens(prompt[:0], response[:0]) == 0


def _trainer(make_cfg, reward_module, *overrides, run, double):
    t = Trainer(make_cfg("sft.enabled=false", parity_rewards(reward_module),
                         "rollout.prompts_per_step=4", "rollout.group_size=4",
                         "rollout.max_new_tokens=12", "rollout.temperature=1.5",
                         "task.name=multistep", "train.pack_rows=false",   # padded rows' budget
                         *overrides, run=run), log=lambda m: None)
    t.setup()
    if double:
        t.model.double()                                   # float64 weights: rounding far below
    return t


def _grads_before_each_step(t: Trainer, batch, adv) -> tuple[dict, list]:
    """The update's metrics and, per minibatch, the gradients the optimizer was handed (its step
    replaced by a copy of them: the weights stay put, both paths see the same ones)."""
    seen = []
    t.step.optimizer.step = lambda *a, **k: seen.append([p.grad.clone()
                                                         for p in t.model.parameters()])
    plan = t.step.plan(batch, adv, 0)
    old = t.step.old_logprobs(batch, rows=plan.old_rows)
    return t.step.update(batch, OldLogprobs(old, adv), plan)[0], seen


@pytest.mark.filterwarnings("ignore::UserWarning")   # the scheduler, on the stand-in step
@pytest.mark.parametrize("model, double, tol", [
    (["model.preset=tiny-dense"], True, 1e-6),
    # grouped expert matmuls take no float64: float32 weights, float32 rounding of other shapes
    (["model.preset=tiny-moe", "moe.routing_replay=old"], False, 1e-4)])
def test_token_budget_gives_the_row_split_gradient_and_loss(make_cfg, reward_module, model,
                                                           double, tol):
    """M = 2, one group without signal (its rows skip the forward): a 40-token budget splits each
    minibatch into several forwards; the gradients before each optimizer step, the loss, the
    clip and ratio stats equal the one-forward update's; less padding is computed. MoE: with
    π_old's experts replayed, row by row."""
    whole = _trainer(make_cfg, reward_module, *model, run="whole", double=double)
    micro = _trainer(make_cfg, reward_module, *model, "train.max_tokens_per_microbatch=40",
                     run="micro", double=double)
    batch, rewards, _ = whole.collector.collect(0)
    T = batch.response_mask.shape[1]
    for i, n in enumerate((torch.arange(len(rewards)) * 5 % T + 1).tolist()):   # ragged: 1..T
        batch.response_mask[i, n:] = 0
        batch.attention_mask[i, batch.attention_mask.shape[1] - T + n:] = 0
    adv = group_advantages(rewards, 4)
    adv.view(-1, 4)[0] = 0.0
    calls, real = [], micro.step.passes.minibatch
    micro.step.passes.minibatch = lambda *a, **k: calls.append(1) or real(*a, **k)
    row_w, grads_w = _grads_before_each_step(whole, batch, adv)
    row_m, grads_m = _grads_before_each_step(micro, batch, adv)
    assert len(calls) > 2                                          # more forwards than minibatches
    assert len(grads_w) == len(grads_m) == 2
    for gw, gm in zip(grads_w, grads_m):   # the head's log-softmax is float32 (core.logprobs):
        largest = max(a.abs().max() for a in gw)                 # float32 rounding of log-probs
        assert largest > 0 and max((a - b).abs().max() for a, b in zip(gw, gm)) < tol * largest
    for key in ("policy/loss", "policy/clip_frac_tokens", "policy/ratio_mean", "policy/entropy"):
        assert row_m[key] == pytest.approx(row_w[key], rel=tol, abs=1e-9 if double else 1e-6), key
    if "moe.routing_replay=old" in model:   # replay: every forward runs all L columns (untrimmed)
        assert row_m["perf/padding_frac"] == row_w["perf/padding_frac"]
    else:
        assert row_m["perf/padding_frac"] < row_w["perf/padding_frac"]
