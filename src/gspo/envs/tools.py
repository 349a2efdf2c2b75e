"""The generic tool environment: tool calls parsed from the policy's turn, typed Python functions
run (in-process with a timeout, or in the reward sandbox's limited process), results answered.

    multiturn: {env: tools, tools: [mymod:add], call_format: hermes, sandbox: true}

* A **tool** is a typed function ``def add(a: int, b: int) -> int``: every parameter annotated
  with str, int, float or bool, the return too, no ``*args`` / ``**kwargs`` (``load_tool``
  refuses anything else in one line, before a model is built). Its docstring is its description:
  ``tool_schema`` writes it as a JSON schema (``transformers.utils.get_json_schema``'s convention,
  the docstring's ``Args:`` describing each parameter), which chat prompts pass to the template
  as ``tools=`` (the ``<tools>`` block of hermes templates such as Qwen3's).
* A **call format** reads the calls out of a turn and writes the results back:
  ``hermes`` (Hermes / Qwen3 chat models: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  answered by ``tool`` messages for the chat template to render) and ``bracket`` (a format for the
  character tokenizer: ``[add 12 30]``, arguments split on spaces, answered by the text
  ``=42`` and a newline).
* A turn with no call ends the episode; so does a turn a budget cut (no end-of-turn token). A call
  that cannot be parsed (bad JSON, an unclosed ``<tool_call>``) counts as a parse error
  (``multiturn/tool_parse_errors``), so a run that never manages a call is visible.
* A tool that raises, hangs past ``timeout_s``, exceeds the sandbox's limits or gets arguments
  that do not fit its signature answers ``error: ...`` and counts as a tool error
  (``on_tool_error: observe``); ``fail`` stops the run with the error instead.

This module does not tokenize; the rollout loop turns the observation into ids.
"""

from __future__ import annotations

import inspect
import json
import re
import typing
from dataclasses import dataclass
from typing import Callable

from transformers.utils import get_json_schema
from transformers.utils.chat_template_utils import DocstringParsingException

from gspo.envs.base import Observation, Reply, Turn, register
from gspo.errors import RewardFault, UserError
from gspo.registry import Registry
from gspo.rewards.isolation import TimedCaller
from gspo.rewards.sandbox import Limits, SandboxedFunction
from gspo.tasks.base import Example
from gspo.tasks.custom import load_function

TOOL_TYPES = (str, int, float, bool)
ON_TOOL_ERROR = ("observe", "fail")


class ToolError(UserError):
    """A tool failed under ``on_tool_error: fail``: the run stops, naming the tool and the call."""


@dataclass(frozen=True)
class Tool:
    """One typed tool function."""

    name: str
    fn: Callable
    spec: str
    """``module:function``, as configured."""
    params: tuple[tuple[str, type], ...]
    """(name, type) of each parameter, in order."""
    doc: str


def load_tool(spec: str) -> Tool:
    """Import ``module:function`` and check that it is a typed tool (ValueError, one line)."""
    fn = load_function(spec)
    try:
        hints = typing.get_type_hints(fn)
    except Exception as err:  # noqa: BLE001  unresolvable annotations
        raise ValueError(f"tool {spec!r}: cannot read its type annotations: {err}") from None
    params = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ValueError(f"tool {spec!r}: *{p.name} is not allowed (a tool's arguments are named and typed)")
        if hints.get(p.name) not in TOOL_TYPES:
            raise ValueError(f"tool {spec!r}: parameter {p.name!r} must be annotated with one of "
                             f"str, int, float, bool (got {hints.get(p.name, 'no annotation')})")
        params.append((p.name, hints[p.name]))
    if hints.get("return") not in TOOL_TYPES:
        raise ValueError(f"tool {spec!r}: the return must be annotated with one of str, int, float, "
                         f"bool (got {hints.get('return', 'no annotation')})")
    return Tool(fn.__name__, fn, spec, tuple(params), inspect.getdoc(fn) or "")


JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}


