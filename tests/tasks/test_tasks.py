"""Tests for gspo.tasks: registry, the seeded generators, the verifiers, the custom JSONL task."""

import json
import string
import sys
from collections import Counter

import pytest

from gspo import tasks
from gspo.tasks import Example, Task, TaskDataError
from gspo.tasks import base
from gspo.tasks.countdown import ExpressionError, evaluate, literals, parse_expression

GENERATED = ["arithmetic", "multistep", "countdown"]
SMALL = dict(n_train=300, n_test=50)


# --------------------------------------------------------------------------------- registry


def test_registry_lists_builtins():
    assert set(GENERATED + ["custom"]) <= set(tasks.available())
    assert tasks.get("arithmetic").name == "arithmetic"


def test_unknown_task_lists_valid_names():
    with pytest.raises(ValueError, match="unknown task 'nope'.*arithmetic.*countdown.*custom.*multistep"):
        tasks.get("nope")
    with pytest.raises(ValueError, match="unknown task"):
        tasks.build("nope")


def test_build_bad_kwarg_lists_valid_ones():
    valid = "valid arguments: seed, n_train, n_test, n_val, max_digits, ops, max_mul_digits"
    with pytest.raises(ValueError, match=f"task 'arithmetic'.*'max_digitz'; {valid}"):
        tasks.build("arithmetic", max_digitz=3)


def test_register_new_task_and_duplicate(monkeypatch):
    monkeypatch.setattr(base, "_REGISTRY", base._REGISTRY.copy())

    @tasks.register("echo")
    class Echo:
        name = "echo"

        def __init__(self, word: str = "hi"):
            self.word = word

        def split(self, name):
            return [Example(self.word + ":", self.word, {})]

        def reward(self, completion, example):
            return float(completion == example.answer)

        def is_correct(self, completion, example):
            return self.reward(completion, example) == 1.0

    t = tasks.build("echo", word="yo")
    assert isinstance(t, Task) and "echo" in tasks.available()
    assert t.split("train")[0].prompt == "yo:"
    with pytest.raises(ValueError, match="already registered"):
        tasks.register("echo")(Echo)


@pytest.mark.parametrize("name", GENERATED)
def test_unknown_split(name):
    with pytest.raises(ValueError, match="unknown split 'dev'.*train, test"):
        tasks.build(name, n_train=5, n_test=5).split("dev")


# ------------------------------------------------------------------ generated tasks, shared


@pytest.mark.parametrize("name", GENERATED)
def test_deterministic_and_seed_dependent(name):
    a, b = tasks.build(name, seed=1, **SMALL), tasks.build(name, seed=1, **SMALL)
    c = tasks.build(name, seed=2, **SMALL)
    assert isinstance(a, Task)
    for split in ("train", "test"):
        assert a.split(split) == b.split(split)
        assert [e.prompt for e in a.split(split)] != [e.prompt for e in c.split(split)]


@pytest.mark.parametrize("name", GENERATED)
def test_splits_sized_distinct_and_disjoint(name):
    t = tasks.build(name, **SMALL)
    train, test = [e.prompt for e in t.split("train")], [e.prompt for e in t.split("test")]
    assert (len(train), len(test)) == (300, 50)
    assert len(set(train)) == 300 and len(set(test)) == 50
    assert not set(train) & set(test)


@pytest.mark.parametrize("name", GENERATED)
def test_test_split_does_not_move_with_n_train(name):
    small, big = tasks.build(name, n_train=10, n_test=20), tasks.build(name, n_train=400, n_test=20)
    assert small.split("test") == big.split("test")


@pytest.mark.parametrize("name", GENERATED)
def test_demonstrations_are_correct_short_ascii(name):
    t = tasks.build(name, **SMALL)
    printable = set(string.printable) - set("\n\r\t\x0b\x0c")
    for e in t.split("train") + t.split("test"):
        assert t.reward(e.answer, e) == 1.0 and t.is_correct(e.answer, e)
        assert set(e.prompt + e.answer) <= printable
        assert len(e.prompt) <= 30


