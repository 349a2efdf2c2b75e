"""The reset/step episode in training: a GEM-shaped game (tests/game_fakes.py) plays every row with
the tiny model, its own reward reaches the loss through ``rewards.sources: [{type: env}]``, and a
game that cannot reset is one line at set-up."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gspo.envs.guard import EnvError
from gspo.observe.metrics import read_metrics
from gspo.training.trainer import Trainer

GAME = ["rollout.episode=reset_step", "multiturn.params={make: game_fakes:GymGame, protocol: gym}",
        "multiturn.on_env_error=end", "multiturn.max_turns=3", "multiturn.max_total_tokens=96", "rollout.max_new_tokens=16",
        "rewards.sources=[{type: env}]", "rewards.on_error=zero", "sft.enabled=false"]


def test_a_game_trains_on_its_own_reward(make_cfg):
    cfg = make_cfg(*GAME)
    Trainer(cfg, log=lambda m: None).run()
    steps = [r for r in read_metrics(cfg.run.dir) if "reset_step/unfinished" in r]
    assert len(steps) == 2
    for row in steps:       # 16 rows: 4 prompts x 4; the untrained model rarely closes a turn, and
        # a row whose game got no closed turn has no reward (counted, scored 0: rewards.on_error)
        assert row["multiturn/env_errors_mean"] == 0 and row["reward/errors"] <= 16
        assert (row["reward/mean"] * 16 / 0.25) % 1 == 0       # sums of the game's steps: -0.25 | 1
    assert any(row["multiturn/turns_mean"] > 1 for row in steps)         # the game answered
    assert any(row["reward/std"] > 0 for row in steps)                    # a signal for the loss


def test_a_game_that_cannot_reset_is_one_line_at_set_up(make_cfg):
    cfg = make_cfg(*GAME[:1], "multiturn.params={make: game_fakes:BadReset, protocol: gym}", *GAME[2:])
    with pytest.raises(EnvError, match="failed in make or reset .*RuntimeError: no board") as err:
        Trainer(cfg, log=lambda m: None)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_a_game_trains_under_the_async_worker(make_cfg, monkeypatch, worker):
    """rollout.async: the episode (its guard, its params) goes to the worker, a thread or a process
    of its own that imports the game there."""
    tests = str(Path(__file__).parents[1])
    monkeypatch.setenv("PYTHONPATH", f"{tests}:{os.environ.get('PYTHONPATH', '')}")
    cfg = make_cfg(*GAME, "rollout.async=true", f"rollout.async_worker={worker}", run=worker)
    Trainer(cfg, log=lambda m: None).run()
    steps = [r for r in read_metrics(cfg.run.dir) if "reset_step/unfinished" in r]
    assert len(steps) == 2 and all(r["multiturn/env_errors_mean"] == 0 for r in steps)
