"""Tests for gspo.core.advantages: group-relative advantages (GSPO Eq. 6), by hand and against a loop."""

import statistics

import pytest
import torch

from gspo.core import advantages
from gspo.core.advantages import best_worst_pairs, group_advantages, rloo_advantages


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


def test_bad_scale():
    with pytest.raises(ValueError, match="group, batch, none"):
        group_advantages(torch.zeros(4), 2, scale="global")
    assert advantages.available() == ["group", "rloo"]
    assert advantages.get("group") is group_advantages
    assert advantages.get("rloo") is rloo_advantages
    assert (advantages.default_scale("group"), advantages.default_scale("rloo")) == ("group", "none")
    with pytest.raises(ValueError, match="group"):
        advantages.get("gae")


# ----------------------------------------------------------------------------- RLOO

def test_rloo_by_hand():
    # group (1, 0, 0, 0): Â_0 = 1 − (0+0+0)/3 = 1;  Â_j = 0 − (1+0+0)/3 = −1/3
    #   (= G/(G−1)·(r − mean) = 4/3·(0.75, −0.25));  group (2, 2, 2, 2): exactly 0
    # group (3, 1, 2, 6): Â = 3 − 9/3 = 0, 1 − 11/3 = −8/3, 2 − 10/3 = −4/3, 6 − 6/3 = 4
    r = torch.tensor([1.0, 0, 0, 0, 2, 2, 2, 2, 3, 1, 2, 6], dtype=torch.float64)
    adv = rloo_advantages(r, 4)
    assert adv.tolist() == pytest.approx([1, -1 / 3, -1 / 3, -1 / 3, 0, 0, 0, 0, 0, -8 / 3, -4 / 3, 4])
    assert torch.equal(adv[4:8], torch.zeros(4, dtype=torch.float64))
    centred = group_advantages(r, 4, scale="none")
    torch.testing.assert_close(adv, centred * 4 / 3)                  # n/(n−1)·(r − mean)
    # scale=group divides by the group's Bessel std: group 0 std 0.5 → (2, −2/3, −2/3, −2/3)
    assert rloo_advantages(r, 4, scale="group", eps=0.0)[:4].tolist() == pytest.approx(
        [2, -2 / 3, -2 / 3, -2 / 3])
    assert adv.sum().item() == pytest.approx(0.0)                     # zero-sum per group
    with pytest.raises(ValueError, match="none or group"):
        rloo_advantages(r, 4, scale="batch")


def test_rloo_with_dropped_samples():
    # NaN = a dropped sample (rewards.on_error=drop): no part in the baselines, advantage 0
    # group (1, NaN, 0, 0.5): n = 3 → Â = 1 − (0+0.5)/2 = 0.75, 0, 0 − 0.75 = −0.75, 0.5 − 0.5 = 0
    # group (NaN, 1, NaN, NaN): one scored sample, no baseline → 0;  (NaN, 1, NaN, 1): equal → 0
    nan = float("nan")
    r = torch.tensor([1.0, nan, 0, 0.5, nan, 1, nan, nan, nan, 1, nan, 1])
    adv = rloo_advantages(r, 4)
    assert adv.tolist() == pytest.approx([0.75, 0, -0.75, 0, 0, 0, 0, 0, 0, 0, 0, 0])
    assert torch.isfinite(adv).all()
    # without the dropped sample the group is a group of 3 with the same advantages
    assert rloo_advantages(torch.tensor([1.0, 0, 0.5]), 3).tolist() == pytest.approx([0.75, -0.75, 0])


def test_best_worst_pairs():
    # group 0 (1, 0, 1, 0.5): best row 0 (first of the ties), worst row 1; group 1 all equal: none;
    # group 2 (NaN, 1, 0, NaN): rows 9 / 10; group 3 one scored sample: none
    nan = float("nan")
    r = torch.tensor([1.0, 0, 1, 0.5, 2, 2, 2, 2, nan, 1, 0, nan, nan, 1, nan, nan])
    win, lose = best_worst_pairs(r, 4)
    assert win.tolist() == [0, 9] and lose.tolist() == [1, 10]
    none = best_worst_pairs(torch.ones(8), 4)
    assert none[0].numel() == 0 and none[1].numel() == 0


# ----------------------------------------------------------------------------- GAE (PPO)