def test_prompt_space_too_small_is_an_error():
    # 1-digit "+": only 100 distinct prompts
    with pytest.raises(ValueError, match="found only 100 distinct prompts, 250 requested"):
        tasks.build("arithmetic", max_digits=1, ops="+", n_train=200, n_test=50)


@pytest.mark.parametrize("name", ["arithmetic", "multistep", "countdown"])
def test_validation_split_is_disjoint_and_moves_nothing_else(name):
    task = tasks.build(name, seed=3, n_train=300, n_test=50, n_val=40)
    train, test, val = ({e.prompt for e in task.split(s)} for s in ("train", "test", "validation"))
    assert (len(train), len(test), len(val)) == (300, 50, 40)
    assert not (val & train) and not (val & test) and not (train & test)
    # drawn last: train and test are those of a task without validation examples
    none = tasks.build(name, seed=3, n_train=300, n_test=50, n_val=0)
    assert none.split("train") == task.split("train") and none.split("test") == task.split("test")
    assert none.split("validation") == []


def test_split_returns_a_copy():
    t = tasks.build("arithmetic", **SMALL)
    t.split("train").clear()
    assert len(t.split("train")) == 300


# ------------------------------------------------------------------------------- arithmetic


def test_arithmetic_format_and_defaults():
    t = tasks.build("arithmetic", n_train=500, n_test=10)
    for e in t.split("train"):
        a, op, b = e.prompt[:-1].partition("+") if "+" in e.prompt else e.prompt[:-1].partition("-")
        assert e.prompt.endswith("=") and op in "+-" and int(a) < 100 and int(b) < 100
        assert e.answer == str(int(a) + int(b) if op == "+" else int(a) - int(b)) == str(e.data["target"])
        assert int(e.answer) >= 0  # subtraction is ordered


def test_arithmetic_multiplication_second_operand_small():
    t = tasks.build("arithmetic", ops="*", n_train=200, n_test=10)
    for e in t.split("train"):
        a, b = e.prompt[:-1].split("*")
        assert int(b) < 10 and e.answer == str(int(a) * int(b))


def test_arithmetic_bad_ops():
    with pytest.raises(ValueError, match="ops"):
        tasks.build("arithmetic", ops="+/")


def test_arithmetic_verifier():
    t = tasks.build("arithmetic", n_train=1, n_test=1)
    e = Example("37+45=", "82", {"target": 82})
    assert t.reward("82", e) == 1.0 and t.reward(" 82\n", e) == 1.0 and t.is_correct("82", e)
    assert t.reward("83", e) == 0.0 and not t.is_correct("83", e)  # wrong
    for bad in ["", "8 2", "082", "82#", "82=82", "eighty-two"]:  # malformed
        assert t.reward(bad, e) == 0.0


# -------------------------------------------------------------------------------- multistep


def test_multistep_format():
    t = tasks.build("multistep", **SMALL)
    for e in t.split("train"):
        nums = [int(x) for x in e.prompt[2:-1].split()]
        assert e.prompt == "S " + " ".join(map(str, nums)) + ":" and nums == e.data["numbers"]
        steps, total = [], nums[0]
        for x in nums[1:]:
            steps.append(f"{total}+{x}={total + x}")
            total += x
        assert e.answer == ",".join(steps) + f"#{total}" and e.data["target"] == total


def test_multistep_verifier():
    t = tasks.build("multistep", n_train=1, n_test=1)
    e = Example("S 12 7 31 5:", "12+7=19,19+31=50,50+5=55#55", {"numbers": [12, 7, 31, 5], "target": 55})
    assert t.reward(e.answer, e) == 1.0 and t.is_correct(e.answer, e)
    assert t.reward("#55", e) == 1.0  # only the final answer is graded (documented)
    assert t.reward("12+7=19,19+31=50,50+5=54#54", e) == 0.0  # wrong
    assert t.reward("12+7=19,19+31=50,50+5=55#56", e) == 0.0
    for bad in ["", "55", "12+7=19,19+31=50,50+5=55", "#", "#55x", "#5 5"]:  # malformed
        assert t.reward(bad, e) == 0.0


