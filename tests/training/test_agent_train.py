"""The agent episode in training: an agent written with the openai client, served by the run's
own engine through the recording endpoint, trains bit for bit like the same task as a built-in
environment (the endpoint adds nothing), and its agent/* metrics reach the metrics file."""

from __future__ import annotations

import textwrap

import pytest
import torch
from safetensors.torch import load_file

from gspo.observe.metrics import read_metrics
from gspo.training.trainer import Trainer

pytest.importorskip("openai")

AGENT = '''
import openai


def parity(base_url, api_key, example):
    """One call; the reward is the parity of the reply's first character (ParityEnv's)."""
    question = example.prompt.split("<|im_start|>user\\n", 1)[1].split("<|im_end|>", 1)[0]
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": question}])
    text = reply.choices[0].message.content or ""
    return float(ord(text[0]) % 2) if text else 0.0
'''
CHAT = ["model.tokenizer=bpe", "task.chat=true", "rewards.sources=[{type: env}]", "rewards.on_error=drop",
        "train.steps=2", "run.save_every=2", "task.n_train=40", "agent.batch_wait_s=10"]


def _run(make_cfg, *overrides, run):
    cfg = make_cfg(*CHAT, *overrides, run=run)
    Trainer(cfg, log=lambda m: None).run()
    rows = read_metrics(cfg.run.dir)
    weights = load_file(f"{cfg.run.dir}/checkpoints/step_000002/model.safetensors")
    return rows, weights


def test_an_agent_trains_exactly_as_the_same_task_as_an_environment(make_cfg, tmp_path, monkeypatch):
    (tmp_path / "parity_agent.py").write_text(textwrap.dedent(AGENT))
    monkeypatch.syspath_prepend(str(tmp_path))
    env_rows, env_weights = _run(make_cfg, "multiturn.env=episode_helpers:ParityEnv", run="env")
    agent_rows, agent_weights = _run(make_cfg, "rollout.episode=agent", "agent.fn=parity_agent:parity",
                                     run="agent")
    same = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("time/", "multiturn/", "agent/"))}
                         for r in rows]
    for a, b in zip(same(agent_rows), same(env_rows)):
        assert {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)} == {}
    assert env_rows[1]["reward/std"] > 0
    assert all(torch.equal(agent_weights[k], env_weights[k]) for k in env_weights)
    step = [r for r in agent_rows if "agent/calls_mean" in r][0]
    assert step["agent/calls_mean"] == 1 and step["agent/errors"] == 0 and step["agent/timeouts"] == 0
    assert step["agent/partial_batches"] == 0


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_an_agent_trains_under_the_async_worker(make_cfg, tmp_path, monkeypatch, worker):
    """rollout.async: the worker (a thread, or a process of its own) serves the agent its
    endpoint; the run finishes with agent/* metrics and no error."""
    (tmp_path / "parity_agent.py").write_text(textwrap.dedent(AGENT))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{__import__('os').environ.get('PYTHONPATH', '')}")
    rows, _ = _run(make_cfg, "rollout.episode=agent", "agent.fn=parity_agent:parity", "rollout.async=true",
                   f"rollout.async_worker={worker}", run=worker)
    step = [r for r in rows if "agent/calls_mean" in r]
    assert step and all(r["agent/errors"] == 0 and r["agent/calls_mean"] == 1 for r in step)


def test_a_template_that_rewrites_sampled_turns_is_refused_at_set_up(make_cfg):
    from conftest import THINK_STRIPPING_TEMPLATE
    from gspo.rollout.turns import TemplateError
    cfg = make_cfg(*CHAT, "sft.enabled=false", "rollout.episode=agent", "agent.fn=json:loads")
    trainer = Trainer(cfg, log=lambda m: None)
    trainer.task.tokenizer.chat_template = THINK_STRIPPING_TEMPLATE
    with pytest.raises(TemplateError, match="rewrites the assistant turn the policy sampled"):
        trainer.setup()
