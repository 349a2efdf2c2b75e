"""The sampler's fake quantisation (gspo.core.quantize) against values worked out by hand."""

import pytest
import torch

from gspo.core.quantize import FORMATS, fake_quantize, quantize_weights, quantized
from gspo.models.presets import build_model


def test_int8_rounds_each_row_to_its_own_scale():
    w = torch.tensor([[1.0, -0.5, 0.3],
                      [0.0, 0.0, 0.0],
                      [-2.54, 0.01, 1.0]], dtype=torch.float64)
    q = fake_quantize(w, "int8")
    # row 0: s = 1/127; 0.3·127 = 38.1 -> 38; -0.5·127 = -63.5 -> -64 (half to even)
    assert q[0].tolist() == pytest.approx([1.0, -64 / 127, 38 / 127], abs=1e-15)
    assert q[1].tolist() == [0.0, 0.0, 0.0]                   # an all-zero row stays zero
    # row 2: s = 2.54/127 = 0.02; 0.01/0.02 = 0.5 -> 0; 1.0/0.02 = 50 -> 50
    assert q[2].tolist() == pytest.approx([-2.54, 0.0, 1.0], abs=1e-12)
    assert q.dtype == torch.float64


def test_int4_rounds_each_row_to_15_levels_of_its_own_scale():
    w = torch.tensor([[3.5, -1.25, 0.75, 0.2],
                      [1.75, 0.375, -0.625, 0.0]], dtype=torch.float64)
    q = fake_quantize(w, "int4")
    # row 0: s = 3.5/7 = 0.5; -1.25/0.5 = -2.5 -> -2 (half to even) = -1.0; 0.75/0.5 = 1.5 -> 2 = 1.0;
    # 0.2/0.5 = 0.4 -> 0
    assert q[0].tolist() == [3.5, -1.0, 1.0, 0.0]
    # row 1: s = 1.75/7 = 0.25; 0.375/0.25 = 1.5 -> 2 = 0.5; -0.625/0.25 = -2.5 -> -2 = -0.5
    assert q[1].tolist() == [1.75, 0.5, -0.5, 0.0]
    # int8 holds the same rows far closer: row 0's s = 3.5/127; -1.25·127/3.5 = -45.36 -> -45
    assert fake_quantize(w, "int8")[0, 1].item() == pytest.approx(-45 * 3.5 / 127, abs=1e-15)


def test_int4_moves_a_weight_by_half_a_level_at_most():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    step = w.abs().amax(dim=-1, keepdim=True) / 7                                 # [16, 1]
    moved = (fake_quantize(w, "int4") - w).abs()
    assert (moved <= step / 2 + 1e-6).all() and moved.max() > step.min() / 4
    assert fake_quantize(w, "int4").unique().numel() <= 16 * 15                   # 15 levels a row


def test_fp8_casts_through_e4m3_with_one_scale_per_matrix():
    w = torch.tensor([[448.0, 0.3], [-3.3, 1.0]])
    # max |w| = 448: scale 1. e4m3 holds 1.mmm · 2^e: 0.3 = 1.2 · 2^-2 -> 1.25 · 2^-2 = 0.3125;
    # 3.3 = 1.65 · 2^1 -> 1.625 · 2 = 3.25; 1.0 and 448 exact
    assert fake_quantize(w, "fp8").tolist() == [[448.0, 0.3125], [-3.25, 1.0]]
    # the same matrix scaled by 1/4: the scale is 112/448 = 1/4, so the values scale with it
    assert fake_quantize(w / 4, "fp8").tolist() == [[112.0, 0.078125], [-0.8125, 0.25]]


def test_a_stack_of_expert_matrices_has_a_scale_per_expert():
    w = torch.stack([torch.tensor([[448.0, 0.3]]), torch.tensor([[4.48, 0.003]])])   # [E=2, 1, 2]
    q = fake_quantize(w, "fp8")
    assert q[0].tolist() == [[448.0, 0.3125]]
    assert q[1, 0].tolist() == pytest.approx([4.48, 0.003125], rel=1e-6)             # scale 0.01
    r = fake_quantize(w, "int8")
    assert r[1, 0].tolist() == pytest.approx([4.48, 0.0], abs=1e-7)                 # 0.003·127/4.48 -> 0


def test_which_weights_are_quantised():
    model, _ = build_model("tiny-moe", 0)
    named = dict(model.named_parameters())
    chosen = sorted(n.split("layers.0.")[-1] for n, t in named.items()
                    if quantized(n, t) and ".layers.0." in n)
    assert chosen == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj", "self_attn.k_proj.weight",
                      "self_attn.o_proj.weight", "self_attn.q_proj.weight", "self_attn.v_proj.weight"]
    assert not quantized("model.embed_tokens.weight", named["model.embed_tokens.weight"])
    assert not quantized("model.layers.0.mlp.gate.weight", named["model.layers.0.mlp.gate.weight"])
    out = quantize_weights(named, "int8")
    assert out["model.norm.weight"] is named["model.norm.weight"]                   # not copied
    q = named["model.layers.0.self_attn.q_proj.weight"]
    moved = (out["model.layers.0.self_attn.q_proj.weight"] - q).abs()
    step = q.abs().amax(dim=-1, keepdim=True) / 127
    assert 0 < moved.max() and (moved <= step / 2 + 1e-7).all()                     # half a level at most
    assert not q.requires_grad or out["model.layers.0.self_attn.q_proj.weight"].grad_fn is None