def test_multistep_answer_lengths_span_short_to_long():
    t = tasks.build("multistep", n_train=2000, n_test=10)
    lengths = [len(e.answer) for e in t.split("train")]
    assert min(lengths) <= 12 and max(lengths) >= 60
    by_terms: dict[int, list[int]] = {}
    for e, n in zip(t.split("train"), lengths):
        by_terms.setdefault(len(e.data["numbers"]), []).append(n)
    assert set(by_terms) == set(range(2, 9))
    means = [sum(v) / len(v) for _, v in sorted(by_terms.items())]
    assert means == sorted(means)  # length grows with the number of terms


def test_multistep_flawed_min_terms_spares_short_lists():
    """Below flawed_min_terms every demonstration is right; from it on the flawed teacher drops
    the last number at about flawed_fraction; the prompts are the same as without the option."""
    kw = dict(n_train=3000, n_test=10, min_terms=3, max_terms=8, max_value=9, flawed_fraction=0.7)
    spared, plain = tasks.build("multistep", flawed_min_terms=6, **kw), tasks.build("multistep", **kw)
    assert [e.prompt for e in spared.split("train")] == [e.prompt for e in plain.split("train")]
    short = [e for e in spared.split("train") if len(e.data["numbers"]) < 6]
    long = [e for e in spared.split("train") if len(e.data["numbers"]) >= 6]
    assert all(e.answer.endswith(f"#{e.data['target']}") for e in short)
    dropped = [e.answer.endswith(f"#{sum(e.data['numbers'][:-1])}") for e in long]
    assert len(long) > 1000 and 0.65 < sum(dropped) / len(long) < 0.75
    with pytest.raises(ValueError, match="flawed_min_terms"):
        tasks.build("multistep", flawed_min_terms=-1)


def test_multistep_labelled_format():
    t = tasks.build("multistep", labelled=True, min_terms=3, max_terms=26, **SMALL)
    for e in t.split("train"):
        items = e.prompt[2:-1].split()
        labels, nums = [x[0] for x in items], [int(x[1:]) for x in items]
        assert labels == list(string.ascii_lowercase[:len(nums)]) and nums == e.data["numbers"]
        steps = e.answer.split("#")[0].split(",")
        assert [step.split("+")[1].split("=")[0] for step in steps] == items[1:]  # "b7", "c31", ...
    e = Example("S a12 b7 c31 d5:", "12+b7=19,19+c31=50,50+d5=55#55",
                {"numbers": [12, 7, 31, 5], "target": 55})
    assert t.reward(e.answer, e) == 1.0 and t.reward("12+b7=19,19+c31=50#50", e) == 0.0
    with pytest.raises(ValueError, match="at most 26 terms"):
        tasks.build("multistep", labelled=True, max_terms=27)


def test_multistep_labelled_hand_example():
    # The first training example of seed 0 with these settings, worked out by hand.
    t = tasks.build("multistep", labelled=True, min_terms=3, max_terms=10, max_value=9, n_train=1, n_test=1)
    e = t.split("train")[0]
    assert e.prompt == "S a9 b3 c5 d3 e2 f5:"
    assert e.answer == "9+b3=12,12+c5=17,17+d3=20,20+e2=22,22+f5=27#27" and e.data["target"] == 27


# -------------------------------------------------------------------------------- countdown


def test_countdown_instances_solvable_with_each_number_once():
    t = tasks.build("countdown", **SMALL)
    for e in t.split("train") + t.split("test"):
        nums, target = e.data["numbers"], e.data["target"]
        assert 3 <= len(nums) <= 4 and all(1 <= x <= 20 for x in nums) and 1 <= target <= 100
        assert e.prompt == " ".join(map(str, sorted(nums))) + f">{target}:"
        node = parse_expression(e.answer)
        assert Counter(literals(node)) == Counter(nums) and evaluate(node) == target


