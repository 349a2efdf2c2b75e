"""The verifiers v1 agent (``agent.fn: verifiers_v1``): an environment of verifiers' v1 API (0.4) played
by its own machinery (interception server, harness program in a subprocess, the taskset's
``@vf.reward``) against the recording endpoint. The parts that need no verifiers run everywhere;
the rest where verifiers 0.4 is installed (its own venv: ``make test-verifiers-v1``)."""

from __future__ import annotations

import importlib.metadata
import os
import textwrap
import time

import pytest
import torch

openai = pytest.importorskip("openai")

from agent_helpers import Scripted, agent_batch, bpe_tokenizer, endpoint_threads, examples  # noqa: E402
from gspo.errors import UserError  # noqa: E402
from gspo.rollout.episodes.agent import agent_function  # noqa: E402
from gspo.rollout.episodes.verifiers_v1 import installed_here, script_dependencies  # noqa: E402


def verifiers_version() -> str | None:
    try:
        return importlib.metadata.version("verifiers")
    except importlib.metadata.PackageNotFoundError:
        return None


V1 = (verifiers_version() or "").startswith("0.4.")
needs_v1 = pytest.mark.skipif(not V1, reason="verifiers 0.4 (the v1 API) is not installed: make test-verifiers-v1")


def test_a_scripts_declared_dependencies_are_read_and_checked_here():
    script = ('# /// script\n# requires-python = ">=3.10"\n'
              '# dependencies = ["torch>=1", "pytest[testing]", "no-such-package-gspo==1"]\n# ///\nprint(1)\n')
    assert script_dependencies(script) == ["torch>=1", "pytest[testing]", "no-such-package-gspo==1"]
    assert script_dependencies("print(1)\n") is None
    assert script_dependencies('# /// script\n# requires-python = ">=3.10"\n# ///\n') == []
    assert installed_here(["torch>=1", "pytest"])
    assert not installed_here(["torch<1"])                      # installed, at a version it excludes
    assert not installed_here(["no-such-package-gspo"])
    assert installed_here(['no-such-package-gspo; python_version < "3"'])   # its marker excludes it here