def test_unknown_format_lists_the_formats():
    assert FORMATS.names() == ["fp8", "int4", "int8"]
    with pytest.raises(ValueError, match="unknown rollout quantisation format 'int2'.*fp8, int4, int8"):
        fake_quantize(torch.ones(2, 2), "int2")


def test_the_config_accepts_each_format_and_refuses_others():
    from gspo.config.rollout import RolloutConfig
    assert [RolloutConfig(quantize=f).quantize for f in FORMATS.names()] == ["fp8", "int4", "int8"]
    assert RolloutConfig().quantize is None
    with pytest.raises(ValueError, match="unknown rollout.quantize format 'int2'.*valid: fp8, int4, int8"):
        RolloutConfig(quantize="int2")


# ----------------------------------------------------------------- the quantised sampler
@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_the_hf_sampler_copy_is_rounded_at_build_and_at_every_update(fmt):
    from gspo.models.presets import build_char_tokenizer
    from gspo.rollout import engines
    model, _ = build_model("tiny-moe", 0)
    engine = engines.build("hf", model, build_char_tokenizer(), quantize=fmt)
    assert engine.module is not model and engine.owns_copy
    name = "model.layers.0.self_attn.q_proj.weight"
    sampler, policy = dict(engine.module.named_parameters()), dict(model.named_parameters())
    assert torch.equal(sampler[name], fake_quantize(policy[name].detach(), fmt))
    assert not torch.equal(sampler[name], policy[name])
    experts = "model.layers.0.mlp.experts.gate_up_proj"
    assert torch.equal(sampler[experts], fake_quantize(policy[experts].detach(), fmt))
    router = "model.layers.0.mlp.gate.weight"
    assert torch.equal(sampler[router], policy[router])                 # routers stay exact
    with torch.no_grad():
        policy[name].add_(0.01)                                         # "an optimizer step"
    engine.update_weights(model.state_dict(), 1)
    assert torch.equal(sampler[name], fake_quantize(policy[name].detach(), fmt)) and engine.version == 1


def test_a_quantised_sampler_is_a_measured_mismatch(make_cfg, reward_module):
    """rollout.quantize=int8 through the trainer: the sampler's log-probs differ from the
    trainer's (mismatch/* logged with no correction), more than a float32 sampler's (zero)."""
    from conftest import parity_rewards
    from gspo.observe.metrics import read_metrics
    from gspo.training.trainer import Trainer
    cfg = make_cfg("sft.enabled=false", parity_rewards(reward_module), "train.steps=1",
                   "rollout.quantize=int8")        # no correction, no flag: measured all the same
    Trainer(cfg, log=lambda m: None).run()
    row = read_metrics(cfg.run.dir)[1]
    assert row["mismatch/token_abs_max"] > 1e-3 and row["mismatch/kl"] > 1e-7
    assert 0 <= row["mismatch/ratio_above_2_frac"] <= 1 and 0 <= row["mismatch/ratio_below_half_frac"] <= 1


def test_r3_with_a_quantised_sampler_replays_the_samplers_experts(make_cfg, reward_module):
    """moe.routing_replay=rollout with rollout.quantize=int8 (wide-moe): the experts the sampler
    copy routed to are recorded at generation, and the trainer's forward under replay runs
    exactly those, where its own router would have chosen others for some tokens."""
    from conftest import parity_rewards
    from gspo.models import moe
    from gspo.training.trainer import Trainer
    cfg = make_cfg("sft.enabled=false", parity_rewards(reward_module), "model.preset=wide-moe",
                   "rollout.quantize=int8", "moe.routing_replay=rollout")
    trainer = Trainer(cfg, log=lambda m: None)
    trainer.setup()
    batch = trainer.collector.generate(trainer.train_set[:4], seed=1)
    sampled = batch.routing                                              # [N, L, layers, k]
    assert trainer.collector.engine.module is not trainer.model
    model, ids, attn = trainer.model, batch.input_ids, batch.attention_mask
    T = batch.response_mask.shape[1]
    with torch.no_grad(), moe.replay_routing(model, sampled), moe.capture_routing(model) as used:
        model(input_ids=ids, attention_mask=attn)
    assert torch.equal(used.routing, sampled)                            # the sampler's experts
    with torch.no_grad(), moe.capture_routing(model) as own:
        model(input_ids=ids, attention_mask=attn)
    rate, _ = moe.routing_change_rate(moe.response_routing(sampled, T),
                                      moe.response_routing(own.routing, T), batch.response_mask)
    assert rate > 0                                                      # the precision moved routing


def test_a_moe_sampler_copy_logs_its_routing_disagreement_with_the_trainer(make_cfg, reward_module):
    """wide-moe with an fp8 sampler (no replay): moe/sampler_trainer_disagreement every step, the
    share of (token, layer) pairs whose experts differ between the copy and the trainer; a float32
    policy sampled by itself logs none."""
    from conftest import parity_rewards
    from gspo.observe.metrics import read_metrics
    from gspo.training.trainer import Trainer
    cfg = make_cfg("sft.enabled=false", parity_rewards(reward_module), "model.preset=wide-moe",
                   "rollout.quantize=fp8", "train.steps=2", run="fp8")
    Trainer(cfg, log=lambda m: None).run()
    rows = read_metrics(cfg.run.dir)[1:]
    assert all(0 < r["moe/sampler_trainer_disagreement"] < 1 for r in rows)
    plain = make_cfg("sft.enabled=false", parity_rewards(reward_module), "model.preset=wide-moe",
                     "train.steps=1", run="plain")
    Trainer(plain, log=lambda m: None).run()
    assert "moe/sampler_trainer_disagreement" not in read_metrics(plain.run.dir)[1]
