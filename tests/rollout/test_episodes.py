"""gspo.rollout.episodes: the single-turn episode is the engine's samples in rollout layout, and
the Collector samples through whatever episode it is handed (where a tool loop plugs in)."""

import pytest
import torch

from gspo.models.presets import build_model
from gspo.rollout import engines, episodes
from gspo.rollout.generate import SamplingParams, generate
from gspo.tasks import Example

PROMPTS = ["S 1 2:", "S 4 7 3:"]


def test_single_turn_is_generate_through_the_engine():
    model, tok = build_model("tiny-dense", 0)
    examples = [Example(prompt=p, answer="") for p in PROMPTS]
    params = SamplingParams(max_new_tokens=5)
    got = episodes.EPISODES.get("single_turn")()(engines.build("hf", model, tok), tok, examples, params,
                                      group_size=3, seed=4, with_logprobs=True)
    want = generate(model, tok, examples, params, group_size=3, with_logprobs=True, seed=4)
    for name in ("input_ids", "attention_mask", "response_mask", "truncated", "rollout_logp"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.completions == want.completions and got.examples == want.examples


def test_an_unknown_episode_names_the_valid_ones():
    with pytest.raises(ValueError, match="unknown episode 'tools'; valid episodes: agent, reset_step, single_turn, tool_loop"):
        episodes.build("tools", None)


def test_the_collector_samples_through_its_episode(fresh):
    """A second episode replaces the single turn without touching the Collector or the step."""
    t = fresh()
    calls = []

    def tagged(sampler, tokenizer, examples, params, **kwargs):
        calls.append((sampler is t.collector.engine, len(examples), kwargs["group_size"]))
        return episodes.SingleTurn()(sampler, tokenizer, examples, params, **kwargs)
    t.collector.episode = tagged
    batch, rewards, _ = t.collector.collect(0, version=0)
    P, G = t.cfg.rollout.prompts_per_step, t.cfg.rollout.group_size
    assert calls == [(True, P, G)] and len(rewards) == P * G and batch.version == 0


def test_a_new_episode_is_one_class_and_a_registry_line(monkeypatch, fresh):
    """Registered here, in the test module (into a copy of the registry): rollout.episode names
    it, the trainer builds it from the config, the collector samples through it and logs its
    metrics, and the config check asks it what it refuses."""
    from gspo.config import ConfigError, load_config
    monkeypatch.setattr(episodes.base, "EPISODES", episodes.EPISODES.copy())

    @episodes.register("counted")
    class Counted:
        metrics: dict = {}

        @classmethod
        def from_config(cls, cfg, task=None):
            return cls()

        @staticmethod
        def refuses(cfg):
            return "not with a tool" if cfg.multiturn.env else None

        def __call__(self, sampler, tokenizer, examples, params, **kwargs):
            self.metrics = {"counted/prompts": float(len(examples))}
            return episodes.SingleTurn()(sampler, tokenizer, examples, params, **kwargs)

        def close(self):
            pass

    t = fresh("rollout.episode=counted")
    assert isinstance(t.episode, Counted)
    _, _, metrics = t.collector.collect(0, version=0)
    assert metrics["counted/prompts"] == t.cfg.rollout.prompts_per_step
    with pytest.raises(ConfigError, match="rollout.episode=counted: not with a tool"):
        load_config(None, ["rollout.episode=counted", "multiturn.env=guess"])
