"""The endpoint's record of one batch's episodes: every call's ids, stitched into training rows.

Each agent episode has its own URL and so its own record (``EpisodeLog``). A call is turned into
the context ids the engine continues (``Recorder.chat_context`` / ``token_context``) and, once
sampled, committed to a row (``Recorder.commit``). Stitching:

* a chat call whose messages extend an earlier call of the same episode — that call's messages,
  then its reply (content and parsed tool calls compared; content may come back as ``""`` or
  ``None`` beside tool calls), then new messages — continues that call's row: its prompt, its
  sampled ids, then the chat template's observation ids for the new messages
  (``gspo.rollout.turns.observation_ids``). Among several such calls the one not yet extended
  is preferred (the latest). When that call's row has been extended since, the row is forked at it;
* a token-in call whose ids start with an earlier call's prompt and sampled ids continues it the
  same way, the rest of its ids the observation;
* anything else (the first call, or a rewritten history) is rendered afresh: a new row, counted
  in ``fresh_renders`` after the episode's first.

Rows are ``gspo.rollout.episodes.turn_loop.Row``: the sampler's ids and log-probs kept as they
are, observation ids with mask 0. Budgets are the tool loop's (``Budgets``): a call past
``max_turns``, an observation past ``max_observation_tokens`` or a context past
``max_total_tokens`` after the row's prompt is refused (``Refused``, a 400 to the agent). This
module samples nothing and serves nothing: the server and the batcher do.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field

from gspo.envs.tools import Hermes, ToolCall
from gspo.rollout.episodes.turn_loop import Budgets, Row
from gspo.rollout.turns import TemplateError, observation_ids

HERMES = Hermes()


class Refused(Exception):
    """A call the endpoint will not serve: ``status`` (4xx) and a one-line reason for the agent."""

    def __init__(self, status: int, reason: str, counter: str = "refused"):
        super().__init__(reason)
        self.status, self.reason, self.counter = status, reason, counter


# ----------------------------------------------------------------------------- messages
def canonical_arguments(arguments) -> str:
    """A tool call's arguments as sorted JSON (a JSON string is parsed first; junk kept as is)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments
    return json.dumps(arguments, sort_keys=True)


def strip_calls(text: str) -> str:
    """A turn's text without its ``<tool_call>`` blocks, stripped."""
    return HERMES.PATTERN.sub("", text).strip()


def text_of(content) -> str:
    """A message's content as text: None as "", a list of parts as their texts joined."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def key(message: dict) -> tuple:
    """What identifies a message when stitching: its role, its content (an assistant's without
    its tool-call markup) and its tool calls (name, canonical arguments)."""
    if not isinstance(message, dict):
        raise Refused(400, "each message must be a JSON object")
    role, content = message.get("role"), text_of(message.get("content"))
    calls = tuple((c.get("function", {}).get("name"), canonical_arguments(c.get("function", {}).get("arguments")))
                  for c in message.get("tool_calls") or () if isinstance(c, dict))
    if role == "assistant":
        parsed = tuple((c.name, canonical_arguments(c.arguments)) for c in HERMES.parse(content)
                       if isinstance(c, ToolCall))
        return role, strip_calls(content), calls or parsed
    return role, content.strip(), calls


def for_template(message: dict) -> dict:
    """A message as the chat template reads it: content always a string, tool calls kept."""
    out = {k: v for k, v in message.items() if k in ("role", "content", "tool_calls", "name", "tool_call_id")}
    out["content"] = text_of(message.get("content"))
    if not out.get("tool_calls"):
        out.pop("tool_calls", None)
    return out


def parse_reply(text: str) -> tuple[str | None, list[ToolCall]]:
    """An assistant turn's (content, hermes tool calls): the content without the call markup
    (None when only calls remain); unparseable calls stay in the content."""
    calls = [c for c in HERMES.parse(text) if isinstance(c, ToolCall)]
    content = strip_calls(text) if calls else text
    return (content or None) if calls else content, calls


# ----------------------------------------------------------------------------- the record
@dataclass
class Call:
    """One served call: what it asked and what it got, and where its ids are."""

    messages: tuple
    """The keys of its messages (chat), or () (token-in)."""
    reply: tuple
    """The key of its reply (chat), or ()."""
    row: int
    end: int
    """len(row.ids) after its sampled ids."""
    eos: bool
    """Its sampled ids closed with the end-of-turn token (a turn that can be continued)."""
    extended: bool = False


@dataclass
class Pending:
    """A call between ``*_context`` and ``commit``: the row it goes to and the ids to sample from."""

    row: int
    """Index into the episode's rows; len(rows) for a fresh row."""
    fork: tuple[int, int] | None
    """(row, length): the row is a copy of that row's first ``length`` ids (a branch)."""
    prompt: list[int]
    observation: list[int]
    context: list[int]
    """prompt + the row's ids so far + observation: what the engine continues."""
    room: int
    """New tokens it may take."""
    messages: tuple
    parent: Call | None
    opens: bool
    """The call opens its episode (no call before it): its batch may share prompts."""


