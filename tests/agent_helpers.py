"""Importable by the agent-episode tests: a scripted engine (deterministic replies that call a
tool, log-probs a function of the ids), examples, a BPE tokenizer with ChatML, an agent written
with the ``openai`` client, and the episode called once (``agent_batch``). Import it after
``pytest.importorskip("openai")``."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import openai
import torch

from gspo.rollout.engines.base import Capabilities, Engine
from gspo.rollout.episodes import Agent
from gspo.rollout.episodes.turn_loop import Budgets
from gspo.rollout.generate import Samples, SamplingParams, left_pad
from gspo.rollout.tokenization import build_bpe_tokenizer
from gspo.tasks import Example

QUESTIONS = ["What is 2 + 3 ?", "What is 4 + 1 ?", "What is 7 + 2 ?"]
BUDGETS = Budgets(max_turns=4, max_new_tokens=40, max_total_tokens=200, max_observation_tokens=30)
PARAMS = SamplingParams(max_new_tokens=40)


def bpe_tokenizer():
    """A small BPE with ChatML (``<|im_end|>`` its EOS) that knows the questions and the calls."""
    calls = [f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'
             for a in range(3) for b in range(3)]
    return build_bpe_tokenizer((QUESTIONS + calls + ["user assistant tool", "done 0 1 2 3"]) * 4, vocab_size=400)


def examples(n: int = 2) -> list[Example]:
    return [Example(prompt=f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n", answer="",
                    data={"question": q}) for q in QUESTIONS[:n]]


class Scripted(Engine):
    """A deterministic sampler: a context with fewer than ``want`` tool results (``want`` a function
    of the context's ids, the draw and the seed) gets a hermes call of ``add``, else ``done k``;
    log-prob of id t: -(t % 7 + 1) / 10."""

    capabilities = Capabilities()

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def reply(self, context: list[int], j: int, seed) -> list[int]:
        k = self.tok.decode(context).count("<|im_start|>tool")
        want = (sum(context) + j + (seed or 0)) % 3
        text = (f'<tool_call>{{"name": "add", "arguments": {{"a": {k}, "b": {j}}}}}</tool_call>'
                if k < want else f"done {k}")
        return self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]

    def generate(self, prompt_ids, group_size, params, seed=None, with_logprobs=True) -> Samples:
        self.calls.append((len(prompt_ids), group_size, seed))
        rows = [self.reply(p, j, seed)[:params.max_new_tokens] for p in prompt_ids for j in range(group_size)]
        ids, mask = left_pad([r[::-1] for r in rows], self.tok.pad_token_id)      # right-pad: flip
        ids, mask = ids.flip(1), mask.flip(1).float()
        logp = -((ids % 7) + 1).float() / 10 * mask
        truncated = torch.tensor([r[-1] != self.tok.eos_token_id for r in rows])
        return Samples(ids, mask, truncated, logp)

    def update_weights(self, weights, version):
        pass


def add_agent(base_url, api_key, example):
    """An agent written with the openai client: asks, runs the add calls it gets, asks again."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
    messages = [{"role": "user", "content": example.data["question"]}]
    while True:
        reply = client.chat.completions.create(model="policy", messages=messages, logprobs=True)
        choice = reply.choices[0]
        if choice.finish_reason == "length" or not choice.message.tool_calls:
            return float(len(choice.message.content or ""))
        messages.append({"role": "assistant", "content": choice.message.content,
                         "tool_calls": [c.model_dump() for c in choice.message.tool_calls]})
        for call in choice.message.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})


def agent_batch(fn, tok, engine, exs, G=2, seed=5, **kw):
    episode = Agent(fn, BUDGETS, **{"timeout_s": 30.0, "batch_wait_s": 5.0, **kw})
    batch = episode(engine, tok, exs, PARAMS, group_size=G, seed=seed, with_logprobs=True)
    return episode, batch


def post(url, api_key, body, raw: bytes | None = None, headers=None) -> dict:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(
        {"Authorization": f"Bearer {api_key}"} if api_key else {}), **(headers or {})})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def status_of(url, api_key, body=None, raw=None) -> int:
    try:
        post(url, api_key, body, raw)
        return 200
    except urllib.error.HTTPError as err:
        line = json.loads(err.read())["error"]["message"]
        assert "\n" not in line
        return err.code


def endpoint_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("gspo-agent")]
