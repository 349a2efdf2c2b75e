"""The verifiers agent (``agent.fn: verifiers``): a verifiers environment's own rollout loop drives the
recording endpoint through an openai client and its rubric's reward is the row's. Against a fake
``verifiers`` module with the classic API's signatures (no install needed), and, where verifiers
0.3.x is installed (its own venv: docs/agents.md), against a real ``ToolEnv``."""

from __future__ import annotations

import sys
import textwrap
import types

import pytest
import torch

openai = pytest.importorskip("openai")

from agent_helpers import Scripted, add_agent, agent_batch, bpe_tokenizer, examples  # noqa: E402
from gspo.errors import UserError  # noqa: E402
from gspo.rollout.episodes.agent import agent_function  # noqa: E402
from gspo.rollout.episodes.verifiers_env import rollout_input  # noqa: E402
from gspo.tasks import Example  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer()


class FakeEnv:
    """A classic verifiers environment: ``await run_rollout(input, client, model, sampling_args)``
    -> a ``RolloutOutput`` dict; one model call through ``client.client`` (the AsyncOpenAI); its
    reward, the reply's token count."""

    system_prompt, few_shot = None, None

    def __init__(self, fail: bool = False):
        self.fail, self.inputs = fail, []

    async def run_rollout(self, input, client, model, sampling_args, max_retries=0, state_columns=None):
        self.inputs.append(input)
        reply = await client.client.chat.completions.create(model=model, messages=input["prompt"], **sampling_args)
        sampled = len(reply.choices[0].logprobs.content)        # the reply's tokens: its row's policy tokens
        return {"example_id": input["example_id"], "prompt": input["prompt"], "reward": float(sampled),
                "metrics": {"length": sampled}, "error": {"error": "ToolError"} if self.fail else None}


@pytest.fixture
def fake_verifiers(monkeypatch):
    """A ``verifiers`` module of the classic API's shape: ``load_environment``, the client class."""
    module = types.ModuleType("verifiers")
    module.__version__ = "0.3.1"
    module.envs = {}

    def load_environment(env_id, **env_args):
        if env_id not in module.envs:
            raise ValueError(f"Failed to load environment {env_id!r}")
        return module.envs[env_id](**env_args)

    module.load_environment = load_environment
    module.OpenAIChatCompletionsClient = lambda native: types.SimpleNamespace(client=native)
    monkeypatch.setitem(sys.modules, "verifiers", module)
    return module


def test_a_verifiers_environment_drives_the_endpoint_its_reward_the_rows(tok, fake_verifiers):
    envs = []
    fake_verifiers.envs["fake"] = lambda: envs.append(FakeEnv()) or envs[-1]
    agent = agent_function("verifiers", {"env_id": "fake", "sampling_args": {"max_tokens": 30}})
    episode, batch = agent_batch(agent, tok, Scripted(tok), examples())
    assert len(envs) == 1                                       # loaded once, at set-up
    assert [r.reward for r in batch.records] == batch.response_mask.sum(1).tolist()
    assert batch.records[0].info["verifiers_metrics"] == {"length": batch.records[0].reward}
    asked = sorted(tuple(m["content"] for m in i["prompt"]) for i in envs[0].inputs)   # episodes run concurrently
    assert asked == sorted((ex.data["question"],) for ex in examples() for _ in range(2))
    assert episode.metrics["agent/calls_mean"] == 1 and episode.metrics["agent/errors"] == 0


def test_the_agent_pickles_as_its_options_and_loads_again(fake_verifiers):
    """An asynchronous worker process gets the episode pickled: the environment is loaded there."""
    import pickle
    loaded = []
    fake_verifiers.envs["fake"] = lambda **args: loaded.append(args) or FakeEnv()
    agent = agent_function("verifiers", {"env_id": "fake", "env_args": {"level": 2}, "sampling_args": {"max_tokens": 9}})
    again = pickle.loads(pickle.dumps(agent))
    assert loaded == [{"level": 2}, {"level": 2}] and again.env is not agent.env
    assert again.sampling_args == {"max_tokens": 9} and again.timeout_s == agent.timeout_s


