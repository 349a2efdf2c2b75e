"""Environments (gspo.envs), typed tools and their call formats, the tool-use tasks, and the
observation ids a chat template gives a tool turn (gspo.rollout.turns)."""

from __future__ import annotations

import sys
import textwrap

import pytest

from gspo import envs, tasks
from gspo.errors import UserError
from gspo.envs.tools import (CALL_FORMATS, ToolCall, ToolError, ToolRunner, bind, load_tool)
from gspo.rewards.sandbox import Limits
from gspo.tasks.tooluse import bisect_turns, calc, lookup, lookup_value
from conftest import THINK_STRIPPING_TEMPLATE

TOOLS = "gspo_probe_tools"


@pytest.fixture(scope="module")
def tool_module(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools")
    (folder / f"{TOOLS}.py").write_text(textwrap.dedent('''
        import time
        def add(a: int, b: int) -> int:
            """Add two integers."""
            return a + b
        def shout(text: str, times: int = 1) -> str:
            return text.upper() * times
        def boom(x: int) -> int:
            raise KeyError(x)
        def slow(x: int) -> int:
            time.sleep(30)
            return x
        def hog(x: int) -> int:
            return len(bytearray(1 << 30))
        def untyped(a, b: int) -> int:
            return b
        def no_return(a: int):
            return a
        def star(*a: int) -> int:
            return 0
        def listy(a: list) -> int:
            return 0
        def bad_value(a: int) -> int:
            return [a]
    '''))
    sys.path.insert(0, str(folder))
    yield
    sys.path.remove(str(folder))
    sys.modules.pop(TOOLS, None)


def spec(name: str) -> str:
    return f"{TOOLS}:{name}"


# --------------------------------------------------------------------------------- tools
def test_typed_tools_load_and_untyped_ones_are_refused(tool_module):
    tool = load_tool(spec("add"))
    assert (tool.name, tool.params, tool.doc) == ("add", (("a", int), ("b", int)), "Add two integers.")
    for name, reason in [("untyped", "parameter 'a' must be annotated"), ("no_return", "the return must be annotated"),
                         ("star", r"\*a is not allowed"), ("listy", "parameter 'a' must be annotated"),
                         ("missing", "has no attribute")]:
        with pytest.raises(ValueError, match=reason):
            load_tool(spec(name))


def test_arguments_bind_to_the_signature_with_types(tool_module):
    add = load_tool(spec("add"))
    assert bind(add, {"a": 1, "b": "2"}) == {"a": 1, "b": 2}
    assert bind(add, ["3", "4"]) == {"a": 3, "b": 4}
    for args, reason in [({"a": 1}, "missing argument"), ({"a": 1, "b": 2, "c": 3}, "no argument 'c'"),
                         (["1"], "takes 2 argument"), ({"a": "x", "b": 1}, "'a' must be int"),
                         ({"a": 1.5, "b": 1}, "'a' must be int"), ({"a": True, "b": 1}, "'a' must be int")]:
        with pytest.raises(ValueError, match=reason):
            bind(add, args)


def test_call_formats_parse_and_answer():
    hermes, bracket = CALL_FORMATS.get("hermes"), CALL_FORMATS.get("bracket")
    text = ('I will add.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call><tool_call>{oops}</tool_call>')
    calls = hermes.parse(text)
    assert calls[:2] == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("add", {"a": 3, "b": 4})]
    assert isinstance(calls[2], str) and calls[2].startswith("could not parse the tool call '{oops}'")
    assert hermes.parse("no call here") == []
    assert hermes.answer(["3", "7"]).messages == ({"role": "tool", "content": "3"}, {"role": "tool", "content": "7"})
    assert bracket.parse("[calc 12+30] then [add 1 2] and [bad") == [ToolCall("calc", ["12+30"]), ToolCall("add", ["1", "2"])]
    assert bracket.answer(["42"]).text == "=42\n"


