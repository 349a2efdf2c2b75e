"""The agent episode and its recording endpoint: agents written with the ``openai`` client drive
trajectories through the run's engine; rows are the sampler's ids and log-probs, stitched per
episode; the same task as a tool loop gives the same batch (faults: test_agent_faults.py).

Engines: a scripted one (tests/agent_helpers.py) where exact equality is the point, the hf engine
on the tiny model for the log-probs."""

from __future__ import annotations

import json

import pytest
import torch

openai = pytest.importorskip("openai")

from agent_helpers import (BUDGETS, PARAMS, QUESTIONS, Scripted, add_agent, agent_batch,  # noqa: E402
                           bpe_tokenizer, examples, post)
from gspo.envs import Reply  # noqa: E402
from gspo.envs.tools import Hermes  # noqa: E402
from gspo.rollout.episodes.endpoint.batcher import runs  # noqa: E402
from gspo.rollout.episodes.endpoint.recorder import key  # noqa: E402
from gspo.rollout.episodes.tool_loop import collect_episodes, observer  # noqa: E402
from gspo.tasks import Example  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer()


class AddEnv:
    """The tool loop's twin of ``add_agent``: answers hermes calls of add with tool messages; its
    reward is the length of the last turn's text."""

    def __init__(self, example):
        self.last = ""

    def step(self, turn):
        self.last = turn.text
        calls = Hermes().parse(turn.text) if turn.ended else []
        if not calls:
            return Reply(None)
        return Reply(Hermes().answer([str(c.arguments["a"] + c.arguments["b"]) for c in calls]),
                     tool_calls=len(calls))

    def reward(self):
        return float(len(self.last))


def test_the_endpoint_adds_nothing_to_a_tool_loop(tok):
    """The same task as a built-in environment (tool loop) and as an agent over the endpoint:
    equal ids, masks, log-probs and rewards, in equally many engine calls with equal seeds."""
    loop_engine, agent_engine = Scripted(tok), Scripted(tok)
    want, rows = collect_episodes(loop_engine, tok, examples(), 2, PARAMS, AddEnv, observer(tok), BUDGETS, seed=5)
    episode, got = agent_batch(add_agent, tok, agent_engine, examples())
    assert max(len(r.turns) for r in rows) >= 2                  # some episodes called the tool
    assert torch.equal(got.input_ids, want["input_ids"])
    assert torch.equal(got.attention_mask, want["attention_mask"])
    assert torch.equal(got.response_mask, want["response_mask"])
    assert torch.equal(got.rollout_logp, want["rollout_logp"])
    assert [r.reward for r in got.records] == [r.reward for r in rows]
    assert agent_engine.calls == loop_engine.calls              # (contexts, G, seed) per call
    m = episode.metrics
    assert m["agent/rows_per_episode"] == 1 and m["agent/fresh_renders"] == 0
    assert m["agent/errors"] == m["agent/timeouts"] == m["agent/refused"] == m["agent/partial_batches"] == 0
    assert m["agent/calls_mean"] == sum(len(r.turns) for r in rows) / len(rows)
    assert [c["name"] for r in got.records for c in r.tool_calls] == ["add"] * sum(len(r.turns) - 1 for r in rows)


def test_a_deterministic_agent_gets_the_same_batch_twice(tok):
    _, a = agent_batch(add_agent, tok, Scripted(tok), examples(3))
    _, b = agent_batch(add_agent, tok, Scripted(tok), examples(3))
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.rollout_logp, b.rollout_logp)


def test_responses_carry_ids_schema_complete_logprobs_and_tool_calls_streamed_or_not(tok):
    seen = {}

    def agent(base_url, api_key, example):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages = [{"role": "user", "content": example.data["question"]}]
        plain = client.chat.completions.create(model="m", messages=messages).model_dump()
        stream = client.chat.completions.create(model="m", messages=messages, stream=True)
        chunks = [c.model_dump() for c in stream]
        models = client.models.list().model_dump()
        seen[base_url] = (plain, chunks, models)
        return 0.0

    episode, batch = agent_batch(agent, tok, Scripted(tok), examples(1), seed=0)
    plain, chunks, models = seen[min(seen, key=lambda url: url.split(".")[-1])]    # episode 0
    choice = plain["choices"][0]
    assert all(set(e) >= {"token", "logprob", "bytes", "top_logprobs"} for e in choice["logprobs"]["content"])
    ids = choice["token_ids"]
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == pytest.approx([-((t % 7) + 1) / 10 for t in ids])
    assert plain["prompt_token_ids"] == tok(examples(1)[0].prompt)["input_ids"]
    assert ids[-1] == tok.eos_token_id
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None   # this script's turn
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 0, "b": 0}'}
    # the streamed call is another sample (a fresh row, the next flush): its chunks agree with its ids
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    first = chunks[0]["choices"][0]
    assert streamed == tok.decode(first["token_ids"][:-1]) == "".join(e["token"] for e in first["logprobs"]["content"][:-1])
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert models["data"][0]["max_model_len"] > 0
    # the second call (a fresh render of the same messages) is the episode's second row
    assert episode.metrics["agent/rows_per_episode"] == 2 and episode.metrics["agent/fresh_renders"] == 2