def test_a_rollout_verifiers_ends_with_an_error_gets_no_reward_counted(tok, fake_verifiers):
    fake_verifiers.envs["fails"] = lambda: FakeEnv(fail=True)
    episode, batch = agent_batch(agent_function("verifiers", {"env_id": "fails"}), tok, Scripted(tok), examples(1))
    assert [r.reward for r in batch.records] == [None, None] and episode.metrics["agent/errors"] == 2


def test_the_input_is_formatted_as_the_environments_own_rows():
    env = types.SimpleNamespace(system_prompt="Be brief.", few_shot=[{"role": "user", "content": "1+1"},
                                                                      {"role": "assistant", "content": "2"}])
    row = rollout_input(env, Example("What is 2+2?", "4", {"info": {"k": 1}, "example_id": 7}))
    assert row == {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1"},
                              {"role": "assistant", "content": "2"}, {"role": "user", "content": "What is 2+2?"}],
                   "answer": "4", "example_id": 7, "info": {"k": 1}}


def test_what_is_refused_is_one_line(fake_verifiers, make_cfg):
    with pytest.raises(UserError, match=r"^agent.params.env_id='nope': verifiers.load_environment failed: "
                                        r"ValueError: Failed to load environment 'nope'$"):
        agent_function("verifiers", {"env_id": "nope"})
    fake_verifiers.__version__ = "0.4.0"
    with pytest.raises(UserError, match="verifiers 0.4.0 has the v1 API only"):
        agent_function("verifiers", {"env_id": "nope"})
    base = ["rollout.episode=agent", "agent.fn=verifiers", "rewards.sources=[{type: env}]", "rewards.on_error=drop"]
    for params, says in [("{}", "agent.fn=verifiers: missing a required argument: 'env_id'"),
                         ("{env_id: x, envargs: {}}", "agent.fn=verifiers: unexpected argument(s) 'envargs'")]:
        with pytest.raises(Exception) as err:
            make_cfg(*base, f"agent.params={params}")
        assert says in str(err.value) and "\n" not in str(err.value)


def test_without_verifiers_installed_the_message_says_how(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers", None)           # import verifiers -> ImportError
    with pytest.raises(UserError, match=r"agent.fn=verifiers needs the verifiers package: pip install 'gspo\[verifiers\]'"):
        agent_function("verifiers", {"env_id": "x"})


VF_ADD = '''
"""A verifiers (classic API) ToolEnv with an add tool; reward: the final message's length."""
import verifiers as vf
from datasets import Dataset


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def final_length(completion, **kwargs) -> float:
    last = completion[-1]
    return float(len((last.get("content") if isinstance(last, dict) else last.content) or ""))


def load_environment(max_turns: int = 4):
    dataset = Dataset.from_list([{"question": "What is 2 + 3 ?", "answer": ""}])
    return vf.ToolEnv(dataset=dataset, tools=[add], rubric=vf.Rubric(funcs=[final_length]), max_turns=max_turns)
'''


def test_a_real_verifiers_tool_env_gives_the_batch_of_the_hand_written_agent(tok, tmp_path, monkeypatch):
    """verifiers' own ToolEnv loop (its client, its tool calls and tool messages) against the
    endpoint gives the ids, log-probs and rewards of ``add_agent``, the same task written by hand
    with the openai client (which test_agent.py shows equal to the tool loop's)."""
    vf = pytest.importorskip("verifiers")
    if not vf.__version__.startswith("0.3."):
        pytest.skip(f"verifiers {vf.__version__}: the classic API is 0.3.x")
    (tmp_path / "gspo_vf_add.py").write_text(textwrap.dedent(VF_ADD))
    monkeypatch.syspath_prepend(str(tmp_path))
    episode, got = agent_batch(agent_function("verifiers", {"env_id": "gspo-vf-add"}), tok, Scripted(tok), examples(3))
    _, want = agent_batch(add_agent, tok, Scripted(tok), examples(3))
    assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.rollout_logp, want.rollout_logp)
    assert torch.equal(got.response_mask, want.response_mask)
    assert [r.reward for r in got.records] == [r.reward for r in want.records]
    assert episode.metrics["agent/errors"] == 0 and episode.metrics["multiturn/tool_calls_mean"] > 0