def _slow_gae(r, v, m, gamma, lam):
    """Reference: per row, the textbook backwards recursion over its unmasked positions only."""
    N, T = len(r), len(r[0])
    adv, ret = [[0.0] * T for _ in range(N)], [[0.0] * T for _ in range(N)]
    for i in range(N):
        next_v = next_a = 0.0                   # after the last token: terminal, V = 0
        for t in reversed([t for t in range(T) if m[i][t] > 0]):
            delta = r[i][t] + gamma * next_v - v[i][t]
            next_a = delta + gamma * lam * next_a
            next_v = v[i][t]
            adv[i][t], ret[i][t] = next_a, next_a + v[i][t]
    return torch.tensor(adv), torch.tensor(ret)


def test_gae_hand_numbers():
    # one response of 3 tokens, reward 1 on the last, V = (0.5, 0.6, 0.8), γ = 1
    # λ = 1: Â_t = R − V_t = (0.5, 0.4, 0.2), returns all 1 (Monte Carlo)
    # λ = 0: Â_t = δ_t = (0.6 − 0.5, 0.8 − 0.6, 1 − 0.8) = (0.1, 0.2, 0.2), returns = r_t + V_{t+1}
    r, v, m = torch.tensor([[0.0, 0, 1]]), torch.tensor([[0.5, 0.6, 0.8]]), torch.ones(1, 3)
    adv, ret = advantages.gae(r, v, m, 1.0, 1.0)
    assert adv[0].tolist() == pytest.approx([0.5, 0.4, 0.2]) and ret[0].tolist() == pytest.approx([1, 1, 1])
    adv, ret = advantages.gae(r, v, m, 1.0, 0.0)
    assert adv[0].tolist() == pytest.approx([0.1, 0.2, 0.2])
    assert ret[0].tolist() == pytest.approx([0.6, 0.8, 1.0])
    # γ = 0.5, λ = 0.5: δ = (0.5·0.6 − 0.5, 0.5·0.8 − 0.6, 1 − 0.8) = (−0.2, −0.2, 0.2)
    #   Â_2 = 0.2, Â_1 = −0.2 + 0.25·0.2 = −0.15, Â_0 = −0.2 + 0.25·(−0.15) = −0.2375
    adv, _ = advantages.gae(r, v, m, 0.5, 0.5)
    assert adv[0].tolist() == pytest.approx([-0.2375, -0.15, 0.2])


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.95), (1.0, 1.0), (0.9, 0.0), (0.5, 0.7)])
def test_gae_matches_slow_reference(gamma, lam):
    g = torch.Generator().manual_seed(int(gamma * 100 + lam * 10))
    N, T = 7, 9
    lengths = [9, 1, 0, 5, 3, 8, 2]                           # full, one token, empty, ...
    m = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).float()  # right padding
    m[5, 2] = m[5, 6] = 0                                     # a row with holes (masked tool output)
    r = torch.randn(N, T, generator=g)                        # dense rewards (KL in the reward)
    v = torch.randn(N, T, generator=g)
    junk = torch.where(m > 0, 0.0, 1e3)                       # padding may hold anything
    adv, ret = advantages.gae(r + junk, v + junk, m, gamma, lam)
    ref_adv, ref_ret = _slow_gae(r.tolist(), v.tolist(), m.tolist(), gamma, lam)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-5, atol=1e-5)
    assert (adv[m == 0] == 0).all() and (ret[m == 0] == 0).all()


def test_gae_terminal_reward_only_gamma_one_lambda_one_is_monte_carlo():
    # the PPO set-up of gspo: reward on the last token; with γ = λ = 1 every token's return is r_i
    m = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    r = torch.tensor([[0.0, 0, 1, 0], [0, 0.5, 0, 0]])
    v = torch.rand(2, 4)
    adv, ret = advantages.gae(r, v, m, 1.0, 1.0)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1, 1, 0], [0.5, 0.5, 0, 0]]))
    torch.testing.assert_close(adv, (ret - v) * m)


def test_whiten_over_masked_tokens():
    x = torch.tensor([[1.0, 2, 3], [4, 99, 99]])
    m = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    w = advantages.whiten(x, m, eps=0.0)
    # tokens 1..4: mean 2.5, Bessel var 5/3
    expected = (torch.tensor([1.0, 2, 3, 4]) - 2.5) / (5 / 3) ** 0.5
    assert w[m > 0].tolist() == pytest.approx(expected.tolist())
    assert (w[m == 0] == 0).all()