def test_a_history_rewriting_agent_gets_several_rows_counted(tok):
    """Call 2 rewrites the question: a fresh row; call 3 appends to call 2: the same row. The batch
    keeps the last call's row; the first is counted as untrained."""
    def agent(base_url, api_key, example):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        first = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "What is 4 + 1 ?"}])
        messages = [{"role": "user", "content": example.data["question"]}]
        second = client.chat.completions.create(model="m", messages=messages)
        messages += [{"role": "assistant", "content": second.choices[0].message.content or "",
                      "tool_calls": [c.model_dump() for c in second.choices[0].message.tool_calls or []]},
                     {"role": "user", "content": "and 2 more ?"}]
        third = client.chat.completions.create(model="m", messages=messages)
        assert first.choices[0].token_ids != [] and third.prompt_token_ids[:len(second.prompt_token_ids)] \
            == second.prompt_token_ids
        return 1.0

    episode, batch = agent_batch(agent, tok, Scripted(tok), examples(1))
    m = episode.metrics
    assert m["agent/rows_per_episode"] == 2 and m["agent/fresh_renders"] == 2 and m["agent/rows_untrained"] == 2
    assert m["agent/calls_mean"] == 3
    assert (batch.response_mask == 0).any(dim=1).all()          # the kept row holds the user turn
    assert [r.reward for r in batch.records] == [1.0, 1.0]


def test_token_in_route_continues_by_ids(tok):
    def agent(base_url, api_key, example):
        root = base_url.rsplit("/v1", 1)[0]
        prompt = tok(example.prompt)["input_ids"]
        first = post(f"{root}/inference/v1/generate", api_key, {"token_ids": prompt, "sampling_params": {"max_tokens": 40}})
        more = prompt + first["choices"][0]["token_ids"] + tok("\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        second = post(f"{root}/inference/v1/generate", api_key, {"token_ids": more, "sampling_params": {"temperature": 0.3}})
        assert second["prompt_token_ids"] == more
        choice = second["choices"][0]                   # vLLM's generate route: tokens as their ids
        assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{i}" for i in choice["token_ids"]]
        return float(len(second["choices"][0]["logprobs"]["content"]))

    episode, batch = agent_batch(agent, tok, Scripted(tok), examples(1))
    m = episode.metrics
    assert m["agent/rows_per_episode"] == 1 and m["agent/calls_mean"] == 2 and m["agent/overridden_sampling"] == 2


def test_stitching_compares_content_and_parsed_calls():
    call = {"function": {"name": "add", "arguments": '{"b": 2, "a": 1}'}}
    with_markup = {"role": "assistant", "content": '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'}
    assert key({"role": "assistant", "content": None, "tool_calls": [call]}) == key(with_markup)
    assert key({"role": "assistant", "content": "", "tool_calls": [call]}) == key(with_markup)
    assert key({"role": "assistant", "content": "x"}) != key(with_markup)
    assert runs([[1], [1], [2], [2]]) == 2 and runs([[1], [2]]) == 1 and runs([[1], [1], [2]]) is None


class NonCanonical(Scripted):
    """Writes ``done`` one character per token: a split the tokenizer would not make."""

    def reply(self, context, j, seed):
        return [self.tok.convert_tokens_to_ids(c) for c in "done"] + [self.tok.eos_token_id]


def test_a_non_canonical_split_is_kept_in_the_row_and_in_the_next_context(tok):
    assert tok("done", add_special_tokens=False)["input_ids"] != NonCanonical(tok).reply([], 0, 0)[:4]
    prompts = []

    def agent(base_url, api_key, example):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages = [{"role": "user", "content": example.data["question"]}]
        first = client.chat.completions.create(model="m", messages=messages)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "again"}]
        second = client.chat.completions.create(model="m", messages=messages)
        prompts.append((first.prompt_token_ids + first.choices[0].token_ids, second.prompt_token_ids))
        return 0.0

    episode, batch = agent_batch(agent, tok, NonCanonical(tok), examples(1))
    split = NonCanonical(tok).reply([], 0, 0)
    for before, after in prompts:
        assert after[:len(before)] == before and before[-len(split):] == split
    row = batch.input_ids[0][batch.attention_mask[0].bool()].tolist()
    assert row[-len(split):] == split and episode.metrics["agent/rows_per_episode"] == 1
    assert episode.metrics["multiturn/retokenization_drift"] == 0       # not measured: never re-encoded