@pytest.mark.parametrize("sandbox", [False, True])
def test_a_failing_tool_is_an_error_observation_not_a_crash(tool_module, sandbox):
    limits = Limits(wall_s=1.0, memory_mb=256, key="multiturn.sandbox") if sandbox else None
    runner = ToolRunner([spec(n) for n in ("add", "boom", "slow", "hog", "bad_value")], sandbox=limits,
                        timeout_s=1.0)
    try:
        assert runner.run(ToolCall("add", {"a": 2, "b": 3})) == ("5", False)
        limited = ("boom", "slow", "bad_value") + (("hog",) if sandbox else ())  # memory: the sandbox's
        results = {name: runner.run(ToolCall(name, [1])) for name in limited}
        assert all(failed for _, failed in results.values()), results
        assert results["boom"][0] == ("error: boom: KeyError: 1" if sandbox else "error: boom raised KeyError: 1")
        assert "timed out after 1 s" in results["slow"][0]
        if sandbox:
            assert results["hog"][0] == ("error: hog: MemoryError: the sandbox's memory limit was hit "
                                         "(multiturn.sandbox_memory_mb = 256 MB for the worker's whole address space)")
        assert "returned list" in results["bad_value"][0]
        assert runner.run(ToolCall("nope", [])) == ("error: unknown tool 'nope'; tools: add, boom, slow, hog, bad_value", True)
        assert runner.run("could not parse") == ("error: could not parse", True)
        assert runner.run(ToolCall("add", {"a": 2, "b": 3})) == ("5", False)     # the run goes on
    finally:
        runner.close()


def test_on_tool_error_fail_stops_the_run(tool_module):
    runner = ToolRunner([spec("boom")], on_tool_error="fail")
    with pytest.raises(ToolError, match=r"tool call failed: boom raised KeyError: 1 \(multiturn.on_tool_error=fail\)"):
        runner.run(ToolCall("boom", [1]))


def test_the_tool_environment_answers_calls_and_ends_without_one(tool_module):
    runner = ToolRunner([spec("add")])
    example = tasks.Example("q", "a")
    env = envs.build("tools", example, runner=runner, call_format="bracket")
    reply = env.step(envs.Turn("[add 2 40]"))
    assert (reply.observation.text, reply.tool_calls, reply.tool_errors) == ("=42\n", 1, 0)
    reply = env.step(envs.Turn("[add 2] [add 1 1]"))
    assert reply.observation.text == "=error: add takes 2 argument(s) (a, b), got 1\n=2\n" and reply.tool_errors == 1
    assert env.step(envs.Turn("#42")).observation is None                       # no call: done
    assert envs.build("tools", example, runner=runner, call_format="bracket").step(
        envs.Turn("[add 2 40]", ended=False)).observation is None              # cut by a budget: done
    assert len(env.calls) == 3 and env.calls[0] == {"call": {"name": "add", "arguments": ["2", "40"]},
                                                    "result": "42", "failed": False}


def test_environments_registry_and_user_classes():
    assert envs.available() == ["guess", "single", "tools"]
    assert envs.build("single", tasks.Example("q", "a")).step(envs.Turn("x")).observation is None
    with pytest.raises(ValueError, match="unknown environment 'nope'; valid environments: guess, single, tools"):
        envs.build("nope", tasks.Example("q", "a"))
    with pytest.raises(ValueError, match="environment 'no_such_mod:Env': cannot import module 'no_such_mod'"):
        envs.check("no_such_mod:Env", {})
    with pytest.raises(ValueError, match="unexpected argument"):
        envs.check("single", {"budget": 3})


# --------------------------------------------------------------------------------- tasks
def test_calculator_task():
    t = tasks.build("calculator", n_train=200, n_test=20, call_fraction=0.3)
    train = t.split("train")
    calling = [e for e in train if len(e.data["turns"]) == 2]
    assert 0.15 < len(calling) / len(train) < 0.45                       # about call_fraction
    e = calling[0]
    a, b = map(int, e.prompt[2:-1].split("+"))
    assert e.data["turns"] == [f"[calc {a}+{b}]", f"#{a + b}"] and e.answer == f"#{a + b}"
    assert t.reward(f"#{a + b}", e) == 1.0 and t.reward(f"#{a + b + 1}", e) == 0.0 and t.reward("", e) == 0.0
    assert calc(f"{a}+{b}") == str(a + b)
    with pytest.raises(ValueError, match="calc adds two numbers"):
        calc("2*3")


def test_lookup_values_exist_only_behind_the_tool():
    t = tasks.build("lookup", n_train=50, n_test=10)
    e = t.split("test")[0]
    key = e.prompt[2:-1]
    assert lookup(key) == lookup_value(key) == e.data["value"] and len(e.data["value"]) == 4
    assert e.data["turns"] == [f"[lookup {key}]", f"#{e.data['value']}"]
    assert len({lookup_value(k) for k in ("aaaa", "aaab", "aaac", "aaad")}) == 4


