"""Chat prompts: a task's examples rendered with the tokenizer's chat template.

With ``task.chat: true`` every example's prompt becomes the template's rendering (with
``add_generation_prompt``) of its conversation: the row's ``messages`` when it has them (a list
of ``{role, content}``, e.g. from a dataset file), else one user turn holding its ``prompt``;
``task.system_prompt`` is put first when the conversation has no system turn, and
``task.chat_template_kwargs`` (e.g. ``enable_thinking``) reach the template. Tools are passed as
``tools=`` (JSON schemas, ``gspo.envs.tools.tool_schema``; a hermes template renders them as its
``<tools>`` block): the row's own ``tools`` column when it has one (a list of schemas, or that list
as a JSON string), else the run's (``multiturn.tools`` under ``multiturn.tools_in_prompt``). The rendered text is
what rollouts, SFT and evaluation condition on and what reward functions get as ``prompt``; the
row's ``messages`` stay in its columns, and the prompt before rendering is its ``question``
column unless it has one (what an agent sends as the user's message, e.g. verifiers'). The answer is unchanged: a demonstration is the answer
followed by EOS, which under chat is the template's end-of-turn token
(``gspo.rollout.tokenization.use_end_of_turn``).
"""

from __future__ import annotations

import json
from dataclasses import replace

from gspo.tasks.base import Example


def conversation(example: Example, system_prompt: str | None = None) -> list[dict]:
    """The example's turns: its ``messages`` or one user turn of its prompt, system prompt first."""
    messages = example.data.get("messages") or [{"role": "user", "content": example.prompt}]
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def row_tools(example: Example, default: list[dict] | None = None) -> list[dict] | None:
    """The tools to describe for ``example``: its own ``tools`` column, else ``default``."""
    tools = example.data.get("tools")
    if isinstance(tools, str):
        tools = json.loads(tools)
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"the row's 'tools' must be a list of JSON schemas (objects), got {tools!r:.60}")
    return tools or default or None


def renders_tools(tokenizer, tools: list[dict], template_kwargs: dict | None = None) -> bool:
    """Whether the chat template writes ``tools=`` into the prompt at all (ChatML without a tools
    block ignores them)."""
    talk = [{"role": "user", "content": "q"}]
    kw = dict(template_kwargs or {})
    return (tokenizer.apply_chat_template(talk, tokenize=False, add_generation_prompt=True, tools=tools, **kw)
            != tokenizer.apply_chat_template(talk, tokenize=False, add_generation_prompt=True, **kw))


def render(tokenizer, example: Example, system_prompt: str | None = None,
           template_kwargs: dict | None = None, tools: list[dict] | None = None) -> Example:
    """The example with its prompt rendered by the chat template, ready for the assistant's turn
    (``template_kwargs``: the template's extra variables, e.g. ``enable_thinking``; ``tools``:
    the run's tool schemas, a row's own ``tools`` taking their place)."""
    text = tokenizer.apply_chat_template(conversation(example, system_prompt), tokenize=False,
                                         add_generation_prompt=True, tools=row_tools(example, tools),
                                         **(template_kwargs or {}))
    return replace(example, prompt=text, data={"question": example.prompt, **example.data})


class ChatTask:
    """A task whose splits hold chat-rendered prompts; scoring is the wrapped task's own."""

    def __init__(self, task, tokenizer, system_prompt: str | None = None,
                 template_kwargs: dict | None = None, tools: list[dict] | None = None):
        self.inner, self.name = task, task.name
        self.tokenizer, self.system_prompt = tokenizer, system_prompt
        self.template_kwargs, self.tools = dict(template_kwargs or {}), tools
        self._splits: dict[str, list[Example]] = {}
        for attr in ("locations", "skipped"):  # file tasks: where each row came from
            if hasattr(task, attr):
                setattr(self, attr, getattr(task, attr))

    def split(self, name: str) -> list[Example]:
        if name not in self._splits:
            self._splits[name] = [render(self.tokenizer, ex, self.system_prompt, self.template_kwargs,
                                         self.tools)
                                  for ex in self.inner.split(name)]
        return list(self._splits[name])

    def reward(self, completion: str, example: Example) -> float:
        return self.inner.reward(completion, example)

    def is_correct(self, completion: str, example: Example) -> bool:
        return self.inner.is_correct(completion, example)
