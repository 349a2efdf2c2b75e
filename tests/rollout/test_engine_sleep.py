"""rollout.engine_sleep in the loop, with a recording engine (no vLLM needed): the engine sleeps
after each step's generation, so every optimizer update happens while it sleeps, and it wakes
before its weights are updated for the next generation (the evaluation's included)."""

import torch

from gspo.rollout import engines
from gspo.training.trainer import Trainer
from conftest import parity_rewards


class RecordingEngine(engines.HFEngine):
    """The hf engine, driven like vllm (``module`` None: token ids in and out, evaluation through
    it), recording each call with a snapshot of the policy's weights; generating or syncing
    while asleep fails."""

    module = None

    def __init__(self, model, tokenizer, events, **options):
        super().__init__(model, tokenizer, **options)
        self.policy, self.events, self.asleep = model, events, False
        self.record("build")

    def record(self, event):
        self.events.append((event, [p.detach().clone() for p in self.policy.parameters()]))

    def generate(self, *args, **kwargs):
        assert not self.asleep, "generated while asleep"
        self.record("generate")
        return super().generate(*args, **kwargs)

    def update_weights(self, weights, version):
        assert not self.asleep, "weights updated while asleep"
        self.record("update")
        super().update_weights(weights, version)

    def sleep(self):
        self.asleep = True
        self.record("sleep")

    def wake_up(self):
        self.asleep = False
        self.record("wake_up")


def run(make_cfg, reward_module, monkeypatch, *overrides):
    events = []
    monkeypatch.setattr(engines, "build", lambda name, model, tok, **options:
                        RecordingEngine(model, tok, events, **options))
    cfg = make_cfg("sft.enabled=false", parity_rewards(reward_module), "train.steps=2", *overrides)
    Trainer(cfg, log=lambda m: None).run()
    return events


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_the_engine_sleeps_through_every_update(make_cfg, reward_module, monkeypatch):
    events = run(make_cfg, reward_module, monkeypatch)       # rollout.engine_sleep: true (default)
    names = [name for name, _ in events]
    evaluation = ["generate", "generate"]                     # greedy, then the k samples
    step = ["wake_up", "update", "generate", "sleep"]
    assert names == ["build", *evaluation, *step, *step, "wake_up", "update", *evaluation]
    sleeps = [i for i, name in enumerate(names) if name == "sleep"]
    for i in sleeps:                                          # after each step's generation:
        assert not same(events[i][1], events[i + 1][1])       # the update ran while it slept
    for i, (name, weights) in enumerate(events[1:], 1):       # nothing else moved the weights
        if i - 1 not in sleeps:
            assert same(events[i - 1][1], weights), (i, name)


def test_without_engine_sleep_it_is_never_put_to_sleep(make_cfg, reward_module, monkeypatch):
    events = run(make_cfg, reward_module, monkeypatch, "rollout.engine_sleep=false")
    names = [name for name, _ in events]
    assert "sleep" not in names and "wake_up" not in names
    assert names.count("update") == 3                           # before each step and the final eval