def test_guess_task_and_environment_need_several_turns_of_feedback():
    assert bisect_turns(9, 16) == ["8", "12", "10", "9"]
    assert bisect_turns(8, 16) == ["8"] and len(bisect_turns(16, 16)) == 5     # at most bits + 1
    t = tasks.build("guess", n_train=30, n_test=5, bits=4)
    e = next(x for x in t.split("train") if len(x.data["turns"]) >= 3)
    env = envs.build("guess", e)
    answers = [env.step(envs.Turn(turn)).observation for turn in e.data["turns"]]
    assert answers[-1] is None and all(o.text in ("<\n", ">\n") for o in answers[:-1])
    assert t.reward(e.data["turns"][-1], e) == 1.0 and t.reward(e.data["turns"][0], e) == 0.0
    assert envs.build("guess", e).step(envs.Turn("x")).observation is None     # not a number: done


# ----------------------------------------------------------------------- chat templates
def test_observation_ids_are_the_templates_own_render_boundary_newline_included():
    from gspo.rollout.tokenization import build_bpe_tokenizer
    from gspo.rollout.turns import check_template, observation_ids
    tok = build_bpe_tokenizer(["user what is 12+3", "assistant 15", "tool 15"], 300)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    suffix = observation_ids(tok, [{"role": "tool", "content": "15"}], eot)
    assert tok.decode(suffix) == "\n<|im_start|>tool\n15<|im_end|>\n<|im_start|>assistant\n"
    # equal to the template's render of a real conversation after the assistant's <|im_end|>
    talk = [{"role": "user", "content": "what is 12+3"}, {"role": "assistant", "content": "[calc]"}]
    before = tok.apply_chat_template(talk, tokenize=True)["input_ids"]
    full = tok.apply_chat_template(talk + [{"role": "tool", "content": "15"}], tokenize=True,
                                   add_generation_prompt=True)["input_ids"]
    cut = len(before) - 1                      # before ends with <|im_end|> "\n"
    assert before[cut - 1] == eot and full[cut:] == suffix
    check_template(tok, eot)


def test_a_template_that_rewrites_history_is_refused():
    from gspo.rollout.tokenization import build_bpe_tokenizer
    from gspo.rollout.turns import TemplateError, check_template
    tok = build_bpe_tokenizer(["user x", "assistant y"], 300)
    tok.chat_template = THINK_STRIPPING_TEMPLATE
    with pytest.raises(TemplateError, match="rewrites"):
        check_template(tok, tok.convert_tokens_to_ids("<|im_end|>"))


# ------------------------------------------------------------------ a user's environment, guarded
ENVS = "gspo_probe_envs"


@pytest.fixture(scope="module")
def env_module(tmp_path_factory):
    """User environments that work, raise (constructor, step), answer no Reply, or hang."""
    folder = tmp_path_factory.mktemp("envs")
    (folder / f"{ENVS}.py").write_text(textwrap.dedent('''
        import time
        from gspo.envs import Observation, Reply
        from gspo.errors import UserError
        class Base:
            def __init__(self, example, wait=0.0):
                self.wait = wait
            def reward(self):
                return None
        class Counter(Base):
            def step(self, turn):
                return Reply(None) if turn.text == "stop" else Reply(Observation(text="+"))
        class BadInit(Base):
            def __init__(self, example):
                raise RuntimeError("no table for " + example.answer)
        class Raises(Base):
            def step(self, turn):
                raise KeyError(turn.text)
        class NotAReply(Base):
            def step(self, turn):
                return "ok"
        class BadObservation(Base):
            def step(self, turn):
                return Reply("ok")
        class Hangs(Base):
            def step(self, turn):
                time.sleep(self.wait)
                return Reply(None)
        class SlowInit(Base):
            def __init__(self, example):
                time.sleep(2)
        class Stops(Base):
            def step(self, turn):
                raise UserError("the user's own one line")
    '''))
    sys.path.insert(0, str(folder))
    yield
    sys.path.remove(str(folder))
    sys.modules.pop(ENVS, None)


