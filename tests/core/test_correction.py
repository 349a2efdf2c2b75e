"""Tests for gspo.core.correction: every rollout-mismatch correction on a hand example (values, stats,
and the gradient of a corrected loss), detachment, padding, the registry, and the claim that
scaling advantages by w weights each token's loss by w (positive homogeneity of every objective)."""

import math

import pytest
import torch

from gspo.core import correction
from gspo.core import objectives
from gspo.core.correction import weighted_advantages

F64 = torch.float64

# Two responses, T = 3. Row 0: ρ_t = π_old/π_rollout = 0.2/0.5, 0.5/0.4, 0.6/0.2 = 0.4, 1.25, 3.0.
# Row 1: 0.3/0.3, 0.9/0.6 = 1.0, 1.5 and one padding position (garbage, never read).
OLD = [[0.2, 0.5, 0.6], [0.3, 0.9, 0.123]]
ROLL = [[0.5, 0.4, 0.2], [0.3, 0.6, 0.999]]
RHO = [0.4, 1.25, 3.0, 1.0, 1.5]               # the five response tokens, row by row
GEO = [1.5 ** (1 / 3), 1.5 ** (1 / 2)]         # geometric means: (0.4·1.25·3)^(1/3), (1·1.5)^(1/2)


def example():
    old = torch.tensor(OLD, dtype=F64).log()
    roll = torch.tensor(ROLL, dtype=F64).log()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
    return old, roll, mask


def k3(r):
    return r - math.log(r) - 1


KL = sum(k3(r) for r in RHO) / 5               # mean k3 over the five tokens


def run(name, **params):
    old, roll, mask = example()
    return correction.spec(name).fn(old, roll, mask, **params), mask


def stats(out):
    return {k: v.item() for k, v in out.stats.items()}


def test_geometric_means_and_kl_by_hand():
    assert GEO[0] == pytest.approx(1.144714, abs=1e-6) and GEO[1] == pytest.approx(1.224745, abs=1e-6)
    # 0.4 − ln 0.4 − 1 = 0.316291; 1.25: 0.026856; 3: 0.901388; 1: 0; 1.5: 0.094535
    assert KL == pytest.approx((0.316291 + 0.026856 + 0.901388 + 0 + 0.094535) / 5, abs=1e-6)


def test_none_measures_without_correcting():
    out, mask = run("none")
    assert torch.all(out.weight == 1) and torch.all(out.mask == 1)
    s = stats(out)
    assert s["kl"] == pytest.approx(KL)
    assert s["ratio_min"] == pytest.approx(0.4) and s["ratio_max"] == pytest.approx(3.0)
    assert s["masked_frac"] == 0 and s["is_weight_mean"] == 1


def test_ratio_tails_count_the_loss_tokens_beyond_two_either_way():
    # ρ_t = 0.4, 1.25, 3.0, 1.0, 1.5: one above 2 (3.0), one below 1/2 (0.4), of 5 tokens; the
    # padding position of row 1 (0.123/0.999 = 0.12) is not a loss token and is not counted
    for name in ("none", "tis", "icepop", "seq_tis", "seq_mask"):
        s = stats(run(name)[0])
        assert s["ratio_above_2_frac"] == pytest.approx(1 / 5) and s["ratio_below_half_frac"] == pytest.approx(1 / 5)
    exactly = torch.tensor([[math.log(2.0), -math.log(2.0)]], dtype=F64)
    tails = correction.ratio_tails(exactly, torch.ones(1, 2, dtype=F64))
    assert tails["ratio_above_2_frac"] == 0 and tails["ratio_below_half_frac"] == 0  # 2 itself is not beyond


def test_tis_caps_token_ratios():
    out, mask = run("tis", cap=2.0)
    w = out.weight
    assert w[0].tolist() == pytest.approx([0.4, 1.25, 2.0])     # 3.0 truncated to C = 2
    assert w[1, :2].tolist() == pytest.approx([1.0, 1.5])
    assert torch.all(out.mask == 1)
    s = stats(out)
    assert s["is_weight_mean"] == pytest.approx((0.4 + 1.25 + 2.0 + 1.0 + 1.5) / 5)  # 1.23
    assert s["ratio_min"] == pytest.approx(0.4) and s["ratio_max"] == pytest.approx(3.0)
    assert s["masked_frac"] == 0 and s["kl"] == pytest.approx(KL)


def test_tis_default_cap_is_two():
    assert correction.spec("tis").defaults == {"cap": 2.0}
    out, _ = run("tis")
    assert out.weight[0, 2].item() == pytest.approx(2.0)


