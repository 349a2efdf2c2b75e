"""Tools described to the model: typed tools as JSON schemas (transformers' get_json_schema
convention) passed to the chat template as tools=, checked against Qwen3's real template; a
row's own tools column; hermes parse failures counted."""

from __future__ import annotations

import json

import pytest

from gspo.envs import Turn
from gspo.envs.tools import Hermes, ToolEnv, ToolRunner, tool_schema, tool_schemas, load_tool
from gspo.rollout.chat import ChatTask, render, row_tools
from gspo.rollout.episodes.turn_loop import Budgets, Row, episode_metrics, take_turn
from gspo.tasks.base import Example

TOOLS = ["gspo.tasks.tooluse:calc", "gspo.tasks.tooluse:lookup"]


def untyped_doc(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def test_schema_follows_get_json_schema_docstrings_included():
    calc = tool_schemas(TOOLS)[0]
    assert calc == {"type": "function", "function": {
        "name": "calc", "description": "Add two non-negative integers written as 'a+b'.",
        "parameters": {"type": "object", "properties": {"expression": {
            "type": "string", "description": "the sum to compute, e.g. '48213+90577'."}},
            "required": ["expression"]},
        "return": {"type": "string"}}}
    bare = tool_schema(load_tool(f"{__name__}:untyped_doc"))   # no Args: types only
    assert bare["function"] == {"name": "untyped_doc", "description": "Add two integers.",
                                "parameters": {"type": "object", "properties": {
                                    "a": {"type": "integer"}, "b": {"type": "integer"}},
                                    "required": ["a", "b"]}}


@pytest.mark.parametrize("thinking", [True, False])
def test_qwen3_prompt_carries_the_tools_block_with_each_schema(qwen3, thinking):
    schemas = tool_schemas(TOOLS)
    ex = Example(prompt="What is 48213+90577?", answer="138790")
    prompt = render(qwen3, ex, "Use the tools.", {"enable_thinking": thinking}, schemas).prompt
    block = prompt[prompt.index("<tools>\n") + len("<tools>\n"):prompt.index("\n</tools>")]
    assert [json.loads(line) for line in block.split("\n")] == schemas
    assert prompt.startswith("<|im_start|>system\nUse the tools.\n\n# Tools\n")
    assert prompt.endswith("<|im_start|>user\nWhat is 48213+90577?<|im_end|>\n<|im_start|>assistant\n"
                           + ("" if thinking else "<think>\n\n</think>\n\n"))


def test_a_rows_own_tools_column_takes_the_place_of_the_runs(qwen3):
    own = [{"type": "function", "function": {"name": "search", "description": "Search the web.",
                                             "parameters": {"type": "object", "properties": {}}}}]
    rows = [Example("q1", "a", {"tools": own}), Example("q2", "a", {"tools": json.dumps(own)}),
            Example("q3", "a")]
    assert row_tools(rows[0]) == row_tools(rows[1]) == own and row_tools(rows[2]) is None

    class Inner:
        name = "rows"

        def split(self, name):
            return rows
    prompts = [e.prompt for e in ChatTask(Inner(), qwen3, tools=tool_schemas(TOOLS[:1])).split("train")]
    assert '"name": "search"' in prompts[0] and '"name": "calc"' not in prompts[0]
    assert prompts[0] == prompts[1].replace("q2", "q1")
    assert '"name": "calc"' in prompts[2]
    with pytest.raises(ValueError, match="list of JSON schemas"):
        row_tools(Example("q", "a", {"tools": "[1, 2]"}))


def test_hermes_parse_failures_are_counted():
    env = ToolEnv(Example("q", "a"), runner=ToolRunner(TOOLS[:1]), call_format="hermes")
    good = '<tool_call>\n{"name": "calc", "arguments": {"expression": "1+2"}}\n</tool_call>'
    assert env.step(Turn(good)).parse_errors == 0
    bad = env.step(Turn("<tool_call>{not json}</tool_call>"))
    assert bad.parse_errors == 1 and bad.tool_errors == 1 and bad.observation is not None
    unclosed = env.step(Turn('<tool_call>{"name": "calc", "arguments": {'))
    assert unclosed.observation is None and unclosed.parse_errors == 1   # no call: the episode ends
    assert Hermes().unclosed(good + "<tool_call>") == 1


def test_parse_errors_reach_the_step_metrics():
    env = ToolEnv(Example("q", "a"), runner=ToolRunner(TOOLS[:1]), call_format="hermes")
    rows = [Row([1]), Row([1])]
    eos = 0
    text = {5: "<tool_call>{oops</tool_call>", 6: "done"}
    for row, tok in zip(rows, (5, 6)):
        take_turn(row, env, [tok, eos], [0.0, 0.0], lambda obs: [7], lambda ids: text[ids[0]], eos,
                  Budgets(), last=False)
    assert episode_metrics(rows)["multiturn/tool_parse_errors"] == 0.5


def test_a_template_without_a_tools_block_is_told_apart(qwen3):
    from gspo.rollout.chat import renders_tools
    from gspo.rollout.tokenization import build_bpe_tokenizer
    chatml = build_bpe_tokenizer(["user q", "assistant a"], 300)      # the bpe preset's ChatML
    assert renders_tools(qwen3, tool_schemas(TOOLS)) and not renders_tools(chatml, tool_schemas(TOOLS))


@pytest.mark.parametrize("task, params", [("calculator", {"digits": 2, "call_fraction": 1.0}),
                                          ("lookup", {})])
def test_hermes_demonstrations_are_calls_the_hermes_format_runs(task, params):
    from gspo import tasks
    ex = tasks.build(task, n_train=4, n_test=1, call_format="hermes", **params).split("train")[0]
    runner = ToolRunner(TOOLS)
    reply = ToolEnv(ex, runner=runner, call_format="hermes").step(Turn(ex.data["turns"][0]))
    assert reply.tool_calls == 1 and reply.tool_errors == 0 and reply.parse_errors == 0
    assert "#" + reply.observation.messages[0]["content"] == ex.data["turns"][-1]
    with pytest.raises(ValueError, match="call_format must be one of bracket, hermes"):
        tasks.build(task, n_train=4, n_test=1, call_format="xml")