def test_hf_agent_rows_are_the_samplers_ids_and_the_trainers_logprobs(tok):
    """The tiny model (taught to end its turns) behind the endpoint, an openai agent of three
    turns: each row is the concatenation of the ids the agent was sent, and the trainer's
    forward over the row gives the log-probs the agent was sent (float32, the engine tolerance)."""
    from gspo.core.logprobs import response_logprobs
    from gspo.models.presets import build_model
    from gspo.rollout import engines
    from gspo.rollout.generate import demonstration_batch
    from gspo.training.cold_start import sft_loss
    torch.manual_seed(0)
    model, _ = build_model("tiny-dense", 0, tokenizer=tok)
    demos = [Example(ex.prompt, "done 1") for ex in examples(3)]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(30):
        loss = sft_loss(model, demonstration_batch(tok, demos, "cpu"))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    sent = {}

    def agent(base_url, api_key, example):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages = [{"role": "user", "content": example.data["question"]}]
        for turn in range(3):
            r = client.chat.completions.create(model="m", messages=messages, stream=turn == 1)
            if turn == 1:   # streamed: the ids and log-probs ride on the first chunk
                chunks = list(r)
                ids = chunks[0].choices[0].token_ids
                logp = [e.logprob for e in chunks[0].choices[0].logprobs.content]
                content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            else:
                ids, content = r.choices[0].token_ids, r.choices[0].message.content
                logp = [e.logprob for e in r.choices[0].logprobs.content]
            sent.setdefault(base_url, []).append((ids, logp))
            messages += [{"role": "assistant", "content": content}, {"role": "tool", "content": f"result {turn}"}]
        return 1.0

    engine = engines.build("hf", model, tok)
    episode, batch = agent_batch(agent, tok, engine, examples(2), G=2, seed=3)
    assert episode.metrics["agent/rows_per_episode"] == 1          # every turn ended: all stitched
    assert episode.metrics["agent/calls_mean"] == 3
    assert episode.metrics["multiturn/env_tokens_mean"] > 0        # holes: the tool turns
    policy = batch.response_mask
    for n, calls in enumerate(sent[k] for k in sorted(sent, key=lambda u: int(u.split(".")[-1].split("/")[0]))):
        T = policy.shape[1]
        ids = batch.input_ids[n, -T:][policy[n].bool()].tolist()
        assert ids == sum((c[0] for c in calls), [])
        assert batch.rollout_logp[n][policy[n].bool()].tolist() == pytest.approx(sum((c[1] for c in calls), []), abs=1e-6)
    with torch.no_grad():
        out = response_logprobs(model, batch.input_ids, batch.attention_mask, policy, with_entropy=False)
    on = policy > 0
    assert (out.logp[on] - batch.rollout_logp[on]).abs().max() < 5e-5


def test_the_agent_of_docs_agents_md_runs(tok):
    """The 20-line agent of docs/agents.md, as written there, against the scripted engine."""
    import pathlib
    import re
    text = (pathlib.Path(__file__).parents[2] / "docs" / "agents.md").read_text()
    code = re.search(r"```python\n# my_agents.py.*?\n(.*?)```", text, re.DOTALL).group(1)
    namespace = {}
    exec(compile(code, "docs/agents.md", "exec"), namespace)      # noqa: S102  the docs' own example
    exs = [Example(ex.prompt, "done 1", ex.data) for ex in examples(3)]
    episode, batch = agent_batch(namespace["solve"], tok, Scripted(tok), exs)
    m = episode.metrics
    assert m["agent/errors"] == m["agent/refused"] == 0 and m["agent/calls_mean"] > 1
    assert {r.reward for r in batch.records} <= {0.0, 1.0} and 1.0 in {r.reward for r in batch.records}