EXAMPLE = tasks.Example("What is 2+3?", "5")
FAULTS = [   # (class, where it fails, the error as the line gives it)
    ("BadInit", "constructor", "RuntimeError: no table for 5"),
    ("SlowInit", "constructor", "timed out after 0.5 s"),
    ("Raises", "step (turn 1 'go')", "KeyError: 'go'"),
    ("NotAReply", "step (turn 1 'go')", "step returned str, expected gspo.envs.Reply"),
    ("BadObservation", "step (turn 1 'go')",
     "step returned a Reply whose observation is str, expected gspo.envs.Observation or None"),
    ("Hangs", "step (turn 1 'go')", "timed out after 0.5 s"),
]


def line(name: str, where: str, error: str) -> str:
    return (f"environment '{ENVS}:{name}' failed in {where} (example 'What is 2+3?'): {error}")


@pytest.mark.parametrize("name, where, error", FAULTS)
def test_a_failing_user_environment_stops_the_run_in_one_line(env_module, name, where, error):
    from gspo.envs.guard import EnvError, Guard
    params = {"wait": 30.0} if name == "Hangs" else {}
    guard = Guard(f"{ENVS}:{name}", params, timeout_s=0.5, on_error="fail")
    with pytest.raises(EnvError) as err:
        guard(EXAMPLE).step(envs.Turn("go"))
    assert str(err.value) == (f"{line(name, where, error)}. multiturn.on_env_error=fail: fix the "
                              f"environment, or set multiturn.on_env_error=end to end such "
                              f"episodes and count them")


@pytest.mark.parametrize("name, where, error", FAULTS)
def test_under_end_a_failing_user_environment_ends_the_episode_counted(env_module, capsys, name,
                                                                       where, error):
    from gspo.envs.guard import Guard
    from gspo.rollout.episodes.turn_loop import Budgets, episode_metrics, run_episodes
    params = {"wait": 30.0} if name == "Hangs" else {}
    guard = Guard(f"{ENVS}:{name}", params, timeout_s=0.5, on_error="end")
    environments = [guard(EXAMPLE), Guard(f"{ENVS}:Counter", {}, on_error="end")(EXAMPLE)]
    turns = {0: [[65]], 1: [[65], [66]]}                         # row 1 goes on: two turns
    sample = lambda contexts, room, rows: [(turns[i].pop(0) + [0], [0.0, 0.0]) for i in rows]
    rows = run_episodes(sample, [[1], [1]], environments, lambda obs: [43],
                        lambda ids: "".join(map(chr, ids)), 0,
                        Budgets(max_turns=2, max_new_tokens=4, max_total_tokens=20))
    assert [r.end for r in rows] == ["env_error", "turns"] and len(rows[0].turns) == 1
    metrics = episode_metrics(rows)
    assert metrics["multiturn/end_env_error"] == 0.5 and metrics["multiturn/env_errors_mean"] == 0.5
    warned = capsys.readouterr().err.strip()
    said = line(name, where, error).replace("'go'", "'A'")                 # this turn's text: A
    assert warned == f"warning: {said}; the episode ends (multiturn/env_errors_mean)"


def test_a_guarded_environment_answers_as_its_own_and_passes_a_user_error_on(env_module):
    from gspo.envs.guard import EnvError, Guard
    guard = Guard(f"{ENVS}:Counter", {}, on_error="end")
    env = guard(EXAMPLE)
    assert env.step(envs.Turn("go")) == envs.Reply(envs.Observation(text="+"))
    assert env.step(envs.Turn("stop")) == envs.Reply(None) and env.reward() is None
    with pytest.raises(UserError, match="^the user's own one line$"):     # as raised, whatever the policy
        Guard(f"{ENVS}:Stops", {}, on_error="end")(EXAMPLE).step(envs.Turn("go"))
    with pytest.raises(EnvError, match="failed in constructor"):          # the cold start's: strict
        Guard(f"{ENVS}:BadInit", {}, on_error="end").strict()(EXAMPLE)


def test_too_many_hung_steps_stop_the_run(env_module):
    from gspo.envs.guard import EnvError, Guard
    guard = Guard(f"{ENVS}:Hangs", {"wait": 30.0}, timeout_s=0.2, on_error="end", max_hung=1)
    env = guard(EXAMPLE)
    assert env.step(envs.Turn("go")).error is not None
    with pytest.raises(EnvError, match=f"^environment '{ENVS}:Hangs' hung 2 times "
                                       r"\(multiturn.env_timeout_s=0.2\); each leaves a thread running"):
        env.step(envs.Turn("go"))
