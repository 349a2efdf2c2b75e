"""Tests for gspo.core.objectives: hand-derived values, closed-form gradients (GSPO paper Eq. 10, 11, 17),
padding / split invariance, clip statistics, aggregation modes and the registry."""

import math
import warnings

import pytest
import torch

from gspo.core import objectives
from gspo.core.objectives import AGGREGATIONS, aggregate, kl_k3, masked_mean

F64 = torch.float64
NAMES = ["cispo", "gmpo", "grpo", "gspo", "gspo_token", "luspo", "ppo", "sapo"]


def mask_of(lengths, t):
    """[N, T] mask with the first lengths[i] positions of row i set."""
    return (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).to(F64)


def random_batch(seed=0, lengths=(6, 4, 3, 1, 5), t=6, spread=0.3):
    """logp (leaf), old_logp, advantages [N], mask; padding filled with garbage."""
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    mask = mask_of(lengths, t)
    old = -torch.rand(n, t, generator=g, dtype=F64) * 3 - 0.05
    logp = old + spread * torch.randn(n, t, generator=g, dtype=F64)
    logp = torch.where(mask > 0, logp, torch.full_like(logp, 123.0))    # garbage on padding
    adv = torch.randn(n, generator=g, dtype=F64)
    return logp.requires_grad_(), old, adv, mask


def grad_of(loss, logp):
    (g,) = torch.autograd.grad(loss, logp)
    return g


@pytest.fixture(autouse=True)
def fresh_warning_state(monkeypatch):
    """Each test sees the 'warn once' state of a fresh process."""
    monkeypatch.setattr(objectives, "_warned", set())


# ----------------------------------------------------------------------------- seeds' example

P, Q = (0.8, 0.7, 0.9), (0.5, 0.2, 0.3)


def seed_example():
    logp = torch.tensor([P], dtype=F64).log().requires_grad_()
    old = torch.tensor([Q], dtype=F64).log()
    return logp, old, torch.ones(1, dtype=F64), torch.ones(1, 3, dtype=F64)


def test_seed_example_token_and_sequence_ratios():
    # token ratios P/Q = 0.8/0.5, 0.7/0.2, 0.9/0.3 = 1.6, 3.5, 3.0
    # raw sequence ratio Π P / Π Q = 0.504 / 0.03 = 16.8; GSPO uses 16.8^(1/3) ≈ 2.5612 (Eq. 7)
    logp, old, adv, mask = seed_example()
    assert math.prod(P) / math.prod(Q) == pytest.approx(16.8)
    r = torch.exp(logp - old)[0]
    assert r.tolist() == pytest.approx([1.6, 3.5, 3.0])
    _, st = objectives.get("grpo")(logp, old, adv, mask)
    assert st["ratio_min"].item() == pytest.approx(1.6)
    assert st["ratio_max"].item() == pytest.approx(3.5)
    assert st["ratio_mean"].item() == pytest.approx((1.6 + 3.5 + 3.0) / 3)
    _, st = objectives.get("gspo")(logp, old, adv, mask)
    assert st["ratio_mean"].item() == pytest.approx(16.8 ** (1 / 3))
    assert 16.8 ** (1 / 3) == pytest.approx(2.5612, abs=1e-4)
    # approx_kl = mean(log Q − log P) = −ln(16.8)/3
    assert st["approx_kl"].item() == pytest.approx(-math.log(16.8) / 3)


def test_seed_example_gspo_loss_clipped_and_unclipped():
    logp, old, adv, mask = seed_example()
    # paper range: s = 2.5612 > 1 + 4e-4 with Â = 1 → ℓ = −min(2.5612, 1.0004) = −1.0004, clipped
    loss, st = objectives.get("gspo")(logp, old, adv, mask)
    assert loss.item() == pytest.approx(-1.0004)
    assert st["clip_frac_tokens"].item() == 1.0 and st["clip_frac_high"].item() == 1.0
    assert torch.all(grad_of(loss, logp) == 0)
    # a range wide enough: ℓ = −s Â = −2.5612
    logp, old, adv, mask = seed_example()
    loss, st = objectives.get("gspo")(logp, old, adv, mask, eps_low=0.5, eps_high=5.0)
    assert loss.item() == pytest.approx(-(16.8 ** (1 / 3)))
    assert st["clip_frac_tokens"].item() == 0.0


# ----------------------------------------------------------------------------- closed-form gradients

def test_gspo_gradient_is_eq10():
    # Eq. 10: ∂loss/∂logp_it = −(1/N) s_i Â_i / |y_i| for unclipped responses, 0 for clipped ones
    logp, old, adv, mask = random_batch(seed=1)
    el, eh = 0.03, 0.04
    loss, st = objectives.get("gspo")(logp, old, adv, mask, eps_low=el, eps_high=eh)
    n, lengths = mask.shape[0], mask.sum(-1)
    s = torch.exp(((logp.detach() - old) * mask).sum(-1) / lengths)
    clipped = ((adv > 0) & (s > 1 + eh)) | ((adv < 0) & (s < 1 - el))
    assert 0 < clipped.sum() < n, "test needs clipped and unclipped responses"
    expected = -(s * adv / lengths / n * ~clipped)[:, None] * mask
    torch.testing.assert_close(grad_of(loss, logp), expected)
    # loss value: (1/N) Σ −min(s Â, clip(s) Â)
    want = -torch.minimum(s * adv, s.clamp(1 - el, 1 + eh) * adv).mean()
    torch.testing.assert_close(loss.detach(), want)


