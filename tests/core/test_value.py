"""Tests for gspo.core.value: the clipped value loss by hand, explained variance, the critic model."""

import pytest
import torch

from gspo.core.logprobs import response_logprobs
from gspo.rollout.generate import demonstration_batch
from gspo.tasks import Example
from gspo.core.value import Critic, explained_variance, value_loss


def test_value_loss_clipped_by_hand():
    # V_old = 0.5 everywhere, clip c = 0.2; the 4th position is padding (holds anything)
    # t0: V 0.9, R 1.0: (V−R)² = 0.01; V_clip = 0.5 + 0.2 = 0.7, (V_clip−R)² = 0.09 → 0.09, clipped
    # t1: V 0.2, R 0.0: (V−R)² = 0.04; V_clip = 0.5 − 0.2 = 0.3, (V_clip−R)² = 0.09 → 0.09, clipped
    # t2: V 0.6, R 0.0: (V−R)² = 0.36; V_clip = 0.6 (inside the band) → 0.36, not clipped
    # loss = ½ · (0.09 + 0.09 + 0.36) / 3 = 0.09; clip_frac = 2/3
    # gradient: t0, t1 take the clipped term, constant in V → 0; t2: ½ · 2 (0.6 − 0) / 3 = 0.2
    v = torch.tensor([[0.9, 0.2, 0.6, 7.0]], requires_grad=True)
    old, ret = torch.full((1, 4), 0.5), torch.tensor([[1.0, 0.0, 0.0, -5.0]])
    mask = torch.tensor([[1.0, 1, 1, 0]])
    loss, stats = value_loss(v, old, ret, mask, clip=0.2)
    assert loss.item() == pytest.approx(0.09)
    assert stats["clip_frac"].item() == pytest.approx(2 / 3)
    loss.backward()
    assert v.grad[0].tolist() == pytest.approx([0.0, 0.0, 0.2, 0.0])


def test_value_loss_unclipped_by_hand():
    # clip=None: ½ · (0.01 + 0.04 + 0.36) / 3 = 0.068333…; gradient (V − R) / 3 per token
    v = torch.tensor([[0.9, 0.2, 0.6]], requires_grad=True)
    loss, stats = value_loss(v, torch.full((1, 3), 0.5), torch.tensor([[1.0, 0, 0]]),
                             torch.ones(1, 3), clip=None)
    assert loss.item() == pytest.approx(0.41 / 6)
    assert stats["clip_frac"].item() == 0
    loss.backward()
    assert v.grad[0].tolist() == pytest.approx([-0.1 / 3, 0.2 / 3, 0.6 / 3])


def test_explained_variance():
    ret = torch.tensor([[1.0, 0.0, 2.0, 9.0]])
    mask = torch.tensor([[1.0, 1, 1, 0]])
    assert explained_variance(ret.clone(), ret, mask).item() == pytest.approx(1.0)   # perfect
    # a constant at the mean explains nothing: Var[R − V] = Var[R]
    assert explained_variance(torch.ones(1, 4), ret, mask).item() == pytest.approx(0.0)
    # returns without variance: 0, never NaN (a NaN metric would trip the guard)
    assert explained_variance(torch.rand(1, 4), torch.ones(1, 4), mask).item() == 0.0


def test_critic_head_is_drawn_from_its_seed(tiny):
    model, _ = tiny
    state = torch.random.get_rng_state()
    a, b, c = (Critic.from_policy(model, seed=s).head.weight for s in (0, 0, 1))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(torch.random.get_rng_state(), state)     # the global RNG is untouched


def test_critic_starts_from_the_policy_but_is_separate(tiny):
    model, tokenizer = tiny
    critic = Critic.from_policy(model)
    dec = dict(critic.decoder.named_parameters())
    for name, p in model.model.named_parameters():            # the policy's decoder, copied
        assert torch.equal(dec[name], p) and dec[name].data_ptr() != p.data_ptr()
    batch = demonstration_batch(tokenizer, [Example("12+3=", "15"), Example("1+1=", "2")], "cpu")
    values = critic(batch.input_ids, batch.attention_mask, batch.response_mask)
    assert values.shape == batch.response_mask.shape and values.dtype == torch.float32
    assert (values[batch.response_mask == 0] == 0).all()
    before = response_logprobs(model, batch.input_ids, batch.attention_mask,
                               batch.response_mask).logp
    values.sum().backward()                                    # gradient reaches the critic only
    assert critic.head.weight.grad is not None
    assert all(p.grad is None for p in model.parameters())
    with torch.no_grad():
        for p in critic.parameters():
            p.add_(1.0)
    after = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_mask).logp
    assert torch.equal(before, after)
