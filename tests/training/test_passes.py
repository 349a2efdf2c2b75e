"""Packed rows in the trainer's log-prob passes (train.pack_rows): π_old, the update with
gradient and the audit's π_new run on the rows packed without padding; the gradients handed to
the optimizer, the loss and stats equal the padded (trimmed, prompt-shared) update's within 1e-5
in float32, for a dense model, an MoE with π_old's experts replayed, and multi-turn rows whose
loss mask has holes; and perf/padding_frac counts the positions the forwards computed."""

import pytest
import torch

from conftest import parity_rewards
from gspo.core.advantages import group_advantages
from gspo.training.old_policy import OldLogprobs
from gspo.training.trainer import Trainer


def _trainer(make_cfg, reward_module, *overrides, run):
    t = Trainer(make_cfg("sft.enabled=false", parity_rewards(reward_module),
                         "rollout.prompts_per_step=4", "rollout.group_size=4",
                         "rollout.max_new_tokens=12", "rollout.temperature=1.5",
                         "task.name=multistep", *overrides, run=run), log=lambda m: None)
    t.setup()
    return t


def _update(t: Trainer, batch, adv) -> tuple[dict, list, torch.Tensor]:
    """The update's metrics, the gradients the optimizer was handed per minibatch (its step
    replaced by a copy of them: the weights stay put), and π_old of the plan's rows."""
    seen = []
    t.step.optimizer.step = lambda *a, **k: seen.append([p.grad.clone()
                                                         for p in t.model.parameters()])
    plan = t.step.plan(batch, adv, 0)
    old = t.step.old_logprobs(batch, rows=plan.old_rows)
    return t.step.update(batch, OldLogprobs(old, adv), plan)[0], seen, old


def _ragged(batch, holes: bool) -> None:
    """Responses of 1..T tokens; ``holes``: tokens 2..3 of every longer response are tool
    output (attended, out of the response mask), as a multi-turn row's observations."""
    T = batch.response_mask.shape[1]
    L = batch.attention_mask.shape[1]
    for i, n in enumerate((torch.arange(len(batch.response_mask)) * 5 % T + 1).tolist()):
        batch.response_mask[i, n:] = 0
        batch.attention_mask[i, L - T + n:] = 0
        batch.attention_mask[i, L - T:L - T + n] = 1
        if holes and n > 5:
            batch.response_mask[i, 2:4] = 0


@pytest.mark.filterwarnings("ignore::UserWarning")   # the scheduler, on the stand-in step
@pytest.mark.parametrize("model, holes", [
    (["model.preset=tiny-dense"], False),
    (["model.preset=tiny-moe", "moe.routing_replay=old"], False),
    (["model.preset=tiny-dense"], True)],
    ids=["dense", "moe-replay", "multiturn"])
def test_packed_update_gives_the_padded_gradient_and_loss(make_cfg, reward_module, model, holes):
    """M = 2, one group without signal (its rows skip the forward), packed rows of at most 40
    tokens (several per forward, with padding tails): π_old, the gradients before each optimizer
    step, the loss, clip, ratio and entropy stats equal the padded update's; the packed update
    computes no padding beyond the tails, the padded one more."""
    padded = _trainer(make_cfg, reward_module, *model, run="padded")
    packed = _trainer(make_cfg, reward_module, *model, "train.pack_rows=true",
                      "train.pack_length=40", run="packed")
    batch, rewards, _ = padded.collector.collect(0)
    _ragged(batch, holes)
    adv = group_advantages(rewards, 4)
    adv.view(-1, 4)[0] = 0.0
    row_d, grads_d, old_d = _update(padded, batch, adv)
    batch.routing, batch.loss_mask = None, None          # π_old's experts captured afresh
    row_p, grads_p, old_p = _update(packed, batch, adv)
    torch.testing.assert_close(old_p, old_d, atol=1e-5, rtol=1e-5)
    assert len(grads_d) == len(grads_p) == 2
    for gd, gp in zip(grads_d, grads_p):
        assert max(a.abs().max() for a in gd) > 0
        for a, b in zip(gp, gd):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    for key in ("policy/loss", "policy/clip_frac_tokens", "policy/ratio_mean", "policy/entropy"):
        assert row_p[key] == pytest.approx(row_d[key], rel=1e-5, abs=1e-6), key
    print({k: (row_d[k], row_p[k]) for k in row_d if k.startswith("perf/")})
    # the padded update shares each group's prompt (needed once); packed rows each carry theirs
    assert row_p["perf/tokens_real"] >= row_d["perf/tokens_real"] > 0
    assert row_p["perf/padding_frac"] < row_d["perf/padding_frac"]


def test_pack_rows_refused_with_the_router_loss(make_cfg):
    from gspo.config.resolve import resolve  # noqa: F401  (the config refuses it in one line)
    with pytest.raises(Exception, match="pack_rows does not work with moe.aux_loss_coef"):
        make_cfg("model.preset=tiny-moe", "moe.aux_loss_coef=0.01", "train.pack_rows=true")