def test_icepop_masks_tokens_outside_bounds():
    out, _ = run("icepop", low=0.5, high=2.0)
    assert out.mask[0].tolist() == [0, 1, 0]                  # 0.4 < 0.5 and 3.0 > 2 dropped
    assert out.mask[1, :2].tolist() == [1, 1]
    assert torch.all(out.weight == 1)
    s = stats(out)
    assert s["masked_frac"] == pytest.approx(2 / 5) and s["is_weight_mean"] == 1
    assert s["ratio_min"] == pytest.approx(0.4) and s["ratio_max"] == pytest.approx(3.0)


def test_seq_tis_caps_the_geometric_mean():
    out, _ = run("seq_tis", cap=1.2)
    assert out.weight[0].tolist() == pytest.approx([GEO[0]] * 3)   # 1.1447 < 1.2 kept
    assert out.weight[1].tolist() == pytest.approx([1.2] * 3)      # 1.2247 truncated
    assert torch.all(out.mask == 1)
    s = stats(out)
    assert s["ratio_min"] == pytest.approx(GEO[0]) and s["ratio_max"] == pytest.approx(GEO[1])
    assert s["is_weight_mean"] == pytest.approx((3 * GEO[0] + 2 * 1.2) / 5)
    assert s["masked_frac"] == 0 and s["kl"] == pytest.approx(KL)


def test_seq_mask_drops_whole_responses():
    out, _ = run("seq_mask", low=0.5, high=1.2)
    assert out.mask.tolist() == [[1, 1, 1], [0, 0, 0]]
    assert torch.all(out.weight == 1)
    assert stats(out)["masked_frac"] == pytest.approx(2 / 5)
    out, _ = run("seq_mask", low=1.15, high=2.0)                    # now row 0 (1.1447) is out
    assert out.mask.tolist() == [[0, 0, 0], [1, 1, 1]]
    assert stats(out)["masked_frac"] == pytest.approx(3 / 5)


def test_weights_are_detached_and_padding_is_never_read():
    old, roll, mask = example()
    old.requires_grad_()
    for name in correction.available():
        out = correction.spec(name).fn(old, roll, mask)
        assert not out.weight.requires_grad and not out.mask.requires_grad, name
        assert all(not v.requires_grad for v in out.stats.values()), name
        garbage = roll.clone()
        garbage[1, 2] = 50.0                                          # an absurd padding value
        again = correction.spec(name).fn(old, garbage, mask)
        assert stats(again) == pytest.approx(stats(out)), name
        kept = mask > 0
        assert torch.equal(again.weight[kept], out.weight[kept]), name


def test_empty_mask_gives_neutral_stats():
    old, roll, mask = example()
    out = correction.spec("seq_mask").fn(old, roll, torch.zeros_like(mask))
    s = stats(out)
    assert s["kl"] == 0 and s["masked_frac"] == 0 and s["ratio_min"] == 1 and s["ratio_max"] == 1


# ----------------------------------------------------------------------------- applied to a loss

A = torch.tensor([1.0, -2.0], dtype=F64)


def corrected_grad(name, objective, params, aggregation):
    """∇_logp of the objective at logp = π_old (ratio 1) with the correction applied as the
    trainer applies it: advantages scaled by the weight, the loss mask times the correction's mask."""
    old, roll, mask = example()
    out = correction.spec(name).fn(old, roll, mask, **params)
    logp = old.clone().requires_grad_()
    per_row = objectives.spec(objective).sequence_level
    adv = weighted_advantages(A, out.weight, mask, per_row=per_row)
    loss, _ = objectives.get(objective)(logp, old, adv, mask * out.mask, aggregation=aggregation)
    (g,) = torch.autograd.grad(loss, logp)
    return g * mask


def test_tis_gradient_of_grpo_token_mean():
    # token-mean over 5 tokens, ratio 1 (inside the clip range): ∂ℓ/∂logp_t = −w_t Â_i / 5
    g = corrected_grad("tis", "grpo", {"cap": 2.0}, "token-mean")
    expect = [[-0.4 / 5, -1.25 / 5, -2.0 / 5], [2 * 1.0 / 5, 2 * 1.5 / 5, 0.0]]
    assert torch.allclose(g, torch.tensor(expect, dtype=F64), rtol=0, atol=1e-12)