@dataclass
class EpisodeLog:
    """One episode's rows, calls and counts."""

    rows: list[Row] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    fresh_renders: int = 0
    """Rows rendered afresh after the first (the agent rewrote its history)."""
    tool_calls: list[dict] = field(default_factory=list)
    """Every parsed call of every reply, in order ({"name", "arguments"})."""
    last_row: int | None = None
    """The row of the latest committed call."""


class Recorder:
    """The calls of ``episodes`` episodes (indices 0..n-1), stitched into rows under ``budgets``."""

    def __init__(self, tokenizer, budgets: Budgets, episodes: int, context_limit: int,
                 template_kwargs: dict | None = None):
        self.tokenizer, self.budgets, self.context_limit = tokenizer, budgets, context_limit
        self.template_kwargs = dict(template_kwargs or {})
        """The chat template's extra variables (``task.chat_template_kwargs``), in every rendering."""
        self.eos = tokenizer.eos_token_id
        self.logs = [EpisodeLog() for _ in range(episodes)]
        self.lock = threading.Lock()

    # ---------------------------------------------------------------- contexts
    def chat_context(self, e: int, messages: list, tools: list | None = None) -> Pending:
        """The ids a chat call of episode ``e`` is sampled from (Refused: why not)."""
        if not isinstance(messages, list) or not messages:
            raise Refused(400, "messages must be a non-empty list")
        keys = tuple(key(m) for m in messages)
        with self.lock:
            log = self.logs[e]
            parent = self.parent(log, lambda c: c.eos and c.messages and len(keys) > len(c.messages)
                                 and keys[:len(c.messages) + 1] == c.messages + (c.reply,))
            if parent is None:
                return self.fresh(log, self.render(messages, tools), keys)
            new = [for_template(m) for m in messages[len(parent.messages) + 1:]]
            try:     # no new message: the next assistant header alone
                obs = observation_ids(self.tokenizer, new, self.eos, template_kwargs=self.template_kwargs)
            except TemplateError as err:
                raise Refused(400, str(err)) from None
            return self.continued(log, parent, obs, keys)

    def token_context(self, e: int, ids: list) -> Pending:
        """The ids a token-in call of episode ``e`` is sampled from (Refused: why not)."""
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise Refused(400, "token_ids must be a non-empty list of integers")
        with self.lock:
            log = self.logs[e]

            def extends(c: Call) -> bool:
                row = log.rows[c.row]
                done = row.prompt + row.ids[:c.end]
                return c.eos and len(ids) > len(done) and ids[:len(done)] == done

            parent = self.parent(log, extends)
            if parent is None:
                return self.fresh(log, list(ids), ())
            row = log.rows[parent.row]
            return self.continued(log, parent, list(ids[len(row.prompt) + parent.end:]), ())

    @staticmethod
    def parent(log: EpisodeLog, extends) -> Call | None:
        """The call this one continues: the latest not yet extended, else the latest; None."""
        found = [c for c in log.calls if extends(c)]
        fresh = [c for c in found if not c.extended]
        return (fresh or found or [None])[-1]

    def render(self, messages: list, tools: list | None) -> list[int]:
        """The template's rendering of ``messages`` with the generation prompt, as ids."""
        extra = {**self.template_kwargs, **({"tools": tools} if tools else {})}
        try:
            out = self.tokenizer.apply_chat_template([for_template(m) for m in messages], tokenize=True,
                                                     add_generation_prompt=True, **extra)
        except Exception as err:  # noqa: BLE001  the agent's messages do not render
            raise Refused(400, f"the chat template cannot render these messages: {type(err).__name__}: {err}"
                          .splitlines()[0][:200]) from None
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def fresh(self, log: EpisodeLog, prompt: list[int], keys: tuple) -> Pending:
        if len(prompt) + 1 > self.context_limit:
            raise Refused(400, f"context beyond the budget: a prompt of {len(prompt)} tokens "
                               f"(the model takes {self.context_limit})")
        room = min(self.budgets.max_new_tokens, self.budgets.max_total_tokens,
                   self.context_limit - len(prompt))
        return Pending(len(log.rows), None, prompt, [], list(prompt), room, keys, None, not log.calls)

    def continued(self, log: EpisodeLog, parent: Call, obs: list[int], keys: tuple) -> Pending:
        row, b = log.rows[parent.row], self.budgets
        turns = sum(1 for c in log.calls if c.row == parent.row and c.end <= parent.end)
        if turns >= b.max_turns:
            raise Refused(400, f"turn budget: a row takes {b.max_turns} calls (multiturn.max_turns)")
        if len(obs) > b.max_observation_tokens or parent.end + len(obs) >= b.max_total_tokens:
            raise Refused(400, f"context beyond the budget: {parent.end} + {len(obs)} new tokens after "
                               f"the prompt (multiturn.max_total_tokens={b.max_total_tokens}, "
                               f"max_observation_tokens={b.max_observation_tokens})")
        done = row.ids[:parent.end]
        context = row.prompt + done + obs
        if len(context) + 1 > self.context_limit:
            raise Refused(400, f"context beyond the budget: {len(context)} tokens (the model takes "
                               f"{self.context_limit})")
        forked = len(row.ids) != parent.end
        room = min(b.max_new_tokens, b.max_total_tokens - parent.end - len(obs),
                   self.context_limit - len(context))
        return Pending(len(log.rows) if forked else parent.row, (parent.row, parent.end) if forked else None,
                       row.prompt, obs, context, room, keys, parent, False)

    # ---------------------------------------------------------------- commits
    def commit(self, e: int, p: Pending, ids: list[int], logp: list[float], text: str,
               calls: list[ToolCall], messages: list | None) -> Call:
        """Append a sampled turn (``ids``, ``logp``, its decoded ``text`` and parsed ``calls``) to
        its row; returns the call as recorded."""
        with self.lock:
            log = self.logs[e]
            if p.row == len(log.rows):
                log.rows.append(self.forked(log, p) if p.fork else Row(list(p.prompt)))
                if p.fork is None and log.rows[:-1]:
                    log.fresh_renders += 1
            row = log.rows[p.row]
            if p.observation:
                row.ids += p.observation
                row.policy += [0] * len(p.observation)
                row.logp += [0.0] * len(p.observation)
                row.observation_tokens += len(p.observation)
            if messages is not None and p.parent is not None:      # after the prompt: the new messages
                row.transcript += [for_template(m) for m in messages[len(p.parent.messages) + 1:]]
            row.ids += ids
            row.policy += [1] * len(ids)
            row.logp += list(logp)
            row.turns.append(text)
            row.transcript.append({"role": "assistant", "content": text})
            row.tool_calls += len(calls)
            log.tool_calls += [{"name": c.name, "arguments": c.arguments} for c in calls]
            content, _ = parse_reply(text)
            reply = key({"role": "assistant", "content": content,
                         "tool_calls": [{"function": {"name": c.name, "arguments": c.arguments}} for c in calls]})
            call = Call(p.messages, reply if messages is not None else (), p.row, len(row.ids),
                        bool(ids) and ids[-1] == self.eos)
            if p.parent is not None:
                p.parent.extended = True
            log.calls.append(call)
            log.last_row = p.row
            return call

    @staticmethod
    def forked(log: EpisodeLog, p: Pending) -> Row:
        """A new row: the first ``length`` ids of another (a branch of the conversation)."""
        src, n = log.rows[p.fork[0]], p.fork[1]
        return Row(list(src.prompt), ids=src.ids[:n], policy=src.policy[:n], logp=src.logp[:n],
                   turns=list(src.turns), transcript=list(src.transcript))