def test_the_gate_bounds_episodes_across_threads_and_a_cancelled_wait_takes_no_permit():
    """Episodes run in threads of their own, each with its own event loop: at most n of them hold
    the gate at once, and one cancelled while it waits (its deadline) leaves every permit free."""
    import asyncio
    import threading

    from gspo.rollout.episodes.verifiers_v1 import Gate
    gate, live, peak, lock = Gate(2), [0], [0], threading.Lock()

    async def episode():
        async with gate():
            with lock:
                live[0] += 1
                peak[0] = max(peak[0], live[0])
            await asyncio.sleep(0.05)
            with lock:
                live[0] -= 1

    threads = [threading.Thread(target=asyncio.run, args=(episode(),)) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak[0] == 2

    async def cancelled_while_waiting():
        async with gate():
            async with gate():
                try:
                    await asyncio.wait_for(episode(), 0.1)        # both permits are held: it times out waiting
                except asyncio.TimeoutError:
                    return "timed out"

    assert asyncio.run(cancelled_while_waiting()) == "timed out"
    assert all(gate.permits.acquire(timeout=2.0) for _ in range(2))      # both permits free again
    assert not gate.permits.acquire(timeout=0.2)                          # and no third
    gate.permits.release(), gate.permits.release()


def test_without_verifiers_0_4_the_message_says_how(monkeypatch):
    if V1:
        pytest.skip("verifiers 0.4 is installed here")
    with pytest.raises(UserError, match=r"verifiers.*pip install 'gspo\[verifiers-v1\]'") as err:
        agent_function("verifiers_v1", {"env": {"taskset": {"id": "x"}}})
    assert "\n" not in str(err.value)


V1_TASKSET = '''
"""A verifiers v1 taskset: the run's questions; reward: the final reply's length."""
import verifiers.v1 as vf


class QData(vf.TaskData):
    answer: str = ""
    mode: str = "ok"


class QTask(vf.Task[QData]):
    @vf.reward
    async def final_length(self, trace) -> float:
        if self.data.mode == "raise":
            raise ValueError("the reward function broke")
        return float(len(trace.last_reply or ""))

    @vf.metric
    async def replies(self, trace) -> float:
        return float(len(trace.calls))


class QTaskset(vf.Taskset[QTask]):
    def load(self):
        yield QTask(QData(prompt="unused"), self.config.task)


__all__ = ["QTaskset"]
'''


@pytest.fixture
def v1_env(tmp_path, monkeypatch):
    """The taskset module ``gspo_v1_q`` importable, and its env config under the null harness."""
    (tmp_path / "gspo_v1_q.py").write_text(textwrap.dedent(V1_TASKSET))
    monkeypatch.syspath_prepend(str(tmp_path))
    return {"taskset": {"id": "gspo_v1_q"}, "agent": {"harness": {"id": "null"}}}


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer()


class Plain(Scripted):
    """Never calls a tool: every reply is ``done k`` (k the draw)."""

    def reply(self, context, j, seed):
        return self.tok(f"done {j}", add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]


class Slow(Plain):
    def generate(self, *args, **kwargs):
        time.sleep(4.0)
        return super().generate(*args, **kwargs)


def one_call_agent(base_url, api_key, example):
    """The null harness's episode written by hand with the openai client: ask once, score the reply."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
    reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": example.data["question"]}])
    return float(len(reply.choices[0].message.content or ""))


def children() -> list[int]:
    """This process's child processes (pids), from /proc."""
    me, out = os.getpid(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            out.append(int(pid))
    return out


def all_gone(within_s: float = 10.0) -> bool:
    """No child process and no endpoint thread left, waiting up to ``within_s``: the endpoint shuts
    its connections' sockets at close, and their threads end once they read the EOF."""
    deadline = time.monotonic() + within_s
    while (children() or endpoint_threads()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not children() and not endpoint_threads()


@needs_v1
def test_a_v1_environment_gives_the_batch_of_the_hand_written_agent(tok, v1_env):
    """verifiers' interception server and its chat program (a subprocess run by this interpreter)
    against the endpoint give the ids, log-probs, masks and rewards of the same episode written by
    hand: nothing added on the way; the taskset's metrics reach the row's info."""
    agent = agent_function("verifiers_v1", {"env": v1_env})
    episode, got = agent_batch(agent, tok, Plain(tok), examples(3))
    _, want = agent_batch(one_call_agent, tok, Plain(tok), examples(3))
    assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.rollout_logp, want.rollout_logp)
    assert torch.equal(got.response_mask, want.response_mask)
    assert [r.reward for r in got.records] == [r.reward for r in want.records] == [6.0] * 6
    assert got.records[0].info["verifiers_metrics"] == {"replies": 1.0}
    m = episode.metrics
    assert m["agent/errors"] == 0 and m["agent/timeouts"] == 0 and m["agent/rows_per_episode"] == 1
    assert all_gone()


@needs_v1
def test_the_chat_programs_tool_turns_continue_one_row(tok, v1_env):
    """Scripted asks for an ``add`` tool the null harness does not offer: the chat program answers
    each call with a tool message and asks again; those turns continue the episode's one row, the
    tool messages observations (not trained on), the final reply scored."""
    episode, batch = agent_batch(agent_function("verifiers_v1", {"env": v1_env}), tok, Scripted(tok), examples(2))
    m = episode.metrics
    assert m["agent/errors"] == 0 and m["agent/rows_per_episode"] == 1 and m["agent/calls_mean"] > 1
    multi = [i for i, r in enumerate(batch.records) if r.info["verifiers_metrics"]["replies"] > 1]
    assert multi
    i = multi[0]
    row = tok.decode(batch.input_ids[i][batch.attention_mask[i] > 0])
    trained = tok.decode(batch.response_ids[i][batch.response_mask[i] > 0])
    assert row.count("<tool_call>") >= 1 and "<|im_start|>tool" in row
    assert "<tool_call>" in trained and "<|im_start|>tool" not in trained and "done" in trained
    assert batch.records[i].reward == float(len("done k"))          # the last reply, "done 0" or "done 1"


@needs_v1
def test_a_failing_reward_is_counted_and_the_batch_goes_on(tok, v1_env):
    exs = examples(2)
    exs[0].data["mode"] = "raise"
    episode, batch = agent_batch(agent_function("verifiers_v1", {"env": v1_env}), tok, Plain(tok), exs)
    assert [r.reward for r in batch.records] == [None, None, 6.0, 6.0]
    assert episode.metrics["agent/errors"] == 2


@needs_v1
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_episode_past_its_deadline_leaves_no_program_port_or_thread(tok, v1_env):
    """The engine answers after the deadline: the episodes are cancelled, their interception
    servers and harness programs torn down (no child process, no endpoint thread). verifiers' runtime
    kills the cancelled program's process group; asyncio then collects its pipe transport after the
    episode's loop closed, which it reports as an unraisable warning."""
    start = time.monotonic()
    episode, batch = agent_batch(agent_function("verifiers_v1", {"env": v1_env}), tok, Slow(tok), examples(1),
                                 timeout_s=2.0, batch_wait_s=0.2)
    assert episode.metrics["agent/timeouts"] == 2 and [r.reward for r in batch.records] == [None, None]
    assert all_gone()
    assert time.monotonic() - start < 30


@needs_v1
def test_what_is_refused_is_one_line(v1_env):
    for params, match in [({"env": v1_env, "python": "conda"}, "agent.params.python='conda'"),
                          ({"env": v1_env, "max_concurrent": 0}, "agent.params.max_concurrent=0"),
                          ({"env": {"taskset": {"id": "no_such_taskset_gspo"}}}, "could not build the environment"),
                          ({"env": v1_env, "envargs": {}}, "unexpected argument")]:
        with pytest.raises((UserError, ValueError), match=match) as err:
            agent_function("verifiers_v1", params)
        assert "\n" not in str(err.value)


@needs_v1
def test_the_agent_pickles_as_its_options_and_builds_again(v1_env):
    """An asynchronous worker process gets the episode pickled: the environment is built there."""
    import pickle
    agent = agent_function("verifiers_v1", {"env": v1_env})
    again = pickle.loads(pickle.dumps(agent))
    assert again.options == agent.options and again.env is not agent.env
    assert type(again.env.taskset).__name__ == "QTaskset"



@needs_v1
def test_the_v1_sum_config_trains_through_the_trainer(tmp_path, capsys):
    """configs/verifiers_v1_sum.yaml as shipped, shrunk: the cold start, then RL steps whose
    episodes verifiers' null harness plays against the endpoint, scored by the taskset's reward
    (1 for the right sum, so every reward is 0 or 1); no episode fails."""
    import json

    from gspo.cli import main
    from gspo.envs.verifiers_v1_sum import SumData, SumTask
    shrink = ["task.n_train=40", "task.n_test=4", "sft.steps=2", "sft.batch_size=8", "train.steps=2",
              "rollout.prompts_per_step=2", "rollout.group_size=2", "eval.n=4", "eval.k=1",
              "run.eval_every=0", "run.progress=false", "run.trackers=[]", f"sft.cache_dir={tmp_path / 'sft'}",
              f"run.dir={tmp_path / 'run'}"]
    assert main(["train", "configs/verifiers_v1_sum.yaml", *shrink]) == 0, capsys.readouterr().err
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rl = [m for m in steps if "agent/calls_mean" in m]
    assert len(rl) == 2 and all(m["agent/errors"] == 0 and m["agent/calls_mean"] == 1 for m in rl)
    assert all(0.0 <= m["reward/mean"] <= 1.0 for m in rl)
    task = SumTask(SumData(prompt="S 4 7 3 1:"))

    class Reply:
        def __init__(self, text):
            self.last_reply, self.calls = text, [None]

    import asyncio
    assert asyncio.run(task.right_sum(Reply("#15"))) == 1.0 and asyncio.run(task.right_sum(Reply("#14"))) == 0.0
