"""The field's comparison points as config (issue 19): presets (dapo, dr_grpo) expanding into
config values, the rloo estimator through the trainer's advantage path (drops included), the
zero-at-Â=0 registry flag gating row skipping, and short end-to-end runs of luspo + rloo, online
DPO, and a rollout record audited under rloo + luspo."""

import dataclasses
import types

import pytest
import torch

from gspo.tools import audit
from gspo import objective_presets as presets
from gspo.training.algorithms import GroupRelative, OnlineDPO, get
from gspo.core import objectives
from gspo.core.advantages import group_advantages, rloo_advantages
from gspo.core.trajectory import dropped_rows
from gspo.config import ConfigError, dump_yaml, load_config
from gspo.observe.metrics import read_metrics
from gspo.rollout.data import build_task
from gspo.training.cold_start import initial_policy
from gspo.training.step import skips_rows
from gspo.training.trainer import Trainer
from conftest import parity_rewards


# ----------------------------------------------------------------------------- presets

def test_dapo_preset_expands_into_the_resolved_config(tmp_path):
    cfg = load_config(None, ["objective.preset=dapo"])
    o, a, t = cfg.objective, cfg.advantage, cfg.train
    assert (o.name, o.eps_low, o.eps_high, o.aggregation) == ("grpo", 0.2, 0.28, "token-mean")
    assert (a.estimator, a.scale) == ("group", "group")
    assert t.dynamic_sampling and t.mask_truncated and t.beta == 0.0
    # the run's config.yaml holds the expanded values; reading it back changes nothing
    dump_yaml(cfg, tmp_path / "config.yaml")
    text = (tmp_path / "config.yaml").read_text()
    assert "preset: dapo" in text and "eps_high: 0.28" in text and "dynamic_sampling: true" in text
    assert load_config(tmp_path / "config.yaml") == cfg


def test_dr_grpo_preset_and_explicit_keys_win():
    cfg = load_config(None, ["objective.preset=dr_grpo"])
    assert (cfg.objective.name, cfg.objective.aggregation) == ("grpo", "seq-mean-token-sum-norm")
    assert (cfg.objective.eps_low, cfg.objective.eps_high) == (0.2, 0.2)
    assert cfg.advantage.scale == "none" and cfg.train.beta == 0.0
    mixed = load_config(None, ["objective.preset=dapo", "objective.eps_high=0.3",
                               "train.dynamic_sampling=false", "objective.name=gspo"])
    assert (mixed.objective.name, mixed.objective.eps_high) == ("gspo", 0.3)    # explicit keys win
    assert not mixed.train.dynamic_sampling and mixed.objective.eps_low == 0.2  # the rest expands


def test_preset_override_replaces_the_config_files_keys(tmp_path):
    # configs/default.yaml names objective.name: gspo; objective.preset=dapo on the command line
    # stands for DAPO's overrides at its place: over the file, under later overrides
    cfg = load_config("configs/default.yaml", ["objective.preset=dapo", "objective.eps_high=0.3"])
    assert (cfg.objective.name, cfg.objective.aggregation) == ("grpo", "token-mean")
    assert (cfg.objective.eps_low, cfg.objective.eps_high) == (0.2, 0.3)
    earlier = load_config("configs/default.yaml", ["objective.eps_high=0.3", "objective.preset=dapo"])
    assert earlier.objective.eps_high == 0.28
    # in a YAML file the preset fills what the file leaves unset
    (tmp_path / "c.yaml").write_text("objective: {preset: dapo, name: gspo, eps_high: 0.3}\n")
    in_file = load_config(tmp_path / "c.yaml")
    assert (in_file.objective.name, in_file.objective.eps_high) == ("gspo", 0.3)
    assert in_file.objective.aggregation == "token-mean" and in_file.train.dynamic_sampling


def test_preset_errors_are_one_line_and_expand_leaves_its_input_alone():
    with pytest.raises(ConfigError, match=r"objective\.preset: unknown objective preset 'dap'; "
                                          r"did you mean 'dapo'\?"):
        load_config(None, ["objective.preset=dap"])
    tree = {"objective": {"preset": "dr_grpo"}, "train": {"beta": 0.5}}
    out = presets.expand(tree)
    assert tree == {"objective": {"preset": "dr_grpo"}, "train": {"beta": 0.5}}   # not edited
    assert out["train"]["beta"] == 0.5 and out["advantage"]["scale"] == "none"
    assert presets.expand(out) == out                                           # idempotent
    assert presets.expand({"objective": {"name": "gspo"}}) == {"objective": {"name": "gspo"}}
    assert presets.available() == ["dapo", "dr_grpo"]
    assert "2503.14476" in presets.get("dapo").paper and "overlong" in presets.get("dapo").missing
    assert "2503.20783" in presets.get("dr_grpo").paper
    with pytest.raises(ValueError, match="dotted"):
        presets.register("bad", {"beta": 0.1}, paper="none")


def test_every_preset_key_is_a_config_field():
    for name in presets.available():
        cfg = load_config(None, [f"objective.preset={name}"])
        for key, value in presets.get(name).values.items():
            section, field = key.split(".")
            assert getattr(getattr(cfg, section), field) == value, (name, key)


# ----------------------------------------------------------------------------- rloo in config