def tool_schema(tool: Tool) -> dict:
    """The tool as a JSON schema (``get_json_schema``: name, description, each parameter's type and
    description); a docstring without ``Args:`` gives the parameters' types only."""
    try:
        return get_json_schema(tool.fn)
    except DocstringParsingException:
        return {"type": "function", "function": {
            "name": tool.name, "description": tool.doc.split("\n\n")[0].strip(),
            "parameters": {"type": "object",
                           "properties": {n: {"type": JSON_TYPES[t]} for n, t in tool.params},
                           "required": [n for n, _ in tool.params]}}}


def tool_schemas(specs: list[str]) -> list[dict]:
    """The JSON schemas of the tools ``specs`` name (``module:function``), in order."""
    return [tool_schema(load_tool(spec)) for spec in specs]


def bind(tool: Tool, arguments: dict | list) -> dict:
    """The call's arguments as the tool's typed keywords (ValueError saying what does not fit)."""
    names = [n for n, _ in tool.params]
    if isinstance(arguments, list):
        if len(arguments) != len(names):
            raise ValueError(f"{tool.name} takes {len(names)} argument(s) ({', '.join(names)}), got {len(arguments)}")
        arguments = dict(zip(names, arguments))
    if unknown := sorted(set(arguments) - set(names)):
        raise ValueError(f"{tool.name} has no argument {', '.join(map(repr, unknown))}")
    if missing := [n for n in names if n not in arguments]:
        raise ValueError(f"{tool.name} is missing argument(s) {', '.join(map(repr, missing))}")
    return {n: _coerce(arguments[n], kind, n) for n, kind in tool.params}


def _coerce(value, kind: type, name: str):
    if kind is bool:
        if isinstance(value, bool) or value in ("true", "false"):
            return value if isinstance(value, bool) else value == "true"
    elif kind is str:
        if isinstance(value, str):
            return value
    elif not isinstance(value, bool):
        try:
            out = kind(value)
            if kind is int and isinstance(value, float) and value != out:
                raise ValueError
            return out
        except (TypeError, ValueError):
            pass
    raise ValueError(f"argument {name!r} must be {kind.__name__}, got {value!r:.40}")


# -------------------------------------------------------------------------------- call formats
@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its arguments (named, or positional)."""

    name: str
    arguments: dict | list


class CallFormat(typing.Protocol):
    def parse(self, text: str) -> list[ToolCall | str]:
        """The calls of a turn, in order; a string stands for a call that could not be parsed."""
        ...

    def answer(self, results: list[str]) -> Observation:
        """The observation for the results of the turn's calls, in order."""
        ...

    def unclosed(self, text: str) -> int:
        """Calls begun but never closed (they parse as no call, and count as parse errors)."""
        ...


CALL_FORMATS: Registry[CallFormat] = Registry("tool call format")


class Hermes:
    """``<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>``, answered by tool messages."""

    PATTERN = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall | str]:
        calls: list[ToolCall | str] = []
        for body in self.PATTERN.findall(text):
            try:
                call = json.loads(body)
                args = call.get("arguments", {})
                args = json.loads(args) if isinstance(args, str) else args
                if not isinstance(call.get("name"), str) or not isinstance(args, dict):
                    raise ValueError("needs a string 'name' and an object 'arguments'")
                calls.append(ToolCall(call["name"], args))
            except (ValueError, AttributeError) as err:
                calls.append(f"could not parse the tool call {body[:60]!r}: {err}")
        return calls

    def answer(self, results: list[str]) -> Observation:
        return Observation(messages=tuple({"role": "tool", "content": r} for r in results))

    def unclosed(self, text: str) -> int:
        return max(0, text.count("<tool_call>") - len(self.PATTERN.findall(text)))


class Bracket:
    """``[add 12 30]`` (name, then arguments split on spaces), answered by ``=42`` + newline each."""

    PATTERN = re.compile(r"\[([A-Za-z_]\w*)((?: [^\[\] ]+)*)\]")

    def parse(self, text: str) -> list[ToolCall | str]:
        return [ToolCall(name, args.split()) for name, args in self.PATTERN.findall(text)]

    def answer(self, results: list[str]) -> Observation:
        return Observation(text="".join(f"={r}\n" for r in results))

    def unclosed(self, text: str) -> int:
        return 0


CALL_FORMATS.add("hermes", Hermes())
CALL_FORMATS.add("bracket", Bracket())


