"""The agent episode's faults: an agent that raises, hangs (sync or async), sends malformed JSON,
asks for n > 1 or stop strings, overflows the context or has no key is counted and the run goes
on; no thread or port is left after a batch; many agents at once are all served; the config
refuses what the agent cannot serve."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

openai = pytest.importorskip("openai")

from agent_helpers import (QUESTIONS, Scripted, add_agent, agent_batch, bpe_tokenizer,  # noqa: E402
                           endpoint_threads, examples, post, status_of)
from gspo.tasks import Example  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer()


def faulty(base_url, api_key, example):
    """One fault per example (``data["fault"]``); answers 1.0 when the endpoint answered as it should."""
    fault, url = example.data["fault"], f"{base_url}/chat/completions"
    msgs = [{"role": "user", "content": example.data["question"]}]
    if fault == "raise":
        raise RuntimeError("the agent broke")
    if fault == "hang":
        time.sleep(5)
        return 1.0
    if fault == "hang_async":
        async def forever():
            await asyncio.sleep(60)
        return forever()
    expected = {"malformed": (400, dict(raw=b"{not json")), "n2": (400, dict(body={"messages": msgs, "n": 2})),
                "stop": (400, dict(body={"messages": msgs, "stop": ["\n"]})),
                "overflow": (400, dict(body={"messages": msgs + [{"role": "user", "content": "9 " * 3000}]})),
                "nokey": (401, dict(body={"messages": msgs}))}
    status, how = expected[fault]
    got = status_of(url, None if fault == "nokey" else api_key, **how)
    if got != status:
        raise AssertionError(f"{fault}: got {got}")
    post(url, api_key, {"messages": msgs, "temperature": 0.2})      # served, counted as an override
    return 1.0


def test_faults_are_counted_the_run_goes_on_and_nothing_is_left(tok):
    faults = ["raise", "hang", "hang_async", "malformed", "n2", "stop", "overflow", "nokey"]
    exs = [Example(prompt=f"<|im_start|>user\n{QUESTIONS[0]}<|im_end|>\n<|im_start|>assistant\n", answer="",
                   data={"question": QUESTIONS[0], "fault": f}) for f in faults]
    t0 = time.monotonic()
    episode, batch = agent_batch(faulty, tok, Scripted(tok), exs, G=1, timeout_s=3.0, batch_wait_s=0.2)
    assert time.monotonic() - t0 < 15                    # the hung agents cost their deadline, not more
    m = episode.metrics
    assert m["agent/errors"] == 1 and m["agent/timeouts"] == 2
    assert m["agent/malformed"] == 1 and m["agent/unauthorized"] == 1 and m["agent/refused"] == 3
    assert m["agent/overridden_sampling"] == 5
    assert [r.reward for r in batch.records] == [None, None, None, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert batch.input_ids.shape[0] == len(faults)
    deadline = time.monotonic() + 8                      # the sync hang ends its sleep, then its thread
    while endpoint_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert endpoint_threads() == []


def test_no_server_thread_or_port_is_left_after_a_batch(tok):
    """Even with the agents' clients (and their keep-alive connections) still open."""
    urls, clients = [], []

    def agent(base_url, api_key, example):
        urls.append(base_url)
        clients.append(openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0))
        clients[-1].chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        return 0.0

    agent_batch(agent, tok, Scripted(tok), examples(1))
    port = int(urls[0].split(":")[2].split("/")[0])
    deadline = time.monotonic() + 3
    while endpoint_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert endpoint_threads() == []
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_the_config_refuses_what_the_agent_cannot_serve(make_cfg):
    from gspo.config.base import ConfigError
    with pytest.raises(ConfigError, match="set agent.fn"):
        make_cfg("rollout.episode=agent")
    with pytest.raises(ConfigError, match="rewards.on_error=drop"):
        make_cfg("rollout.episode=agent", "agent.fn=json:loads")
    with pytest.raises(ConfigError, match="unset multiturn.env"):
        make_cfg("rollout.episode=agent", "agent.fn=json:loads", "rewards.on_error=drop", "multiturn.env=guess")
    cfg = make_cfg("rollout.episode=agent", "agent.fn=json:loads", "rewards.on_error=drop")
    assert cfg.rollout.episode == "agent" and cfg.agent.timeout_s == 60.0


def test_many_agents_connecting_at_once_are_all_served(tok):
    """64 episodes open their connections together: none is refused by the listen backlog."""
    exs = [Example(examples(3)[i % 3].prompt, "", examples(3)[i % 3].data) for i in range(32)]
    episode, batch = agent_batch(add_agent, tok, Scripted(tok), exs)
    assert episode.metrics["agent/errors"] == 0 and None not in [r.reward for r in batch.records]


def test_a_client_that_hangs_up_leaves_no_traceback(capsys):
    """An agent past its deadline closes its connection before the answer is written: the server
    says nothing of it; an unexpected error is still printed."""
    from gspo.rollout.episodes.endpoint.server import Handler, Server
    server = Server(("127.0.0.1", 0), Handler)
    try:
        for err in (BrokenPipeError(32, "Broken pipe"), ConnectionResetError(104, "reset by peer")):
            try:
                raise err
            except ConnectionError:
                server.handle_error(None, ("127.0.0.1", 1))
        assert capsys.readouterr().err == ""
        try:
            raise KeyError("unexpected")
        except KeyError:
            server.handle_error(None, ("127.0.0.1", 1))
        assert "KeyError: 'unexpected'" in capsys.readouterr().err
    finally:
        server.server_close()