def test_icepop_gradient_of_grpo_token_mean():
    # the two masked tokens leave the loss and its normaliser: −Â_i / 3 on the three kept ones
    g = corrected_grad("icepop", "grpo", {"low": 0.5, "high": 2.0}, "token-mean")
    expect = [[0.0, -1 / 3, 0.0], [2 / 3, 2 / 3, 0.0]]
    assert torch.allclose(g, torch.tensor(expect, dtype=F64), rtol=0, atol=1e-12)


def test_seq_tis_gradient_of_gspo_seq_mean():
    # GSPO, seq-mean over N = 2: ∂s_i/∂logp_t = s_i/|y_i| = 1/|y_i| at s = 1: −w_i Â_i / (2 |y_i|)
    g = corrected_grad("seq_tis", "gspo", {"cap": 1.2}, "seq-mean")
    w0, w1 = GEO[0], 1.2
    expect = [[-w0 / 6] * 3, [w1 * 2 / 4, w1 * 2 / 4, 0.0]]
    assert torch.allclose(g, torch.tensor(expect, dtype=F64), rtol=0, atol=1e-12)


def test_seq_mask_gradient_of_gspo_seq_mean():
    # row 1 dropped: it leaves the sequence count too, so row 0 alone: −Â_0 / |y_0| = −1/3
    g = corrected_grad("seq_mask", "gspo", {"low": 0.5, "high": 1.2}, "seq-mean")
    expect = [[-1 / 3] * 3, [0.0, 0.0, 0.0]]
    assert torch.allclose(g, torch.tensor(expect, dtype=F64), rtol=0, atol=1e-12)


def test_tis_gradient_of_gspo_is_the_token_weighted_sequence_loss():
    # GSPO's token loss is its sequence loss ℓ_i at every token, so Σ_t w_t ℓ_i / |y_i| = w̄_i ℓ_i:
    # w̄_0 = (0.4 + 1.25 + 2)/3, w̄_1 = (1 + 1.5)/2 and ∂/∂logp_t = −w̄_i Â_i / (2 |y_i|)
    g = corrected_grad("tis", "gspo", {"cap": 2.0}, "seq-mean")
    w0, w1 = (0.4 + 1.25 + 2.0) / 3, 1.25
    expect = [[-w0 / 6] * 3, [w1 * 2 / 4, w1 * 2 / 4, 0.0]]
    assert torch.allclose(g, torch.tensor(expect, dtype=F64), rtol=0, atol=1e-12)


def test_weighted_advantages_shapes():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=F64)
    w_row = torch.tensor([[2.0, 2.0], [0.5, 0.5]], dtype=F64)
    assert weighted_advantages(A, w_row, mask, per_row=True).tolist() == [2.0, -1.0]   # stays [N]
    w_tok = torch.tensor([[2.0, 1.0], [0.5, 3.0]], dtype=F64)
    assert weighted_advantages(A, w_tok, mask, per_row=False).tolist() == [[2.0, 1.0], [-1.0, -6.0]]
    assert weighted_advantages(A, w_tok, mask, per_row=True).tolist() == [1.5, -1.0]  # row means
    adv_t = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=F64)                    # ppo: [N, T]
    assert weighted_advantages(adv_t, w_row, mask, per_row=False).tolist() == [[2.0, 4.0], [1.5, 2.0]]


@pytest.mark.parametrize("name", objectives.available())
def test_every_objective_is_positively_homogeneous_in_the_advantages(name):
    """ℓ(c·Â) = c·ℓ(Â) for c ≥ 0, with logp ≠ π_old (clipping active): the reason that scaling Â
    by the weight is the same as weighting the loss."""
    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(5)[None] < torch.tensor([5, 3, 4, 1])[:, None]).to(F64)
    old = -torch.rand(4, 5, generator=g, dtype=F64) * 2 - 0.1
    logp = old + 0.3 * torch.randn(4, 5, generator=g, dtype=F64)
    adv = torch.randn(4, generator=g, dtype=F64)
    fn = objectives.get(name)
    base, _ = fn(logp, old, adv, mask)
    for c in (0.0, 0.37, 2.5):
        scaled, _ = fn(logp, old, c * adv, mask)
        assert scaled.item() == pytest.approx(c * base.item(), rel=1e-12, abs=1e-15)


def test_registry():
    assert correction.available() == ["icepop", "none", "seq_mask", "seq_tis", "tis"]
    assert correction.spec("tis").per_token and not correction.spec("seq_tis").per_token
    with pytest.raises(ValueError, match="did you mean|valid: icepop"):
        correction.spec("tsi")