# ------------------------------------------------------------------------------------- running
class ToolRunner:
    """The run's tools, each called in-process with a timeout, or in a sandbox worker of its own."""

    def __init__(self, specs: list[str], *, sandbox: Limits | None = None, timeout_s: float = 10.0,
                 on_tool_error: str = "observe", max_hung: int = 8):
        if on_tool_error not in ON_TOOL_ERROR:
            raise ValueError(f"on_tool_error must be one of {', '.join(ON_TOOL_ERROR)}, got {on_tool_error!r}")
        self.tools = {}
        for spec in specs:
            tool = load_tool(spec)
            if tool.name in self.tools:
                raise ValueError(f"two tools are named {tool.name!r} ({self.tools[tool.name].spec}, {spec})")
            self.tools[tool.name] = tool
        self.on_tool_error = on_tool_error
        self.caller = TimedCaller(timeout_s, max_hung)
        self.sandboxes = {name: SandboxedFunction(t.spec, sandbox, kind="tool")
                          for name, t in self.tools.items()} if sandbox else {}

    def schemas(self) -> list[dict]:
        """Each tool's JSON schema (``tool_schema``), in the configured order."""
        return [tool_schema(t) for t in self.tools.values()]

    def run(self, call: ToolCall | str) -> tuple[str, bool]:
        """(the result's text, failed) of one parsed call."""
        try:
            tool, kwargs = self.resolve(call)
        except ValueError as err:                      # the call's fault: unparsed, unknown, bad arguments
            return self.failed(str(err))
        try:
            if tool.name in self.sandboxes:
                value = self.sandboxes[tool.name](**kwargs)
            else:
                value = self.caller(tool.fn, **kwargs)
        except RewardFault as err:                     # a timeout, a sandbox limit, a bad return value
            return self.failed(f"{tool.name}: {err}")
        except Exception as err:  # noqa: BLE001       the tool's own exception
            return self.failed(f"{tool.name} raised {type(err).__name__}: {err}")
        if not isinstance(value, TOOL_TYPES):
            return self.failed(f"{tool.name} returned {type(value).__name__}, expected str, int, float or bool")
        return _text(value), False

    def resolve(self, call: ToolCall | str) -> tuple[Tool, dict]:
        """The tool a parsed call names and its typed arguments (ValueError: why not)."""
        if isinstance(call, str):
            raise ValueError(call)
        if call.name not in self.tools:
            raise ValueError(f"unknown tool {call.name!r}; tools: {', '.join(self.tools)}")
        return self.tools[call.name], bind(self.tools[call.name], call.arguments)

    def failed(self, message: str) -> tuple[str, bool]:
        """An error observation (``observe``), or the run stopped (``fail``)."""
        if self.on_tool_error == "fail":
            raise ToolError(f"tool call failed: {message} (multiturn.on_tool_error=fail)")
        return f"error: {message}", True

    def close(self) -> None:
        for sandbox in self.sandboxes.values():
            sandbox.close()


def _text(value) -> str:
    """A tool's value as the observation shows it: a string as is, a number or bool as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


@register("tools")
class ToolEnv:
    """Answers each turn's tool calls with their results; done at a turn without a call."""

    def __init__(self, example: Example, *, runner: ToolRunner, call_format: str = "hermes"):
        self.example, self.runner, self.format = example, runner, CALL_FORMATS.get(call_format)
        self.calls: list[dict] = []

    def step(self, turn: Turn) -> Reply:
        calls = self.format.parse(turn.text) if turn.ended else []
        unclosed = self.format.unclosed(turn.text) if turn.ended else 0
        if not calls:
            return Reply(None, parse_errors=unclosed)
        results, errors = [], 0
        for call in calls:
            text, failed = self.runner.run(call)
            results.append(text)
            errors += failed
            self.calls.append({"call": call if isinstance(call, str) else {"name": call.name, "arguments": call.arguments},
                               "result": text, "failed": failed})
        return Reply(self.format.answer(results), tool_calls=len(calls), tool_errors=errors,
                     parse_errors=unclosed + sum(isinstance(c, str) for c in calls),
                     info={"calls": self.calls})

    def reward(self) -> float | None:
        return None