def test_a_call_that_only_sends_back_the_reply_continues_after_the_assistant_header(tok):
    """[user, assistant]: the next turn is the row's ids, the template's next assistant header,
    then the new sample (one row); the record's transcript is what followed the prompt."""
    contexts = []

    def agent(base_url, api_key, example):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages = [{"role": "user", "content": example.data["question"]}]
        first = client.chat.completions.create(model="m", messages=messages)
        messages.append(first.choices[0].message.model_dump())      # as the SDK gives it back
        second = client.chat.completions.create(model="m", messages=messages)
        contexts.append((first.prompt_token_ids + first.choices[0].token_ids, second.prompt_token_ids))
        return 0.0

    episode, batch = agent_batch(agent, tok, Scripted(tok), examples(1), seed=1)
    header = tok("\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    for before, after in contexts:
        assert after == before + header
    assert episode.metrics["agent/rows_per_episode"] == 1
    assert [m["role"] for m in batch.records[0].transcript] == ["assistant", "assistant"]


class QwenScripted(Scripted):
    """``Scripted`` under Qwen3's template, where a tool result is a user turn's <tool_response>."""

    def reply(self, context, j, seed):
        k = self.tok.decode(context).count("<tool_response>")
        text = f'<tool_call>\n{{"name": "add", "arguments": {{"a": {k}, "b": {j}}}}}\n</tool_call>' if k < 1 + j \
            else f"done {k}"
        return self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]


def test_qwen3s_template_as_shipped_an_openai_agent_with_tools_gets_one_row(qwen3):
    """Qwen3's tokenizer and chat template: the first prompt is the template's render, each
    continuation appends exactly the template's ids for the tool result and the next assistant
    header after the sampled <|im_end|>, and every episode is one row."""
    from gspo.rollout.turns import observation_ids
    calls = {}

    def agent(base_url, api_key, example):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages = [{"role": "user", "content": example.data["question"]}]
        while True:
            reply = client.chat.completions.create(model="m", messages=messages)
            calls.setdefault(base_url, []).append((reply.prompt_token_ids, reply.choices[0].token_ids, messages[-1]))
            message = reply.choices[0].message
            if not message.tool_calls:
                return 1.0
            messages.append(message.model_dump())
            args = json.loads(message.tool_calls[0].function.arguments)
            messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": str(args["a"] + args["b"])})

    exs = [Example(prompt=qwen3.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                    add_generation_prompt=True), answer="", data={"question": q})
           for q in QUESTIONS[:2]]
    episode, batch = agent_batch(agent, qwen3, QwenScripted(qwen3), exs)
    assert episode.metrics["agent/rows_per_episode"] == 1 and episode.metrics["multiturn/tool_calls_mean"] > 0
    assert [len(c) for c in calls.values()] == [2, 2, 2, 2]     # a tool call, then the answer
    for episode_calls in calls.values():
        first = episode_calls[0][0]
        assert first == qwen3(exs[0].prompt if QUESTIONS[0] in qwen3.decode(first) else exs[1].prompt,
                              add_special_tokens=False)["input_ids"]
        for (prompt, sampled, _), (after, _, tool) in zip(episode_calls, episode_calls[1:]):
            appended = observation_ids(qwen3, [tool], qwen3.eos_token_id)
            assert after == prompt + sampled + appended
            assert qwen3.decode(appended) == (f"\n<|im_start|>user\n<tool_response>\n{tool['content']}\n"
                                              "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_agent_params_are_keyword_arguments_of_every_call(tok):
    from gspo.rollout.episodes.agent import agent_function

    def agent(base_url, api_key, example, *, bonus):
        return add_agent(base_url, api_key, example) + bonus

    _, plain = agent_batch(add_agent, tok, Scripted(tok), examples())
    _, bonus = agent_batch(agent_function(agent, {"bonus": 100}), tok, Scripted(tok), examples())
    assert [r.reward for r in bonus.records] == [r.reward + 100 for r in plain.records]
    with pytest.raises(ValueError, match="^agent.fn=agent: unexpected argument\\(s\\) 'bonnus'; valid arguments: bonus$"):
        agent_function(agent, {"bonnus": 1})