def test_grpo_gradient_is_eq11():
    # Eq. 11: ∂loss/∂logp_it = −(1/N) r_it Â_i / |y_i| for unclipped tokens, 0 for clipped tokens
    logp, old, adv, mask = random_batch(seed=2)
    el, eh = 0.2, 0.27
    loss, _ = objectives.get("grpo")(logp, old, adv, mask)
    n, lengths = mask.shape[0], mask.sum(-1, keepdim=True)
    r = torch.exp(logp.detach() - old)
    a = adv[:, None]
    clipped = ((a > 0) & (r > 1 + eh)) | ((a < 0) & (r < 1 - el))
    assert 0 < (clipped & (mask > 0)).sum() < mask.sum()
    expected = -(r * a / lengths / n) * ~clipped * mask
    torch.testing.assert_close(grad_of(loss, logp), expected)


def test_gspo_token_gradient_is_eq17():
    # Eq. 17: ∂loss/∂logp_it = −(1/N) s_i Â_it / |y_i| where not clipped (sign of Â_it)
    logp, old, _, mask = random_batch(seed=3)
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(9), dtype=F64)
    el, eh = 0.03, 0.04
    loss, _ = objectives.get("gspo_token")(logp, old, adv, mask, eps_low=el, eps_high=eh)
    n, lengths = mask.shape[0], mask.sum(-1, keepdim=True)
    s = torch.exp(((logp.detach() - old) * mask).sum(-1, keepdim=True) / lengths)
    clipped = ((adv > 0) & (s > 1 + eh)) | ((adv < 0) & (s < 1 - el))
    assert 0 < (clipped & (mask > 0)).sum() < mask.sum()
    expected = -(s * adv / lengths / n) * ~clipped * mask
    torch.testing.assert_close(grad_of(loss, logp), expected)


def test_gspo_token_equals_gspo_for_sequence_advantages():
    logp, old, adv, mask = random_batch(seed=4)
    kw = dict(eps_low=0.03, eps_high=0.04)
    loss_s, st_s = objectives.get("gspo")(logp, old, adv, mask, **kw)
    loss_t, st_t = objectives.get("gspo_token")(logp, old, adv, mask, **kw)   # Â_it = Â_i
    torch.testing.assert_close(loss_t, loss_s)
    torch.testing.assert_close(grad_of(loss_t, logp), grad_of(loss_s, logp))
    for key in st_s:
        torch.testing.assert_close(st_t[key], st_s[key])


def test_gspo_token_differs_for_token_advantages():
    logp, old, adv, mask = random_batch(seed=4)
    tok = adv[:, None] * torch.linspace(0.2, 2.0, mask.shape[1], dtype=F64)   # Â_it varies along t
    loss_s, _ = objectives.get("gspo")(logp, old, adv, mask, eps_low=0.5, eps_high=0.5)
    loss_t, _ = objectives.get("gspo_token")(logp, old, tok, mask, eps_low=0.5, eps_high=0.5)
    g_s, g_t = grad_of(loss_s, logp), grad_of(loss_t, logp)
    assert not torch.allclose(g_s, g_t)


def test_sapo_value_and_gradient():
    # row 0: r = 2, Â = +1, τ_pos = 1:     f = σ(1·(2−1))·4/1 = 4·0.7310586 = 2.9242344, ℓ = −2.9242344
    # row 1: r = 0.5, Â = −1, τ_neg = 1.05: f = σ(1.05·(−0.5))·4/1.05 = 0.3716836·3.8095238
    #        = 1.4159376, ℓ = +1.4159376
    # seq-mean-token-mean over one-token rows: loss = (−2.9242344 + 1.4159376)/2 = −0.7541484
    old = torch.log(torch.tensor([[0.25], [0.4]], dtype=F64))
    logp = torch.log(torch.tensor([[0.5], [0.2]], dtype=F64)).requires_grad_()
    adv, mask = torch.tensor([1.0, -1.0], dtype=F64), torch.ones(2, 1, dtype=F64)
    loss, _ = objectives.get("sapo")(logp, old, adv, mask)
    sig = lambda x: 1 / (1 + math.exp(-x))
    f0, f1 = 4 * sig(1.0), 4 / 1.05 * sig(-0.525)
    assert f0 == pytest.approx(2.9242344) and f1 == pytest.approx(1.4159376)
    assert loss.item() == pytest.approx((-f0 + f1) / 2)
    # gradient: ∂ℓ/∂logp = −4σ(1−σ)·r·Â, then 1/N:
    #   row 0: −4·σ(1)(1−σ(1))·2 / 2;  row 1: +4·σ(−.525)(1−σ(−.525))·0.5 / 2
    g = grad_of(loss, logp)
    w0, w1 = 4 * sig(1.0) * (1 - sig(1.0)), 4 * sig(-0.525) * (1 - sig(-0.525))
    torch.testing.assert_close(g, torch.tensor([[-w0 * 2 / 2], [w1 * 0.5 / 2]], dtype=F64))
    # clip stats against GRPO's band 0.8 / 1.27: row 0 (Â>0, r=2) high, row 1 (Â<0, r=0.5) low
    _, st = objectives.get("sapo")(logp, old, adv, mask)
    assert (st["clip_frac_low"].item(), st["clip_frac_high"].item()) == (0.5, 0.5)


