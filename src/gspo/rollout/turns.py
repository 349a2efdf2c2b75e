"""Observation ids under a chat template as shipped: the template's own rendering of the
environment's messages, as ids to append after the policy's end-of-turn token, never a
re-rendering of the whole conversation.

The policy's turn ends with the end-of-turn token it sampled (``<|im_end|>``). What follows it is
read off the template's rendering of the continuing conversation — a probe user turn, the
assistant turn as the policy sampled it, the environment's messages, the next assistant header
(``add_generation_prompt``) — cut right after that assistant turn's text and end-of-turn token, so
the boundary tokens after it are kept (dropping the newline after ``<|im_end|>`` is a known way to
get this wrong). What matters is checked, not prefix preservation of whole renderings:

* the sampled turn appears verbatim in that rendering, ending at its end-of-turn token. A template
  that truly rewrites what the policy sampled once a later turn exists (e.g. strips the
  ``<think>`` reasoning of earlier turns) is refused: the appended ids would follow a history the
  policy did not write;
* the ids after it do not depend on the sampled turn (a plain answer or one with reasoning).

A template may render the *last* assistant turn differently from an earlier one — Qwen3 adds an
empty ``<think>\\n\\n</think>\\n\\n`` block to a final turn without reasoning, and its generation
prompt with ``enable_thinking=False`` ends in that block — and still serve: those tokens belong to
the prompt the policy was conditioned on, not to what it sampled, and the ids after its turn are
the same. ``template_kwargs`` (``task.chat_template_kwargs``, e.g. ``enable_thinking``) reach every
rendering.

The probe's texts are arbitrary: a template renders each message's content verbatim between its
markers, so the suffix does not depend on them (tests check it against real conversations).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from transformers import PreTrainedTokenizerBase

from gspo.errors import UserError

USER = {"role": "user", "content": "gspo-probe-question"}
PLAIN = "gspo-probe-answer"
THINKING = "<think>\ngspo-probe-reasoning\n</think>\n\ngspo-probe-answer"
"""Two sampled turns a probe continues: a plain answer and one with reasoning."""
SECOND = "gspo-probe-second-answer"
TOOL = [{"role": "tool", "content": "gspo-probe-result"}]


class TemplateError(UserError, ValueError):
    """The chat template cannot serve multi-turn rollouts (rewrites sampled turns, no end of turn)."""


def render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict], *, generation: bool,
           template_kwargs: Mapping | None = None) -> str:
    """The template's text of ``messages`` (``add_generation_prompt=generation``)."""
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation,
                                         **dict(template_kwargs or {}))


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def observation_ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict], end_of_turn: int,
                    sampled: str = PLAIN, template_kwargs: Mapping | None = None) -> list[int]:
    """Ids that follow the policy's end-of-turn token when ``messages`` answer its turn
    ``sampled``, up to and including the header of the next assistant turn (TemplateError: the
    template rewrites the sampled turn, or has no such boundary)."""
    eot = tokenizer.convert_ids_to_tokens(end_of_turn)
    turn = {"role": "assistant", "content": sampled}
    full = render(tokenizer, [USER, turn, *messages], generation=True,
                  template_kwargs=template_kwargs)
    end = sampled + eot
    at = full.rfind(end)
    if at < 0:
        raise TemplateError(f"the chat template rewrites the assistant turn the policy sampled once "
                            f"another turn follows (its text then no longer ends at {eot}; e.g. it "
                            f"strips <think> reasoning from earlier turns): multi-turn rollouts need "
                            f"a template that keeps the sampled turns as they were")
    ids, head = _encode(tokenizer, full), _encode(tokenizer, full[:at + len(end)])
    if ids[:len(head)] != head or not head or head[-1] != end_of_turn:
        raise TemplateError(f"the chat template does not close an assistant turn with token "
                            f"{end_of_turn} ({eot!r}) on a token boundary")
    return ids[len(head):]


def check_template(tokenizer: PreTrainedTokenizerBase, end_of_turn: int,
                   template_kwargs: Mapping | None = None) -> None:
    """Refuse, at set-up, a template that rewrites a sampled turn (plain or with reasoning) once
    a tool turn and a second assistant turn follow, or whose observation ids depend on it."""
    plain = observation_ids(tokenizer, TOOL, end_of_turn, PLAIN, template_kwargs)
    if observation_ids(tokenizer, TOOL, end_of_turn, THINKING, template_kwargs) != plain:
        raise TemplateError("the chat template renders the turn after an assistant turn with "
                            "reasoning differently from the turn after a plain one")
    eot = tokenizer.convert_ids_to_tokens(end_of_turn)
    for sampled in (PLAIN, THINKING):   # the first turn must survive a second one
        talk = [USER, {"role": "assistant", "content": sampled}, *TOOL,
                {"role": "assistant", "content": SECOND}, *TOOL]
        if sampled + eot not in render(tokenizer, talk, generation=True, template_kwargs=template_kwargs):
            raise TemplateError("the chat template rewrites an earlier assistant turn the policy "
                                "sampled once later turns follow (e.g. strips its <think> "
                                "reasoning): multi-turn rollouts need a template that keeps "
                                "the sampled turns as they were")