CD = Example("3 5 7>22:", "3*5+7", {"numbers": [3, 5, 7], "target": 22})


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("3*5+7", 1.0),
        (" 7+5*3 ", 1.0),
        ("(7+(5*3))", 1.0),
        ("(3+5)*7", 0.1),  # well-formed, wrong value
        ("7-5-3", 0.1),  # negative value: still well-formed
        ("3+5", 0.0),  # 7 unused: each number exactly once
        ("3*5+7+7", 0.0),  # 7 twice
        ("3*5+8", 0.0),  # 8 not given
        ("22", 0.0),
        ("", 0.0),
        ("garbage", 0.0),
        ("3*5+7=22", 0.0),
        ("3*5+", 0.0),
        ("3**5+7", 0.0),
        ("__import__('os')", 0.0),
    ],
)
def test_countdown_verifier(completion, expected):
    t = tasks.build("countdown", n_train=1, n_test=1)
    assert t.reward(completion, CD) == expected
    assert t.is_correct(completion, CD) == (expected == 1.0)


def test_countdown_exact_fractions_and_division_by_zero():
    t = tasks.build("countdown", n_train=1, n_test=1)
    e = Example("2 2 1>1:", "1/2*2", {"numbers": [1, 2, 2], "target": 1})
    assert t.reward("1/2*2", e) == 1.0  # 1/2 is exact, not truncated
    e0 = Example("3 5 5>1:", "", {"numbers": [3, 5, 5], "target": 1})
    assert t.reward("3/(5-5)", e0) == 0.1  # right numbers, no value


def test_countdown_at_most_once_mode():
    t = tasks.build("countdown", n_train=1, n_test=1, use_all=False)
    assert t.reward("3*5", CD) == 0.1 and t.reward("15+7", CD) == 0.0 and t.reward("3*3", CD) == 0.0
    assert t.reward("3*5+7", CD) == 1.0


@pytest.mark.parametrize(
    "text",
    ["__import__('os').system('ls')", "x", "a+1", "2**3", "10**100", "1234567", "1.5", "-3", "+3",
     "3 5", "(3)(5)", "1_000", "()", "3;4", "1+" * 60 + "1", "lambda: 1", "[1]"],
)
def test_safe_parser_rejects(text):
    with pytest.raises(ExpressionError):
        parse_expression(text)


def test_safe_evaluator_guards():
    with pytest.raises(ExpressionError, match="division by zero"):
        evaluate(parse_expression("1/(2-2)"))
    with pytest.raises(ExpressionError, match="beyond"):
        evaluate(parse_expression("999999*999999*999999"))
    assert literals(parse_expression("(3+5)*7")) == [3, 5, 7]


# ----------------------------------------------------------------------------------- custom


def _jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


REWARD_MODULE = """
def score(completion, prompt, answer, bonus=0.0, **row):
    return (1.0 if completion.strip() == answer else 0.0) + bonus

def half(completion, **row):
    return 0.5

def bad(completion, **row):
    return "yes"
"""