def test_sapo_gradient_random_and_on_policy_weight_one():
    logp, old, adv, mask = random_batch(seed=5)
    loss, _ = objectives.get("sapo")(logp, old, adv, mask)
    n, lengths = mask.shape[0], mask.sum(-1, keepdim=True)
    r, a = torch.exp(logp.detach() - old), adv[:, None]
    tau = torch.where(a > 0, 1.0, 1.05).to(F64)
    sg = torch.sigmoid(tau * (r - 1))
    expected = -(4 * sg * (1 - sg) * r * a / lengths / n) * mask
    torch.testing.assert_close(grad_of(loss, logp), expected)
    # on-policy (r = 1): weight 4·σ(0)(1−σ(0)) = 1 → plain policy gradient −Â/|y_i|/N
    on = old.clone().requires_grad_()
    loss, _ = objectives.get("sapo")(on, old, adv, mask)
    torch.testing.assert_close(grad_of(loss, on), -(a / lengths / n) * mask)


def test_cispo_value_and_gradient():
    # token 0: r = 0.5/0.25 = 2 (weight 2), token 1: r = 0.6/0.05 = 12 → truncated to 1+4 = 5, Â = 1
    # ℓ = −(2·ln 0.5 + 5·ln 0.6)/2 (token-mean over 2 tokens) = (1.3862944 + 2.5541281)/2 = 1.9702112
    old = torch.log(torch.tensor([[0.25, 0.05]], dtype=F64))
    logp = torch.log(torch.tensor([[0.5, 0.6]], dtype=F64)).requires_grad_()
    adv, mask = torch.ones(1, dtype=F64), torch.ones(1, 2, dtype=F64)
    loss, st = objectives.get("cispo")(logp, old, adv, mask)
    assert loss.item() == pytest.approx(-(2 * math.log(0.5) + 5 * math.log(0.6)) / 2)
    assert loss.item() == pytest.approx(1.9702112)
    # gradient −ŵ Â / num_tokens: the truncated token keeps gradient 5/2 (CISPO never drops tokens)
    torch.testing.assert_close(grad_of(loss, logp), torch.tensor([[-2 / 2, -5 / 2]], dtype=F64))
    assert st["clip_frac_tokens"].item() == 0.5 and st["clip_frac_high"].item() == 0.5


def test_cispo_gradient_random():
    logp, old, adv, mask = random_batch(seed=6, spread=1.0)
    el, eh = 0.2, 0.28
    loss, st = objectives.get("cispo")(logp, old, adv, mask, eps_low=el, eps_high=eh)
    r = torch.exp(logp.detach() - old)
    w = r.clamp(1 - el, 1 + eh)
    torch.testing.assert_close(grad_of(loss, logp), -(w * adv[:, None] / mask.sum()) * mask)
    truncated = ((r < 1 - el) | (r > 1 + eh)) & (mask > 0)
    assert 0 < truncated.sum() < mask.sum()
    assert st["clip_frac_tokens"].item() == pytest.approx((truncated.sum() / mask.sum()).item())


def test_gmpo_value_and_gradient():
    # row 0, Â = +1: ratios 2.0, 1.2; log 2 = 0.6931 > 0.4 → clipped to 0.4; log 1.2 = 0.1823
    #   G = exp((0.4 + 0.1823216)/2) = exp(0.2911608) = 1.3379797, ℓ = −1.3379797
    # row 1, Â = −1: ratios 0.5, 1.2; log 0.5 = −0.6931 < −0.4 → −0.4
    #   G = exp((−0.4 + 0.1823216)/2) = exp(−0.1088392) = 0.8968746, ℓ = +0.8968746
    # seq-mean: (−1.3379797 + 0.8968746)/2 = −0.2205525
    old = torch.log(torch.tensor([[0.25, 0.5], [0.4, 0.5]], dtype=F64))
    logp = torch.log(torch.tensor([[0.5, 0.6], [0.2, 0.6]], dtype=F64)).requires_grad_()
    adv, mask = torch.tensor([1.0, -1.0], dtype=F64), torch.ones(2, 2, dtype=F64)
    loss, st = objectives.get("gmpo")(logp, old, adv, mask)
    g0 = math.exp((0.4 + math.log(1.2)) / 2)
    g1 = math.exp((-0.4 + math.log(1.2)) / 2)
    assert g0 == pytest.approx(1.3379797) and g1 == pytest.approx(0.8968746)
    assert loss.item() == pytest.approx((-g0 + g1) / 2)
    # gradient −Â_i G_i / |y_i| / N on unclipped tokens, 0 on clipped ones
    want = torch.tensor([[0.0, -g0 / 2 / 2], [0.0, g1 / 2 / 2]], dtype=F64)
    torch.testing.assert_close(grad_of(loss, logp), want)
    assert st["clip_frac_tokens"].item() == 0.5
    assert st["clip_frac_low"].item() == 0.25 and st["clip_frac_high"].item() == 0.25


