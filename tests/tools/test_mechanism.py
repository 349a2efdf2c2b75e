"""`gspo mechanism`: per-response gradients against the whole batch's, the objectives' equality
on-policy, router noise, the verdicts, and the command on a checkpoint (micro models: fast)."""

import pytest
import torch

from conftest import parity_rewards
from gspo.cli import main
from gspo.core import objectives
from gspo.models.presets import build_model, save_model
from gspo.tools import mechanism as mech

MICRO = {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 48}
MICRO_MOE = {**MICRO, "moe_intermediate_size": 16}


@pytest.fixture(scope="module")
def micro():
    model, tok = build_model("tiny-dense", 0, MICRO)
    return model.eval(), tok


@pytest.fixture
def probe(micro, make_cfg, reward_module):
    cfg = make_cfg(parity_rewards(reward_module), "rollout.group_size=4", "train.minibatches=2")
    return cfg, mech.sample_probe(micro[0], micro[1], cfg, prompts=2, seed=0)


def test_per_response_gradients_sum_to_the_batch_gradient(micro, probe):
    # Σ_i g_i must be the gradient of Σ_i ℓ_i computed in one backward over the whole batch, at a
    # moved policy (one AdamW step) where GSPO's and GRPO's weights differ.
    cfg, p = probe
    assert (p.advantages != 0).any()
    _, moved = next(mech.drift(micro[0], p, (1,), lr=1e-2, grad_clip=1.0, seed=0))
    logp = mech.logprobs(moved, p)
    params = [q for q in moved.parameters() if q.requires_grad]
    for name in ("gspo", "grpo"):
        c, _ = mech.token_loss_weights(name, logp, p.old_logp, p.advantages, p.response_mask)
        per_row = mech.response_gradients(moved, p, {name: c})[name].sum(0)       # [D]
        loss, _ = objectives.get(name)(mech.logprobs(moved, p, grad=True), p.old_logp,
                                       p.advantages, p.response_mask, num_seqs=1.0)
        whole = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])
        assert torch.allclose(per_row, whole, rtol=1e-4, atol=1e-6)


def test_objectives_agree_on_policy_and_part_after_a_step(micro, probe):
    # At k = 0 every ratio is exactly 1: the three objectives have the same weights -Â_i/|y_i|,
    # hence the same gradients and the same numbers.
    cfg, p = probe
    rows = mech.steps_axis(micro[0], p, cfg, seed=0, ks=(0, 1), log=lambda m: None)
    on = rows[0]
    assert on["gspo"] == on["grpo"] == on["gspo_token"]
    assert on["dispersion"]["seq_dev"] == 0.0 and on["gspo"]["clip_frac_seqs"] == 0.0
    assert rows[1]["dispersion"]["token_spread"] > 0


def test_router_noise_changes_only_routers_and_routing():
    model, tok = build_model("tiny-moe", 0, MICRO_MOE)
    noisy = mech.router_noise(model, 0.5, seed=0)
    routers = {layer.name for layer in mech.moe.moe_layers(model)}
    for (name, a), (_, b) in zip(model.named_parameters(), noisy.named_parameters()):
        assert torch.equal(a, b) != (name.removesuffix(".weight") in routers), name
    assert mech.router_noise(model, 0.0, seed=0).state_dict().keys() == model.state_dict().keys()


def test_gap_verdict_by_hand():
    # Paired gaps snr(gspo)/snr(grpo) of 1.5 and 1.7: mean 1.6, std 0.1414; 1.6 - 1 > 0.1414 -> 'yes'.
    # Gaps 0.5 and 0.7 -> 'no (the opposite)'; 0.9 and 1.3 (mean 1.1 ± 0.28) -> within the spread.
    def row(seed, grpo, gspo):
        return {"seed": seed, "axis": "steps", "level": 8, "grpo": {"snr": grpo}, "gspo": {"snr": gspo}}
    yes = mech.gap_verdict([row(0, 1.0, 1.5), row(1, 1.0, 1.7)])
    assert yes["gap"]["mean"] == pytest.approx(1.6) and yes["gap"]["std"] == pytest.approx(0.02 ** 0.5)
    assert yes["verdict"] == "yes"
    assert mech.gap_verdict([row(0, 2.0, 1.0), row(1, 1.0, 0.7)])["verdict"] == "no (the opposite)"
    assert mech.gap_verdict([row(0, 1.0, 0.9), row(1, 1.0, 1.3)])["verdict"] == "within the seed spread"
    assert mech.noise_gap(row(0, 0.0, 1.0)) is None
    assert mech.verdicts([row(0, 1.0, 1.5), row(1, 1.0, 1.7)])[0].endswith("**yes**")


def test_gspo_mechanism_on_a_checkpoint(micro, tmp_path, reward_module):
    ckpt = tmp_path / "ckpt"
    save_model(*micro, ckpt)
    (tmp_path / "c.yaml").write_text(
        "task: {name: arithmetic, n_train: 50, n_test: 10}\nrollout: {group_size: 4, max_new_tokens: 4}\n"
        f"rewards: {{sources: [{{type: function, fn: '{reward_module}'}}]}}\ntrain: {{minibatches: 2}}\n")
    out = tmp_path / "out"
    assert main(["mechanism", str(ckpt), "--config", str(tmp_path / "c.yaml"), "--seeds", "2",
                 "--prompts", "2", "--out", str(out)]) == 0
    table = (out / "mechanism.md").read_text()
    assert "| steps | 8 | no | 2 |" in table and "* steps = 8: snr gspo / snr grpo" in table
    assert main(["mechanism", str(tmp_path / "nowhere")]) == 2


def test_load_target_reads_a_run_folder_and_its_checkpoints(micro, tmp_path):
    # A run folder: its config.yaml and the newest of checkpoints/step_*; a checkpoint inside it:
    # the same config, found two folders up; a run folder without checkpoints: a clear error.
    from gspo.training.checkpoint import checkpoint_dir
    run = tmp_path / "run"
    for step in (2, 10):
        save_model(*micro, checkpoint_dir(run, step))
    (run / "config.yaml").write_text("rollout: {group_size: 4, max_new_tokens: 5}\n")
    cfg, model, _ = mech.load_target(run)
    assert cfg.rollout.max_new_tokens == 5 and not model.training
    cfg, _, _ = mech.load_target(checkpoint_dir(run, 2), overrides=["rollout.max_new_tokens=6"])
    assert cfg.rollout.max_new_tokens == 6
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no checkpoints"):
        mech.load_target(tmp_path / "empty")
