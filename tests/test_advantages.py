"""Tests for gspo.advantages: group-relative advantages (GSPO Eq. 6), by hand and against a loop."""

import statistics

import pytest
import torch

from gspo import advantages
from gspo.advantages import group_advantages


def test_hand_example_group_scale():
    # group [1, 0, 0, 0]: mean 0.25, deviations (0.75, −0.25, −0.25, −0.25),
    #   Bessel variance (0.5625 + 3·0.0625)/3 = 0.25, std 0.5 → Â = (1.5, −0.5, −0.5, −0.5)
    # group [2, 2, 2, 2]: zero variance → exactly 0
    r = torch.tensor([1.0, 0, 0, 0, 2, 2, 2, 2])
    adv = group_advantages(r, 4, eps=0.0)
    assert adv.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0])
    # with the default eps = 1e-6 the division is by 0.500001
    assert group_advantages(r, 4)[0].item() == pytest.approx(0.75 / 0.500001)


def test_batch_and_none_scales():
    # rewards [1,0,0,0 | 0,0,0,1]: centred per group (0.75, −.25, −.25, −.25 | −.25, −.25, −.25, 0.75)
    # batch std: mean 0.25, Σ(x − 0.25)² = 2·0.5625 + 6·0.0625 = 1.5, /7 → std = sqrt(1.5/7)
    r = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 1])
    centred = [0.75, -0.25, -0.25, -0.25, -0.25, -0.25, -0.25, 0.75]
    batch_std = (1.5 / 7) ** 0.5
    got = group_advantages(r, 4, scale="batch", eps=0.0)
    assert got.tolist() == pytest.approx([c / batch_std for c in centred])
    assert group_advantages(r, 4, scale="none").tolist() == pytest.approx(centred)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_zero_variance_group_is_exactly_zero(scale):
    # in float64 mean(0.1, 0.1, 0.1) − 0.1 = −1.4e-17: the centring alone would not give exactly 0
    r = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.25], dtype=torch.float64)
    adv = group_advantages(r, 3, scale=scale)
    assert torch.equal(adv[:3], torch.zeros(3, dtype=torch.float64))
    assert torch.all(adv[3:] != 0)
    assert torch.equal(group_advantages(torch.ones(6), 2, scale=scale), torch.zeros(6))


def test_matches_a_loop_over_groups():
    g = torch.Generator().manual_seed(0)
    r = torch.randint(0, 3, (5 * 6,), generator=g).to(torch.float64)
    adv = group_advantages(r, 6, eps=1e-6)
    for p in range(5):
        group = r[6 * p: 6 * p + 6].tolist()
        mean, std = statistics.mean(group), statistics.stdev(group)     # stdev: Bessel-corrected
        want = [0.0] * 6 if std == 0 else [(x - mean) / (std + 1e-6) for x in group]
        assert adv[6 * p: 6 * p + 6].tolist() == pytest.approx(want)


def test_integer_rewards_give_float_advantages():
    adv = group_advantages(torch.tensor([1, 0, 1, 0]), 2)
    assert adv.dtype == torch.float32
    assert adv.tolist() == pytest.approx([0.5 / (0.5 ** 0.5 + 1e-6), -0.5 / (0.5 ** 0.5 + 1e-6)] * 2)


@pytest.mark.parametrize("rewards, group_size, match", [
    (torch.zeros(2, 4), 4, "1-D"),
    (torch.zeros(7), 4, "groups of 4"),
    (torch.zeros(4), 1, "at least 2"),
])
def test_bad_shapes(rewards, group_size, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, group_size)


def test_bad_scale_and_registry():
    with pytest.raises(ValueError, match="group, batch, none"):
        group_advantages(torch.zeros(4), 2, scale="global")
    assert advantages.available() == ["group"]
    assert advantages.get("group") is group_advantages
    with pytest.raises(ValueError, match="group"):
        advantages.get("gae")