def test_gmpo_gradient_random():
    logp, old, adv, mask = random_batch(seed=7, spread=0.5)
    el, eh = 0.4, 0.4
    loss, _ = objectives.get("gmpo")(logp, old, adv, mask)
    n, lengths = mask.shape[0], mask.sum(-1, keepdim=True)
    d, a = (logp.detach() - old) * mask, adv[:, None]
    d_clip = torch.where(a > 0, d.clamp(max=eh), d.clamp(min=-el))
    gm = torch.exp((d_clip * mask).sum(-1, keepdim=True) / lengths)
    clipped = ((a > 0) & (d > eh)) | ((a < 0) & (d < -el))
    assert 0 < (clipped & (mask > 0)).sum() < mask.sum()
    torch.testing.assert_close(grad_of(loss, logp), -(a * gm / lengths / n) * ~clipped * mask)


def test_luspo_value_and_gradient():
    # ε = 0.2 both sides, N = 3 responses; ℓ_i = −|y_i| min(s_i Â_i, clip(s_i) Â_i), seq-mean
    # row 0: |y| = 2, token ratios 1.21 and 1 → s = √1.21 = 1.1 (inside 0.8..1.2), Â = +1
    #        ℓ = −2 · 1.1 = −2.2; gradient per token −s Â / N = −1.1/3 = −0.3666667
    # row 1: |y| = 1, ratio 0.5 → s = 0.5 < 0.8 with Â = −1: clipped low, ℓ = −1 · (−0.8) = 0.8, no gradient
    # row 2: |y| = 3, on-policy s = 1, Â = −0.5: ℓ = −3 · (−0.5) = 1.5; gradient −(1)(−0.5)/3 = +0.1666667
    # loss = (−2.2 + 0.8 + 1.5)/3 = 0.1/3 = 0.0333333
    # (GSPO on the same batch: ℓ = (−1.1, 0.8, 0.5), per-token gradients −1.1/(3·2) and 0.5/(3·3):
    #  LUSPO's token weights are GSPO's times |y_i|)
    mask = mask_of((2, 1, 3), 3)
    old = torch.full((3, 3), -1.0, dtype=F64)
    ratios = torch.tensor([[1.21, 1.0, 1.0], [0.5, 1.0, 1.0], [1.0, 1.0, 1.0]], dtype=F64)
    logp = (old + ratios.log()).requires_grad_()
    adv = torch.tensor([1.0, -1.0, -0.5], dtype=F64)
    loss, st = objectives.get("luspo")(logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    assert loss.item() == pytest.approx(0.1 / 3)
    want = torch.tensor([[-1.1 / 3, -1.1 / 3, 0.0], [0.0, 0.0, 0.0], [0.5 / 3, 0.5 / 3, 0.5 / 3]],
                        dtype=F64)
    torch.testing.assert_close(grad_of(loss, logp), want)
    assert st["clip_frac_seqs"].item() == pytest.approx(1 / 3)          # row 1, as GSPO counts it
    assert st["clip_frac_low"].item() == pytest.approx(1 / 6)           # its 1 token of 6
    assert (st["ratio_min"].item(), st["ratio_max"].item()) == pytest.approx((0.5, 1.1))
    gspo_loss, _ = objectives.get("gspo")(logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    assert gspo_loss.item() == pytest.approx((-1.1 + 0.8 + 0.5) / 3)


def test_luspo_is_gspo_with_each_response_weighted_by_its_length():
    # values and gradients: LUSPO row i = |y_i| × GSPO row i, clip decisions and stats identical
    logp, old, adv, mask = random_batch(seed=16, spread=0.1)
    kw = dict(eps_low=0.03, eps_high=0.04)
    lengths = mask.sum(-1)
    rows_l, rows_g = [], []
    for i in range(len(adv)):
        one = slice(i, i + 1)
        for name, out in (("luspo", rows_l), ("gspo", rows_g)):
            piece = logp.detach()[one].clone().requires_grad_()
            loss, _ = objectives.get(name)(piece, old[one], adv[one], mask[one], **kw)
            out.append((loss.detach(), grad_of(loss, piece)))
    for i, ((l_l, g_l), (l_g, g_g)) in enumerate(zip(rows_l, rows_g)):
        torch.testing.assert_close(l_l, lengths[i] * l_g)
        torch.testing.assert_close(g_l, lengths[i] * g_g)
    _, st_l = objectives.get("luspo")(logp, old, adv, mask, **kw)
    _, st_g = objectives.get("gspo")(logp, old, adv, mask, **kw)
    assert 0 < st_g["clip_frac_seqs"].item() < 1, "test needs clipped and unclipped responses"
    for key in st_g:
        torch.testing.assert_close(st_l[key], st_g[key])


@pytest.mark.parametrize("name", [n for n in NAMES if objectives.spec(n).zero_at_zero_advantage])
def test_zero_at_zero_advantage_flag_holds(name):
    """The flag the row-skipping plan reads: a flagged objective gives value 0 and gradient 0 on
    rows with Â = 0 (far off-policy, clipped or not), beside rows with signal."""
    logp, old, adv, mask = random_batch(seed=17, spread=1.0)
    adv = adv.clone()
    adv[[1, 3]] = 0.0
    loss, _ = objectives.get(name)(logp, old, adv, mask)
    g = grad_of(loss, logp)
    assert torch.count_nonzero(g[[1, 3]]) == 0 and torch.count_nonzero(g[[0, 2, 4]]) > 0
    zero, _ = objectives.get(name)(logp, old, torch.zeros_like(adv), mask)
    assert zero.item() == 0.0 and torch.count_nonzero(grad_of(zero, logp)) == 0


def test_dpo_loss_value_and_gradient():
    # β = 0.1; pair 0: log-ratio to the reference +2 (winner), −1 (loser): margin 0.1·3 = 0.3
    #   loss = −log σ(0.3) = log(1 + e^−0.3) = 0.5543552; ∂/∂logp_w = −β σ(−0.3) / K
    #   σ(−0.3) = 0.4255575 → −0.04255575 / 2 = −0.0212779; ∂/∂logp_l = +0.0212779
    # pair 1: policy = reference on both: margin 0, loss log 2 = 0.6931472, ∂ = ∓β/2 / K = ∓0.025
    # mean over K = 2: (0.5543552 + 0.6931472)/2 = 0.6237512
    ref_w, ref_l = torch.tensor([-3.0, -2.0], dtype=F64), torch.tensor([-4.0, -5.0], dtype=F64)
    logp_w = torch.tensor([-1.0, -2.0], dtype=F64, requires_grad=True)
    logp_l = torch.tensor([-5.0, -5.0], dtype=F64, requires_grad=True)
    loss, st = objectives.dpo_loss(logp_w, logp_l, ref_w, ref_l, beta=0.1)
    sig = lambda x: 1 / (1 + math.exp(-x))                                 # noqa: E731
    assert math.log(1 + math.exp(-0.3)) == pytest.approx(0.5543552)
    assert loss.item() == pytest.approx((math.log(1 + math.exp(-0.3)) + math.log(2)) / 2)
    assert loss.item() == pytest.approx(0.6237512)
    g_w, g_l = torch.autograd.grad(loss, (logp_w, logp_l))
    assert sig(-0.3) == pytest.approx(0.4255575)
    torch.testing.assert_close(g_w, torch.tensor([-0.1 * sig(-0.3) / 2, -0.1 * 0.5 / 2], dtype=F64))
    torch.testing.assert_close(g_l, -g_w)
    # implicit rewards: chosen β(2, 0) → 0.1, rejected β(−1, 0) → −0.05, margin 0.15, accuracy ½
    assert st["chosen"].item() == pytest.approx(0.1) and st["rejected"].item() == pytest.approx(-0.05)
    assert st["margin"].item() == pytest.approx(0.15) and st["accuracy"].item() == 0.5
    assert not any(v.requires_grad for v in st.values())


def test_dpo_loss_reference_has_no_gradient_and_shapes_are_checked():
    ref = torch.zeros(2, dtype=F64, requires_grad=True)
    lp = torch.zeros(2, dtype=F64, requires_grad=True)
    loss, _ = objectives.dpo_loss(lp, lp.detach() - 1, ref, ref.detach(), beta=1.0)
    assert torch.autograd.grad(loss, ref, allow_unused=True)[0] is None     # detached inside
    empty = torch.zeros(0, dtype=F64)
    assert objectives.dpo_loss(empty, empty, empty, empty, beta=0.1)[0].item() == 0.0
    with pytest.raises(ValueError, match=r"\[K\]"):
        objectives.dpo_loss(lp[:, None], lp[:, None], ref[:, None], ref[:, None], beta=0.1)


def test_sequence_logprobs_sum_the_response_and_skip_padding():
    # ln 0.5 + ln 0.25 = ln 0.125; row 1 empty → 0; padding holds NaN and is never read
    logp = torch.tensor([[math.log(0.5), math.log(0.25), float("nan")],
                         [float("nan")] * 3], dtype=F64)
    got = objectives.sequence_logprobs(logp, mask_of((2, 0), 3))
    assert got.tolist() == pytest.approx([math.log(0.125), 0.0])


# ----------------------------------------------------------------------------- invariances

def pad(x, k, value):
    return torch.cat([x, torch.full((x.shape[0], k), value, dtype=x.dtype)], dim=1)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_padding_columns_change_nothing(name, mode):
    logp, old, adv, mask = random_batch(seed=8)
    t = mask.shape[1]
    kw = dict(aggregation=mode, token_sum_norm=16.0)    # the trainer passes max_new_tokens
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss, st = objectives.get(name)(logp, old, adv, mask, **kw)
        g = grad_of(loss, logp)
        wide = pad(logp.detach(), 3, float("nan")).requires_grad_()    # NaN padding is never read
        loss_w, st_w = objectives.get(name)(wide, pad(old, 3, -7.0), adv, pad(mask, 3, 0.0), **kw)
        g_w = grad_of(loss_w, wide)
    torch.testing.assert_close(loss_w, loss)
    torch.testing.assert_close(g_w[:, :t], g)
    assert torch.all(g_w[:, t:] == 0)
    for key in st:
        torch.testing.assert_close(st_w[key], st[key])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_split_with_global_normalisers_sums_to_whole(name, mode):
    # two ranks (or micro-batches) with GLOBAL num_seqs / num_tokens: their losses and gradients add up
    logp, old, adv, mask = random_batch(seed=10, lengths=(6, 4, 3, 1, 5, 2), spread=0.5)
    fn = objectives.get(name)
    norm = dict(num_seqs=6.0, num_tokens=mask.sum(), token_sum_norm=6.0, aggregation=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole, _ = fn(logp, old, adv, mask, **norm)
        g = grad_of(whole, logp)
        parts, grads = [], []
        for rows in (slice(0, 2), slice(2, 6)):
            piece = logp.detach()[rows].clone().requires_grad_()
            loss, _ = fn(piece, old[rows], adv[rows], mask[rows], **norm)
            parts.append(loss)
            grads.append(grad_of(loss, piece))
    torch.testing.assert_close(parts[0] + parts[1], whole)
    torch.testing.assert_close(torch.cat(grads), g)


@pytest.mark.parametrize("name", NAMES)
def test_empty_rows_are_ignored_and_finite(name):
    logp, old, adv, mask = random_batch(seed=11)
    loss, st = objectives.get(name)(logp, old, adv, mask)
    g = grad_of(loss, logp)
    # add a response with an empty mask (e.g. a truncated one dropped by mask_truncated)
    logp2 = torch.cat([logp.detach(), torch.zeros(1, mask.shape[1], dtype=F64)]).requires_grad_()
    old2 = torch.cat([old, torch.zeros(1, mask.shape[1], dtype=F64)])
    adv2, mask2 = torch.cat([adv, torch.tensor([5.0], dtype=F64)]), pad(mask.T, 1, 0.0).T
    loss2, st2 = objectives.get(name)(logp2, old2, adv2, mask2)
    g2 = grad_of(loss2, logp2)
    torch.testing.assert_close(loss2, loss)
    torch.testing.assert_close(g2[:-1], g)
    assert torch.all(g2[-1] == 0)
    assert all(torch.isfinite(v) for v in st2.values())
    # all rows empty: loss 0, no NaN anywhere
    loss0, st0 = objectives.get(name)(logp, old, adv, torch.zeros_like(mask))
    assert loss0.item() == 0.0
    assert all(torch.isfinite(v) for v in st0.values())


# ----------------------------------------------------------------------------- clipping statistics

def test_gspo_clipping_both_bounds_both_signs():
    # one-token-ratio responses of lengths 1, 2, 3, 4 (all tokens share the log-ratio, so s_i is it):
    #   0: Â=+1, s=1.5 > 1+ε_high → clipped high, ℓ = −min(1.5, 1.1) = −1.1
    #   1: Â=−1, s=0.5 < 1−ε_low  → clipped low,  ℓ = −min(−0.5, −0.9) = 0.9
    #   2: Â=+1, s=0.5 (low side, Â>0) → not clipped, ℓ = −0.5
    #   3: Â=−1, s=1.5 (high side, Â<0) → not clipped, ℓ = 1.5
    # seq-mean: (−1.1 + 0.9 − 0.5 + 1.5)/4 = 0.2; clipped tokens 1 + 2 of 10
    lengths, ratios = (1, 2, 3, 4), torch.tensor([1.5, 0.5, 0.5, 1.5], dtype=F64)
    mask = mask_of(lengths, 4)
    old = torch.full((4, 4), -1.0, dtype=F64)
    logp = (old + ratios.log()[:, None]).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=F64)
    loss, st = objectives.get("gspo")(logp, old, adv, mask, eps_low=0.1, eps_high=0.1)
    assert loss.item() == pytest.approx(0.2)
    assert st["clip_frac_tokens"].item() == pytest.approx(3 / 10)
    assert st["clip_frac_low"].item() == pytest.approx(2 / 10)
    assert st["clip_frac_high"].item() == pytest.approx(1 / 10)
    assert st["clip_frac_seqs"].item() == pytest.approx(2 / 4)
    assert (st["ratio_min"].item(), st["ratio_max"].item()) == pytest.approx((0.5, 1.5))
    g = grad_of(loss, logp)
    assert torch.all(g[:2] == 0) and torch.all(g[2:][mask[2:] > 0] != 0)


def test_grpo_clipping_both_bounds_both_signs():
    # token ratios (1.5, 0.5, 1.0) in both rows, ε = 0.2 / 0.27
    #   Â=+1: 1.5 clipped high (ℓ = −1.27); 0.5 not (ℓ = −0.5); 1.0 not (ℓ = −1)   mean −2.77/3
    #   Â=−1: 1.5 not (ℓ = 1.5);  0.5 clipped low (ℓ = 0.8);  1.0 not (ℓ = 1)      mean 3.3/3
    # seq-mean-token-mean: (−2.77/3 + 3.3/3)/2 = 0.53/6
    old = torch.full((2, 3), -1.0, dtype=F64)
    logp = (old + torch.tensor([1.5, 0.5, 1.0], dtype=F64).log()).requires_grad_()
    adv, mask = torch.tensor([1.0, -1.0], dtype=F64), torch.ones(2, 3, dtype=F64)
    loss, st = objectives.get("grpo")(logp, old, adv, mask)
    assert loss.item() == pytest.approx(0.53 / 6)
    assert st["clip_frac_tokens"].item() == pytest.approx(2 / 6)
    assert st["clip_frac_low"].item() == pytest.approx(1 / 6)
    assert st["clip_frac_high"].item() == pytest.approx(1 / 6)
    assert st["clip_frac_seqs"].item() == 1.0
    g = grad_of(loss, logp)
    assert g[0, 0] == 0 and g[1, 1] == 0 and torch.count_nonzero(g) == 4


def test_stats_are_detached_scalars():
    logp, old, adv, mask = random_batch(seed=12)
    want = {"clip_frac_tokens", "clip_frac_seqs", "clip_frac_low", "clip_frac_high", "ratio_mean",
            "ratio_min", "ratio_max", "approx_kl", "log_ratio_clamped"}
    for name in NAMES:
        _, st = objectives.get(name)(logp, old, adv, mask)
        assert want <= st.keys(), name
        assert all(v.dim() == 0 and not v.requires_grad for v in st.values()), name


@pytest.mark.parametrize("name", NAMES)
def test_overflow_guard_keeps_everything_finite(name):
    # a log-ratio of ±100 would overflow exp in float32; it is clamped to ±20 and counted
    old = torch.full((2, 2), -1.0)
    logp = (old + torch.tensor([[100.0, 100.0], [-100.0, -100.0]])).requires_grad_()
    adv = torch.tensor([-1.0, 1.0])
    loss, st = objectives.get(name)(logp, old, adv, torch.ones(2, 2))
    g = grad_of(loss, logp)
    assert torch.isfinite(loss) and torch.all(torch.isfinite(g))
    assert st["log_ratio_clamped"].item() > 0
    assert loss.dtype == torch.float32


def test_low_precision_inputs_compute_in_float32():
    logp, old, adv, mask = random_batch(seed=13)
    loss, _ = objectives.get("gspo")(logp.detach().bfloat16(), old.bfloat16(), adv, mask)
    assert loss.dtype == torch.float32


# ----------------------------------------------------------------------------- aggregation

V = torch.tensor([[1.0, 2.0, float("nan")], [3.0, float("nan"), float("nan")]], dtype=F64)
M = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=F64)   # |y| = 2, 1


@pytest.mark.parametrize("mode, kw, want", [
    ("seq-mean-token-mean", {}, (1.5 + 3.0) / 2),                      # ((1+2)/2 + 3/1)/2 = 2.25
    ("seq-mean", {}, (1.5 + 3.0) / 2),                                 # token values: their means first
    ("token-mean", {}, (1 + 2 + 3) / 3),                               # Σ m v / Σ m = 2
    ("seq-mean-token-sum-norm", {}, (3 / 3 + 3 / 3) / 2),              # default L = T = 3 → 1
    ("seq-mean-token-sum-norm", {"token_sum_norm": 4}, (3 / 4 + 3 / 4) / 2),  # 0.75
    ("seq-mean-token-mean", {"num_seqs": 4}, (1.5 + 3.0) / 4),         # global count of 4 responses
    ("token-mean", {"num_tokens": 12}, 6 / 12),                        # global count of 12 tokens
])
def test_aggregate_token_values(mode, kw, want):
    assert aggregate(V, M, mode, **kw).item() == pytest.approx(want)


@pytest.mark.parametrize("mode, want", [
    ("seq-mean", (1 + 4) / 2),                                         # 2.5
    ("seq-mean-token-mean", (1 + 4) / 2),                              # broadcast, then mean: same
    ("token-mean", (2 * 1 + 1 * 4) / 3),                               # length-weighted: 2, not 2.5
    ("seq-mean-token-sum-norm", (2 * 1 / 3 + 1 * 4 / 3) / 2),          # Σ_t v_i / T, T = 3 → 1
])
def test_aggregate_sequence_values(mode, want):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = aggregate(torch.tensor([1.0, 4.0], dtype=F64), M, mode)
    assert got.item() == pytest.approx(want)


def test_aggregate_empty_rows_and_bad_mode():
    v = torch.cat([V, torch.full((1, 3), float("nan"), dtype=F64)])
    m = torch.cat([M, torch.zeros(1, 3, dtype=F64)])
    for mode in AGGREGATIONS:
        assert aggregate(v, m, mode).item() == pytest.approx(aggregate(V, M, mode).item())
        assert aggregate(v, torch.zeros_like(m), mode).item() == 0.0
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        aggregate(V, M, "sum")


def test_token_mean_reweights_gspo_by_length_and_warns_once():
    # on-policy (s = 1), lengths 1 and 3, Â = +1, −1 (ε wide so nothing clips): ℓ = (−1, +1)
    #   seq-mean:   (−1 + 1)/2 = 0
    #   token-mean: (1·(−1) + 3·(+1))/4 = 0.5 — the longer response counts three times
    mask = mask_of((1, 3), 3)
    old = torch.full((2, 3), -1.0, dtype=F64)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    fn = objectives.get("gspo")
    assert fn(old, old, adv, mask)[0].item() == pytest.approx(0.0)
    with pytest.warns(UserWarning, match="length"):
        loss, _ = fn(old, old, adv, mask, aggregation="token-mean")
    assert loss.item() == pytest.approx(0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # a second warning would raise
        fn(old, old, adv, mask, aggregation="token-mean")
        objectives.get("grpo")(old, old, adv, mask, aggregation="token-mean")   # token ratio: fine


def test_gspo_token_with_token_mean_warns():
    mask = mask_of((1, 3), 3)
    old = torch.full((2, 3), -1.0, dtype=F64)
    with pytest.warns(UserWarning, match="length"):
        objectives.get("gspo_token")(old, old, torch.ones(2, dtype=F64), mask, aggregation="token-mean")


def test_masked_mean_and_kl_k3():
    assert masked_mean(V, M).item() == pytest.approx(2.0)
    assert masked_mean(V, M, dim=-1).tolist() == pytest.approx([1.5, 3.0])
    assert masked_mean(V, torch.zeros_like(M)).item() == 0.0
    # logp = ln 0.5, ref = ln 0.25: d = ref − logp = ln 0.5; k3 = 0.5 − ln 0.5 − 1 = 0.1931472
    k3 = kl_k3(torch.tensor([[math.log(0.5), -1.0]]), torch.tensor([[math.log(0.25), -1.0]]))
    assert k3.tolist()[0] == pytest.approx([0.5 - math.log(0.5) - 1, 0.0])
    assert k3[0, 0].item() == pytest.approx(0.1931472)


# ----------------------------------------------------------------------------- registry

def test_registry_names_specs_and_errors():
    assert objectives.available() == NAMES
    with pytest.raises(ValueError) as err:
        objectives.get("ppo2")
    for name in NAMES:
        assert name in str(err.value)
    gspo = objectives.spec("gspo")
    assert dict(gspo.defaults) == {"eps_low": 3e-4, "eps_high": 4e-4, "aggregation": "seq-mean"}
    assert gspo.sequence_level and "2507.18071" in gspo.paper
    assert objectives.spec("sapo").defaults["tau_pos"] == 1.0
    assert objectives.spec("sapo").defaults["tau_neg"] == 1.05
    assert dict(objectives.spec("grpo").defaults) == {
        "eps_low": 0.2, "eps_high": 0.27, "aggregation": "seq-mean-token-mean"}
    assert objectives.spec("cispo").defaults["aggregation"] == "token-mean"
    assert objectives.spec("gmpo").defaults["eps_low"] == 0.4
    assert [n for n in NAMES if objectives.spec(n).sequence_level] == [
        "gmpo", "gspo", "gspo_token", "luspo"]
    assert dict(objectives.spec("ppo").defaults) == {
        "eps_low": 0.2, "eps_high": 0.2, "aggregation": "token-mean"}
    assert dict(objectives.spec("luspo").defaults) == dict(gspo.defaults)
    assert all(objectives.spec(n).zero_at_zero_advantage for n in NAMES)   # all proportional to Â
    for name, paper in [("sapo", "2511.20347"), ("cispo", "2506.13585"), ("gmpo", "2507.20673"),
                        ("ppo", "1707.06347"), ("luspo", "2602.05261")]:
        assert paper in objectives.spec(name).paper


def test_defaults_applied_and_overridable():
    logp, old, adv, mask = random_batch(seed=14)
    fn = objectives.get("gspo")
    default, _ = fn(logp, old, adv, mask)
    explicit, _ = fn(logp, old, adv, mask, eps_low=3e-4, eps_high=4e-4, aggregation="seq-mean")
    nones, _ = fn(logp, old, adv, mask, eps_low=None, eps_high=None, aggregation=None)
    wide, _ = fn(logp, old, adv, mask, eps_low=0.5, eps_high=0.5)
    assert default.item() == explicit.item() == nones.item() != wide.item()
    with pytest.raises(TypeError, match="tau_pos"):
        fn(logp, old, adv, mask, tau_pos=1.0)          # an unknown keyword is an error, not ignored


def test_register_rejects_mismatched_defaults():
    with pytest.raises(TypeError):
        @objectives.register("broken", eps_low=0.1, aggregation="seq-mean", sequence_level=False,
                             paper="none")
        def broken(logp, old_logp, advantages, mask, *, eps_low, eps_high, aggregation):
            raise AssertionError
    assert "broken" not in objectives.available()


def test_shape_errors():
    logp, old, adv, mask = random_batch(seed=15)
    with pytest.raises(ValueError, match=r"\[N, T\]"):
        objectives.get("grpo")(logp, old[:, :-1], adv, mask)
    with pytest.raises(ValueError, match="advantages"):
        objectives.get("gspo")(logp, old, adv[:, None].expand(mask.shape), mask)   # sequence level: [N]
    with pytest.raises(ValueError, match="advantages"):
        objectives.get("grpo")(logp, old, adv[:-1], mask)


def test_ppo_is_grpo_math_on_token_advantages():
    # PPO's clipped token surrogate = GRPO's, with per-token (GAE) advantages and its own defaults
    logp, old, _, mask = random_batch(seed=21, spread=0.5)
    adv = torch.randn(mask.shape, dtype=F64, generator=torch.Generator().manual_seed(3))  # [N, T]
    loss, st = objectives.get("ppo")(logp, old, adv, mask)
    g = grad_of(loss, logp)
    ref, st_ref = objectives.get("grpo")(logp, old, adv, mask, eps_low=0.2, eps_high=0.2,
                                         aggregation="token-mean")
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(g, grad_of(ref, logp))
    assert st.keys() == st_ref.keys()
