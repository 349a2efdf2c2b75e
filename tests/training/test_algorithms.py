"""The baselines in the trainer (gspo.training.algorithms): PPO with a critic and continued SFT, on tiny-dense.

Rewards: the first-character-parity reward of conftest (varies inside groups for an untrained
model). One shared PPO run is checked for metrics, moved weights (policy and critic), critic files
in the checkpoint, and an exact resume from its step-1 checkpoint."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from gspo.training import algorithms
from gspo.config import ConfigError, load_config
from gspo.observe.metrics import read_metrics
from gspo.models.presets import load_model
from gspo.rollout.data import build_task
from gspo.training.cold_start import initial_policy
from gspo.training.trainer import Trainer
from gspo.core.value import Critic

PPO_KEYS = ["value/loss", "value/explained_variance", "value/mean", "value/clip_frac",
            "value/returns_mean", "policy/loss", "policy/clip_frac_tokens", "policy/ratio_mean",
            "value/skipped_nonfinite"]


def _parity(reward_module: str) -> str:
    return f"rewards.sources=[{{type: function, fn: '{reward_module}'}}]"


def _ckpt(run, step: int):
    return run / "checkpoints" / f"step_{step:06d}"


def test_terminal_rewards_on_the_last_response_token():
    # row 0 ends with EOS at t=2, row 1 is truncated (last token t=3), row 2 empty (dropped)
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    got = algorithms.terminal_rewards(torch.tensor([1.0, 0.5, 1.0]), mask)
    assert got.tolist() == [[0, 0, 1, 0], [0, 0, 0, 0.5], [0, 0, 0, 0]]


def test_objective_names_include_the_baselines():
    assert {"ppo", "sft", "gspo", "grpo"} <= set(algorithms.names())
    assert algorithms.get("gspo") is algorithms.GroupRelative
    assert algorithms.get("ppo") is algorithms.PPO and algorithms.get("sft") is algorithms.SFTBaseline
    with pytest.raises(ConfigError, match="did you mean 'ppo'"):
        load_config(None, ["objective.name=ppp"])
    with pytest.raises(ConfigError, match="no hyper-parameter"):
        load_config(None, ["objective.name=sft", "objective.params={tau_pos: 1.0}"])


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory, small_config, reward_module):
    root = tmp_path_factory.mktemp("ppo")
    overrides = ["objective.name=ppo", "run.save_every=1", _parity(reward_module),
                 "ppo.critic_lr=1e-3"]
    cfg = small_config(root, *overrides)
    trainer = Trainer(cfg, log=lambda m: None)
    summary = trainer.run()
    return dict(root=root, cfg=cfg, overrides=overrides, trainer=trainer, summary=summary,
                rows=read_metrics(cfg.run.dir), run=root / "run")


def test_ppo_logs_value_metrics(ppo_run):
    rows = ppo_run["rows"]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        missing = [k for k in PPO_KEYS if k not in row]
        assert not missing, f"step {row['step']} lacks {missing}"
        assert 0 <= row["value/clip_frac"] <= 1 and row["value/loss"] >= 0
        assert row["value/explained_variance"] <= 1
    assert rows[1]["policy/ratio_mean"] == pytest.approx(1.0, abs=0.05)


def test_ppo_moves_policy_and_critic(ppo_run, small_config):
    cfg, trainer = ppo_run["cfg"], ppo_run["trainer"]
    cold, _, _ = initial_policy(cfg, build_task(cfg), log=lambda m: None, progress=False)
    fresh = Critic.from_policy(cold, seed=cfg.seed)                      # the run's starting critic
    moved = lambda a, b: any(not torch.equal(x, y) for x, y in zip(a, b))  # noqa: E731
    assert moved(cold.parameters(), trainer.model.parameters())
    assert moved(fresh.decoder.parameters(), trainer.algorithm.critic.decoder.parameters())
    assert moved(fresh.head.parameters(), trainer.algorithm.critic.head.parameters())


def test_ppo_checkpoint_holds_the_critic(ppo_run):
    ckpt = _ckpt(ppo_run["run"], 2)
    sums = json.loads((ckpt / "checksums.json").read_text())
    assert set(algorithms.CRITIC_FILES) <= set(sums)               # verified on resume
    saved = load_file(str(ckpt / "critic.safetensors"))
    live = ppo_run["trainer"].algorithm.critic.state_dict()
    assert saved.keys() == live.keys() and all(torch.equal(saved[k], live[k]) for k in saved)
    load_model(ckpt)                                               # the policy stays a plain LM


def test_ppo_resume_restores_the_critic_exactly(ppo_run, small_config):
    """Resume from the step-1 checkpoint: step 2 reproduces the straight run, critic included."""
    run = ppo_run["root"] / "exact"
    shutil.copytree(ppo_run["run"], run)
    shutil.rmtree(_ckpt(run, 2))
    (run / "summary.json").unlink()
    cfg = small_config(ppo_run["root"], *ppo_run["overrides"], run="exact")
    logs = []
    trainer = Trainer(cfg, resume=True, log=logs.append)
    trainer.run()
    assert any("(step 1)" in line for line in logs)
    strip = lambda row: {k: v for k, v in row.items() if not k.startswith("time/")}  # noqa: E731
    assert strip(read_metrics(run)[2]) == strip(ppo_run["rows"][2])
    a = load_file(str(_ckpt(run, 2) / "critic.safetensors"))
    b = load_file(str(_ckpt(ppo_run["run"], 2) / "critic.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_ppo_kl_in_reward_and_beta(make_cfg, reward_module):
    cfg = make_cfg("objective.name=ppo", "ppo.kl_in_reward=true", "ppo.kl_coef=0.1",
                   "train.beta=0.01", "train.steps=1", _parity(reward_module))
    trainer = Trainer(cfg, log=lambda m: None)
    trainer.run()
    assert trainer.algorithm.ref is trainer.ref_model              # one reference model
    row = read_metrics(cfg.run.dir)[1]
    assert row["ppo/kl_reward"] == pytest.approx(0.0, abs=1e-5)    # π_old = π_ref at step 1
    assert "policy/kl_ref" in row


def test_sft_baseline_runs_at_the_rl_token_budget(make_cfg, reward_module):
    cfg = make_cfg("objective.name=sft", "train.steps=2", "run.save_every=1", _parity(reward_module))
    trainer = Trainer(cfg, log=lambda m: None)
    summary = trainer.run()
    rows = read_metrics(cfg.run.dir)
    assert [r["step"] for r in rows] == [0, 1, 2] and summary["objective"] == "sft"
    for row in rows[1:]:
        assert row["sft/loss"] > 0 and "reward/mean" in row and "policy/loss" not in row
        assert row["optim/skipped_nonfinite"] == 0      # the RL step's non-finite handling
        # demonstrations sized to the rollouts' response tokens: within half a demonstration
        assert abs(row["sft/tokens"] - row["sft/rl_tokens"]) <= cfg.rollout.max_new_tokens / 2
    assert rows[2]["optim/lr"] == pytest.approx(cfg.train.lr)
    cold, _, _ = initial_policy(cfg, build_task(cfg), log=lambda m: None, progress=False)
    assert any(not torch.equal(a, b) for a, b in zip(cold.parameters(), trainer.model.parameters()))
    state = json.loads((_ckpt(trainer.run_dir, 2) / "trainer_state.json").read_text())
    assert state["algorithm"]["demo_cursor"]["index"] > 0       # resumable demonstration order


def test_sft_draw_matches_tokens(make_cfg, reward_module):
    cfg = make_cfg("objective.name=sft", _parity(reward_module))
    trainer = Trainer(cfg, log=lambda m: None)
    trainer.setup()
    algo = trainer.algorithm
    for budget in (1, 7, 40):
        picked = algo.draw(budget)
        total = sum(algo._length(i) for i in picked)
        assert picked and abs(total - budget) <= max(algo._length(i) for i in picked) / 2 + 0.5


def test_dense_comparison_suite_lists_the_baselines():
    import yaml
    suite = yaml.safe_load(open("configs/compare/dense.yaml"))
    names = [v["name"] for v in suite["variants"]]
    assert {"gspo", "ppo", "sft"} <= set(names) and len(names) == len(set(names))
    for variant in suite["variants"]:                # every variant is a valid train config
        shared = [*suite["base"]["overrides"], *suite.get("overrides", [])]
        cfg = load_config(suite["base"]["config"], [*shared, *variant["overrides"]])
        assert cfg.objective.name == variant["name"]
