"""train.rollout_correction and rollout.dtype in the trainer: a float32 sampler has no mismatch,
a bfloat16 sampler has one (mismatch/* > 0), and the correction's mask really leaves the loss."""

import pytest

from conftest import parity_rewards
from gspo.config import ConfigError, load_config
from gspo.observe.metrics import read_metrics
from gspo.training.trainer import Trainer


def run_row(make_cfg, reward_module, *overrides, run="run"):
    cfg = make_cfg("sft.enabled=false", parity_rewards(reward_module), "train.steps=1", *overrides,
                   run=run)
    Trainer(cfg, log=lambda m: None).run()
    return read_metrics(cfg.run.dir)[1]


@pytest.mark.parametrize("objective", ["gspo", "grpo"])   # advantages [N] (row mean) | [N, T]
def test_same_precision_sampler_has_no_mismatch(make_cfg, reward_module, objective):
    row = run_row(make_cfg, reward_module, "train.rollout_correction.mode=tis",
                  f"objective.name={objective}")
    assert 0 <= row["mismatch/kl"] < 1e-8
    assert row["mismatch/ratio_min"] == pytest.approx(1, abs=1e-3)
    assert row["mismatch/ratio_max"] == pytest.approx(1, abs=1e-3)
    assert row["mismatch/masked_frac"] == 0
    assert row["mismatch/is_weight_mean"] == pytest.approx(1, abs=1e-4)


def test_bfloat16_sampler_is_a_measured_mismatch(make_cfg, reward_module):
    row = run_row(make_cfg, reward_module, "rollout.dtype=bfloat16",
                  "train.rollout_correction.mode=icepop", "train.rollout_correction.low=0.999",
                  "train.rollout_correction.high=1.001")
    assert row["mismatch/kl"] > 1e-7
    assert row["mismatch/ratio_min"] < 0.999 or row["mismatch/ratio_max"] > 1.001
    assert 0 < row["mismatch/masked_frac"] < 1
    assert row["mismatch/token_abs_max"] > 1e-3          # the older diagnostic sees it too


def test_mode_none_measures_and_a_full_mask_empties_the_loss(make_cfg, reward_module):
    row = run_row(make_cfg, reward_module, "rollout.dtype=bfloat16", "train.log_rollout_logprobs=true")
    assert row["mismatch/kl"] > 0 and row["mismatch/masked_frac"] == 0   # none: measured only
    row = run_row(make_cfg, reward_module, "train.rollout_correction.mode=seq_mask",
                  "train.rollout_correction.low=5", "train.rollout_correction.high=10", run="masked")
    assert row["mismatch/masked_frac"] == 1
    assert row["policy/loss"] == 0


def test_config_refusals():
    with pytest.raises(ConfigError, match="needs train.old_logprobs=recompute"):
        load_config(None, ["train.rollout_correction.mode=tis", "train.old_logprobs=rollout"])
    with pytest.raises(ConfigError, match="has no parameter 'cap'; valid: low, high"):
        load_config(None, ["train.rollout_correction.mode=icepop", "train.rollout_correction.cap=3"])
    with pytest.raises(ConfigError, match="did you mean 'seq_tis'"):
        load_config(None, ["train.rollout_correction.mode=seqtis"])
    # R3 with a sampler copy (bf16 or quantised): its own experts are captured and replayed
    for copy in ("rollout.dtype=bfloat16", "rollout.quantize=fp8"):
        assert load_config(None, ["model.preset=tiny-moe", "moe.routing_replay=rollout", copy]).moe.routing_replay == "rollout"
    with pytest.raises(ConfigError, match="gspo audit. does not re-derive yet: use audit.every=0"):
        load_config(None, ["train.rollout_correction.mode=seq_tis", "audit.every=1"])
    assert load_config(None, []).train.rollout_correction.mode == "none"
