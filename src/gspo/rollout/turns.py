"""Observation ids under a chat template: the template's own rendering of the environment's
messages, as ids to append after the policy's end-of-turn token, never a re-rendering of the
whole conversation.

The policy's turn ends with the end-of-turn token it sampled (``<|im_end|>``). What follows it in
the template's rendering of the full conversation — the newline after ``<|im_end|>``, the tool
turn, the next assistant header — is the difference of two renderings of a probe conversation,
with and without the observation, cut right after the assistant's end-of-turn token so that the
boundary tokens after it are kept (dropping that newline is a known way to get this wrong). A
template for which that difference is not an extension (it rewrites earlier turns, e.g. strips
``<think>`` from the history once a later turn exists) is refused: the appended ids would not be
what the template means.

The probe's texts are arbitrary: a template renders each message's content verbatim between its
markers, so the suffix does not depend on them (a test checks it against a real conversation).
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from gspo.errors import UserError

PROBE = ({"role": "user", "content": "gspo-probe-question"},
         {"role": "assistant", "content": "gspo-probe-answer"})
THINKING = {"role": "assistant", "content": "<think>\ngspo-probe-reasoning\n</think>\n\ngspo-probe-answer"}


class TemplateError(UserError, ValueError):
    """The chat template cannot serve multi-turn rollouts (not prefix-preserving, no end of turn)."""


def _ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict], generation: bool) -> list[int]:
    out = tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=generation)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def observation_ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict],
                    end_of_turn: int, assistant: dict = PROBE[1]) -> list[int]:
    """Ids that follow the policy's end-of-turn token when ``messages`` answer its turn, up to and
    including the header of the next assistant turn (TemplateError: the template cannot say)."""
    before = _ids(tokenizer, [PROBE[0], assistant], generation=False)
    after = _ids(tokenizer, [PROBE[0], assistant, *messages], generation=True)
    if after[:len(before)] != before:
        raise TemplateError("the chat template is not prefix-preserving: rendering a tool or user "
                            "turn after an assistant turn changes the tokens before it (e.g. it strips "
                            "<think> from earlier turns); multi-turn rollouts need a template that "
                            "only appends")
    ends = [i for i, t in enumerate(before) if t == end_of_turn]
    if not ends:
        raise TemplateError(f"the chat template does not close an assistant turn with token {end_of_turn}")
    return after[ends[-1] + 1:]


def check_template(tokenizer: PreTrainedTokenizerBase, end_of_turn: int) -> None:
    """Refuse, at set-up, a template that is not prefix-preserving after a tool turn, for a plain
    assistant turn and for one with reasoning."""
    tool = [{"role": "tool", "content": "gspo-probe-result"}]
    plain = observation_ids(tokenizer, tool, end_of_turn)
    if observation_ids(tokenizer, tool, end_of_turn, THINKING) != plain:
        raise TemplateError("the chat template renders the turn after an assistant turn with reasoning "
                            "differently: it is not prefix-preserving for <think> turns")
