"""The mechanism's estimators pinned on hand-built cases whose answers are derived in the comments."""

import itertools
import math

import pytest
import torch

from gspo.core.grad_noise import minibatch_noise, ratio_dispersion, token_loss_weights, worked_example


def test_worked_example_sequence_weight_against_token_weights():
    # P = (0.8, 0.7, 0.9) under the target policy, Q = (0.5, 0.2, 0.3) under the sampler:
    # token weights 0.8/0.5 = 1.6, 0.7/0.2 = 3.5, 0.9/0.3 = 3; the sequence weight is their product
    # 0.504/0.03 = 16.8, far above every token weight (the under-correction the sources describe);
    # GSPO uses its cube root 16.8^(1/3) = 2.5612..., the geometric mean of 1.6, 3.5, 3.
    w = worked_example(torch.tensor([0.8, 0.7, 0.9], dtype=torch.float64),
                       torch.tensor([0.5, 0.2, 0.3], dtype=torch.float64))
    assert w["token"].tolist() == pytest.approx([1.6, 3.5, 3.0], rel=1e-12)
    assert w["sequence"].item() == pytest.approx(16.8, rel=1e-12)
    assert w["normalised"].item() == pytest.approx(16.8 ** (1 / 3), rel=1e-12)
    assert w["normalised"].item() == pytest.approx(2.5612, abs=1e-4)


def test_ratio_dispersion_by_hand():
    # Row 0: log r = (log 2, 0) -> log s = log2/2; spread = log2/2 (both tokens log2/2 from the
    # mean); token_dev = sqrt((log2)^2 / 2) = log2/sqrt2; under GRPO's band [0.8, 1.27] one token
    # of two (r = 2) is out, and s = sqrt2 = 1.414 is out. Row 1: log r = (0.1, -0.1, <pad 9>) ->
    # log s = 0, spread 0.1, seq inside the band, both tokens inside (e^0.1 = 1.105, e^-0.1 = 0.905).
    old = torch.zeros(2, 3)
    logp = torch.tensor([[math.log(2), 0.0, 0.0], [0.1, -0.1, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    d = ratio_dispersion(logp, old, mask, eps_low=0.2, eps_high=0.27)
    l2 = math.log(2)
    assert d["seq_dev"].tolist() == pytest.approx([l2 / 2, 0.0], abs=1e-7)
    assert d["token_spread"].tolist() == pytest.approx([l2 / 2, 0.1], abs=1e-7)
    assert d["token_dev"].tolist() == pytest.approx([l2 / math.sqrt(2), 0.1], abs=1e-7)
    assert d["token_out"].tolist() == [0.5, 0.0]
    assert d["seq_out"].tolist() == [1.0, 0.0]
    assert d["length"].tolist() == [2.0, 2.0]


def test_token_loss_weights_match_the_closed_form_gradients():
    # On-policy (logp = old) every objective's weight is -Â_i/|y_i| on each token (GSPO Eq. 10,
    # GRPO Eq. 11 at r = 1). Off-policy by log r = (0.1, -0.1) on a response of 2 with Â = 1:
    # GRPO (unclipped, 0.905 and 1.105 inside [0.8, 1.27]) gives -r_it/2 per token; GSPO's s = 1
    # (the log-ratios cancel) keeps -1/2 on both; with log r = (0.1, 0.1), s = e^0.1 > 1 + 4e-4 and
    # Â > 0, so GSPO clips the response: weight 0 on every token.
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, -2.0])
    old = torch.zeros(2, 3)
    for name in ("gspo", "grpo", "gspo_token"):
        c, _ = token_loss_weights(name, old.clone(), old, adv, mask)
        assert torch.allclose(c, torch.tensor([[-0.5, -0.5, 0.0], [2 / 3, 2 / 3, 2 / 3]]), atol=1e-7)
    logp = torch.tensor([[0.1, -0.1, 0.0]])
    one, m1 = torch.tensor([1.0]), torch.tensor([[1.0, 1.0, 0.0]])
    c, _ = token_loss_weights("grpo", logp, torch.zeros(1, 3), one, m1)
    assert c[0].tolist() == pytest.approx([-math.exp(0.1) / 2, -math.exp(-0.1) / 2, 0.0], abs=1e-6)
    c, _ = token_loss_weights("gspo", logp, torch.zeros(1, 3), one, m1)
    assert c[0].tolist() == pytest.approx([-0.5, -0.5, 0.0], abs=1e-6)
    c, stats = token_loss_weights("gspo", torch.tensor([[0.1, 0.1, 0.0]]), torch.zeros(1, 3), one, m1)
    assert c.abs().sum().item() == 0.0 and stats["clip_frac_seqs"].item() == 1.0
    # The clip opened (ε_low = 1, ε_high = ∞): the bare weight s_i Â_i/|y_i| = e^0.1/2 per token.
    c, _ = token_loss_weights("gspo", torch.tensor([[0.1, 0.1, 0.0]]), torch.zeros(1, 3), one, m1,
                              eps_low=1.0, eps_high=math.inf)
    assert c[0].tolist() == pytest.approx([-math.exp(0.1) / 2, -math.exp(0.1) / 2, 0.0], abs=1e-6)


def test_token_loss_weights_refuse_a_loss_that_does_not_split_by_response():
    with pytest.raises(ValueError, match="per-response"):
        token_loss_weights("grpo", torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1),
                           torch.ones(1, 2), aggregation="token-mean")


def test_minibatch_noise_against_every_minibatch():
    # g = (1,0), (3,0), (0,2), (0,-2): ḡ = (1,0), ‖ḡ‖ = 1; (1/N)Σ‖g_i − ḡ‖² = (0+4+5+5)/4 = 3.5;
    # B = 2 of N = 4 without replacement: E‖g_S − ḡ‖² = (4−2)/(2·3) · 3.5 = 7/6, so snr = sqrt(6/7).
    # The six pairs by hand: ‖g_S − ḡ‖² = 1, 1.25, 1.25, 1.25, 1.25, 1 (mean 7/6); cos(g_S, ḡ) =
    # 1, 0.5/sqrt(1.25) twice, 1.5/sqrt(3.25) twice, and 0 for the pair whose mean is 0.
    g = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0], [0.0, -2.0]])
    pairs = torch.tensor(list(itertools.combinations(range(4), 2)))
    out = minibatch_noise(g, 2, subsets=pairs)
    assert out["snr"].item() == pytest.approx(math.sqrt(6 / 7), rel=1e-12)
    assert out["noise"].item() ** 2 == pytest.approx(7 / 6, rel=1e-12)
    brute = sum(((g[list(p)].mean(0) - g.mean(0)) ** 2).sum().item() for p in pairs.tolist()) / 6
    assert brute == pytest.approx(7 / 6, rel=1e-6)
    cos = (1 + 2 * 0.5 / math.sqrt(1.25) + 2 * 1.5 / math.sqrt(3.25) + 0) / 6
    assert out["cosine"].item() == pytest.approx(cos, rel=1e-12)


def test_minibatch_noise_edges():
    same = torch.tensor([[1.0, 2.0]] * 4)
    assert minibatch_noise(same, 2)["snr"].item() == math.inf     # no spread: noiseless
    assert minibatch_noise(torch.zeros(4, 3), 2)["snr"].item() == 0.0
    full = minibatch_noise(torch.randn(5, 3, generator=torch.Generator().manual_seed(0)), 5)
    assert full["snr"].item() == math.inf and full["cosine"].item() == pytest.approx(1.0)
    with pytest.raises(ValueError):
        minibatch_noise(same, 5)