def test_the_token_route_serves_verifiers_v1s_token_client(tok):
    """Not an adapter of the v1 API: its training client's call (``renderers.client.generate``,
    as ``verifiers.v1.clients.train.TrainClient`` makes it) parses the endpoint's token route, and
    a second call that extends the first's ids continues its row. ``max_prompt_len`` is given: its
    lookup holds a module-wide asyncio lock that an episode's own event loop cannot share."""
    import asyncio
    pytest.importorskip("renderers")
    from renderers.base import create_renderer
    from renderers.client import generate
    from renderers.configs import DefaultRendererConfig
    renderer = create_renderer(tok, DefaultRendererConfig())
    turn = "\n<|im_start|>user\nand 2 more ?<|im_end|>\n<|im_start|>assistant\n"

    async def run(base_url, api_key, example):
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        ask = dict(client=client, renderer=renderer, model="policy", max_prompt_len=4096)
        first = await generate(messages=[{"role": "user", "content": example.data["question"]}], **ask)
        ids = first["prompt_ids"] + first["completion_ids"] + tok(turn, add_special_tokens=False)["input_ids"]
        second = await generate(messages=[], prompt_ids=ids, **ask)
        await client.close()
        assert len(first["completion_logprobs"]) == len(first["completion_ids"])
        return float(len(second["completion_ids"]))

    episode, batch = agent_batch(lambda *args: asyncio.run(run(*args)), tok, Scripted(tok), examples(1))
    m = episode.metrics
    assert m["agent/rows_per_episode"] == 1 and m["agent/calls_mean"] == 2 and m["agent/errors"] == 0
    assert m["agent/overridden_sampling"] == 0          # its stop_token_ids, logprobs=1: nothing overridden


class SumScripted(Scripted):
    """Answers the sum's question one too low, then right once told it is too low."""

    def reply(self, context: list[int], j: int, seed) -> list[int]:
        text = self.tok.decode(context)
        total = sum(int(n) for n in text.split("user\n", 1)[1].split(":", 1)[0].split()[1:])
        answer = f"#{total}" if "too low" in text else f"#{total - 1}"
        return self.tok(answer, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]


def test_the_feedback_environment_of_the_config_plays_two_turns_and_pays_the_retry(tok):
    """configs/verifiers_feedback.yaml's environment (gspo.envs.verifiers_sum) under verifiers' own
    MultiTurnEnv loop: a wrong first answer is told "No, too low.", the second answer continues the
    same row, and the rubric pays the retry 0.5."""
    vf = pytest.importorskip("verifiers")
    if not vf.__version__.startswith("0.3."):
        pytest.skip(f"verifiers {vf.__version__}: the classic API is 0.3.x")
    exs = [Example(prompt="", answer="#7", data={"question": q}) for q in ("S 3 4:", "S 1 2 5:")]
    episode, batch = agent_batch(agent_function("verifiers", {"env_id": "gspo.envs.verifiers_sum"}), tok,
                                 SumScripted(tok), exs)
    assert [r.reward for r in batch.records] == [0.5] * 4
    m = episode.metrics
    assert m["agent/calls_mean"] == 2 and m["agent/rows_per_episode"] == 1 and m["agent/errors"] == 0
    row = tok.decode(batch.input_ids[0][batch.attention_mask[0] > 0])
    assert row.index("#6") < row.index("No, too low.") < row.index("#7")
    policy = tok.decode(batch.response_ids[0][batch.response_mask[0] > 0])   # the trained tokens
    assert "#6" in policy and "#7" in policy and "too low" not in policy