def test_rloo_is_selected_by_config_and_handles_drops():
    cfg = load_config(None, ["advantage.estimator=rloo", "rollout.group_size=4"])
    assert cfg.advantage.scale == "none"                     # its paper's, written into the config
    assert load_config(None, ["advantage.estimator=rloo", "advantage.scale=group"]).advantage.scale \
        == "group"
    assert load_config(None, []).advantage.scale == "group"  # the group estimator as before
    with pytest.raises(ConfigError, match="did you mean 'rloo'"):
        load_config(None, ["advantage.estimator=rlooo"])
    with pytest.raises(ConfigError, match="rloo takes advantage.scale none or group"):
        load_config(None, ["advantage.estimator=rloo", "advantage.scale=batch"])
    # the step's path: mark the dropped rows, then GroupRelative → rloo; a NaN reward is dropped
    # group (1, NaN, 0, 0.5): Â = (0.75, 0, −0.75, 0), the dropped row marked for the loss mask
    batch = types.SimpleNamespace(dropped=None)
    rewards = torch.tensor([1.0, float("nan"), 0.0, 0.5, 1, 0, 0, 0])
    batch.dropped = dropped_rows(rewards)
    adv = GroupRelative(cfg).advantages(batch, rewards)
    assert adv.tolist() == pytest.approx([0.75, 0, -0.75, 0, 1, -1 / 3, -1 / 3, -1 / 3])
    assert batch.dropped.tolist() == [False, True] + [False] * 6
    clean = torch.tensor([1.0, 0, 0, 0, 3, 1, 2, 6])
    torch.testing.assert_close(GroupRelative(cfg).advantages(types.SimpleNamespace(dropped=None), clean),
                               rloo_advantages(clean, 4))


# ----------------------------------------------------------------------------- the skip flag

def test_row_skipping_follows_the_objective_flag(fresh, monkeypatch):
    t = fresh("rollout.prompts_per_step=4", "rollout.group_size=4")
    batch, rewards, _ = t.collector.collect(0)
    adv = group_advantages(torch.tensor([1.0, 0, 0, 0] * 4), 4)
    adv.view(-1, 4)[::2] = 0.0                                            # groups 0, 2: no signal
    assert t.step.plan(batch, adv, 0).skipped == 8
    real = objectives.spec                                                # an objective not ∝ Â:
    monkeypatch.setattr(objectives, "spec",
                        lambda n: dataclasses.replace(real(n), zero_at_zero_advantage=False))
    t.step.skips_rows = skips_rows(t.cfg, "gspo", None)
    assert not t.step.skips_rows and t.step.plan(batch, adv, 0).skipped == 0


# ----------------------------------------------------------------------------- end to end

def _moved(a, b) -> bool:
    return any(not torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_luspo_with_rloo_trains_and_audits(make_cfg, reward_module, capsys):
    cfg = make_cfg(parity_rewards(reward_module), "objective.name=luspo", "advantage.estimator=rloo",
                   "objective.eps_low=0.2", "objective.eps_high=0.2", "audit.every=2",
                   "train.lr=1e-3")
    trainer = Trainer(cfg, log=lambda m: None)
    trainer.run()
    rows = read_metrics(cfg.run.dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all("policy/loss" in r and "policy/clip_frac_seqs" in r for r in rows[1:])
    cold, _, _ = initial_policy(cfg, build_task(cfg), log=lambda m: None, progress=False)
    assert _moved(cold, trainer.model)
    assert audit.run_audit(cfg.run.dir, out=lambda s: None)             # rloo advantages, luspo loss


def test_online_dpo_trains_against_the_cold_start(make_cfg, reward_module):
    cfg = make_cfg(parity_rewards(reward_module), "objective.name=dpo", "dpo.beta=0.5",
                   "train.minibatches=1", "train.steps=2", "train.lr=1e-3")
    assert get("dpo") is OnlineDPO
    trainer = Trainer(cfg, log=lambda m: None)
    trainer.run()
    rows = read_metrics(cfg.run.dir)
    first, second = rows[1], rows[2]
    assert first["dpo/pairs"] > 0 and first["dpo/pairs"] + first["dpo/groups_without_pair"] == 4
    # step 1, one minibatch: the policy IS the reference: margin 0 and loss ln 2 (float32 forwards
    # of the same rows in another order)
    assert first["dpo/margin"] == pytest.approx(0.0, abs=1e-4)
    assert first["dpo/loss"] == pytest.approx(0.6931472, abs=1e-4)
    assert second["dpo/margin"] != pytest.approx(0.0, abs=1e-6)        # the policy left the reference
    assert first["optim/skipped_nonfinite"] == 0                       # the RL step's counter
    cold, _, _ = initial_policy(cfg, build_task(cfg), log=lambda m: None, progress=False)
    assert _moved(cold, trainer.model)
    assert not _moved(cold, trainer.algorithm.ref)                     # the reference stays the cold start
    assert "policy/loss" not in second


def test_online_dpo_pairs_skip_dropped_and_masked_rows(fresh):
    t = fresh("objective.name=dpo", "rollout.prompts_per_step=2", "rollout.group_size=4")
    batch, _, _ = t.collector.collect(0)
    nan = float("nan")
    rewards = torch.tensor([nan, 1.0, 0.0, 0.5, 2.0, 2.0, 2.0, 2.0])
    win, lose, _ = t.algorithm.pairs(batch, rewards)
    assert win.tolist() == [1] and lose.tolist() == [2]                 # group 1 has no difference
    batch.response_mask[1] = 0                                          # e.g. a masked truncation
    win, lose, _ = t.algorithm.pairs(batch, rewards)
    assert win.tolist() == [3] and lose.tolist() == [2]