@pytest.fixture
def custom_files(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_function may prepend cwd
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cwd_reward_mod.py").write_text(REWARD_MODULE)
    train = _jsonl(tmp_path / "train.jsonl", [
        {"prompt": "2+2=", "answer": "4", "bonus": 0.25, "tag": "a"},
        "",  # blank lines are skipped
        {"prompt": "3+3=", "answer": "6"},
    ])
    test = _jsonl(tmp_path / "test.jsonl", [{"prompt": "4+4=", "answer": "8"}])
    yield train, test
    for mod in ("cwd_reward_mod", "pp_reward_mod", "broken_mod"):
        sys.modules.pop(mod, None)  # each test writes its own copy


def test_custom_task_from_jsonl(custom_files):
    train, test = custom_files
    t = tasks.build("custom", train_file=train, test_file=test, reward="cwd_reward_mod:score")
    assert isinstance(t, Task)
    tr = t.split("train")
    assert tr == [Example("2+2=", "4", {"bonus": 0.25, "tag": "a"}), Example("3+3=", "6", {})]
    assert [e.prompt for e in t.split("test")] == ["4+4="]
    assert t.reward("4", tr[0]) == 1.25 and t.reward("5", tr[0]) == 0.25  # extra columns reach fn
    assert t.reward(" 6 ", tr[1]) == 1.0 and t.reward("x", tr[1]) == 0.0
    assert t.is_correct("4", tr[0]) and not t.is_correct("5", tr[0])


def test_custom_threshold_and_pythonpath(custom_files, tmp_path, monkeypatch):
    train, test = custom_files
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "pp_reward_mod.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(lib))
    t = tasks.build("custom", train_file=train, test_file=test, reward="pp_reward_mod:half", correct_threshold=0.5)
    e = t.split("test")[0]
    assert t.reward("anything", e) == 0.5 and t.is_correct("anything", e)


def test_custom_non_number_reward_names_function(custom_files):
    train, test = custom_files
    t = tasks.build("custom", train_file=train, test_file=test, reward="cwd_reward_mod:bad")
    with pytest.raises(TypeError, match="cwd_reward_mod:bad.*str"):
        t.reward("4", t.split("train")[0])


def test_custom_overlap_warns(custom_files):
    train, _ = custom_files
    with pytest.warns(UserWarning, match="2 prompt"):
        tasks.build("custom", train_file=train, test_file=train, reward="cwd_reward_mod:score")


@pytest.mark.parametrize(
    "rows, where, reason",
    [
        ([{"prompt": "a", "answer": "b"}, "{not json"], 2, "bad JSON"),
        ([{"prompt": "a", "answer": "b"}, "", {"answer": "b"}], 3, "missing 'prompt'"),
        ([{"prompt": "a"}], 1, "missing 'answer'"),
        ([{"prompt": 3, "answer": "b"}], 1, "'prompt' must be a string, got int"),
        ([{"prompt": "a", "answer": None}], 1, "'answer' must be a string, got NoneType"),
        ([{"prompt": "", "answer": "b"}], 1, "empty 'prompt'"),
        (["[1, 2]"], 1, "expected a JSON object, got list"),
        ([{"prompt": "a", "answer": "b", "completion": "c"}], 1, "column 'completion' is reserved"),
    ],
)
def test_custom_data_errors_carry_file_and_line(custom_files, tmp_path, rows, where, reason):
    _, test = custom_files
    bad = _jsonl(tmp_path / "a.jsonl", rows)
    with pytest.raises(TaskDataError) as err:
        tasks.build("custom", train_file=bad, test_file=test, reward="cwd_reward_mod:score")
    assert str(err.value).startswith(f"{bad}:{where}: {reason}")
    assert (err.value.file, err.value.line) == (bad, where) and isinstance(err.value, ValueError)


def test_custom_missing_and_empty_file(custom_files, tmp_path):
    train, _ = custom_files
    with pytest.raises(TaskDataError, match="nope.jsonl: file not found"):
        tasks.build("custom", train_file=train, test_file="nope.jsonl", reward="cwd_reward_mod:score")
    empty = _jsonl(tmp_path / "empty.jsonl", [""])
    with pytest.raises(TaskDataError, match="empty.jsonl: no examples"):
        tasks.build("custom", train_file=empty, test_file=train, reward="cwd_reward_mod:score")


@pytest.mark.parametrize(
    "spec, match",
    [
        ("cwd_reward_mod", "'module:function'"),
        ("cwd_reward_mod:", "'module:function'"),
        (":score", "'module:function'"),
        ("no_such_module_xyz:score", "cannot import module 'no_such_module_xyz'.*ModuleNotFoundError"),
        ("broken_mod:score", "cannot import module 'broken_mod'.*ZeroDivisionError"),
        ("cwd_reward_mod:missing", "has no attribute 'missing'"),
        ("cwd_reward_mod:CONST", "is not callable"),
    ],
)
def test_custom_bad_reward_spec(custom_files, tmp_path, spec, match):
    train, test = custom_files
    (tmp_path / "broken_mod.py").write_text("x = 1 / 0\n")
    with open(tmp_path / "cwd_reward_mod.py", "a") as f:
        f.write("CONST = 3\n")
    with pytest.raises(ValueError, match=match):
        tasks.build("custom", train_file=train, test_file=test, reward=spec)
