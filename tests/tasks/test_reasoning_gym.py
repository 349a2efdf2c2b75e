"""The `reasoning_gym` task: splits disjoint by question, the dataset's own scorer as the reward,
lenient scorers and SFT without references refused, and a short `gspo train` on one dataset."""

import json
import sys

import pytest

pytest.importorskip("reasoning_gym")

from gspo import tasks  # noqa: E402
from gspo.cli import main  # noqa: E402
from gspo.errors import UserError  # noqa: E402
from gspo.tasks.reasoning_gym import extract_answer, shares  # noqa: E402


def build(**params):
    params.setdefault("n_train", 40)
    params.setdefault("n_test", 10)
    return tasks.build("reasoning_gym", **params)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_splits_disjoint_by_question(seed):
    t = build(seed=seed, dataset="basic_arithmetic", n_val=10)
    qs = {s: [e.prompt for e in t.split(s)] for s in ("train", "test", "validation")}
    assert [len(qs[s]) for s in ("train", "test", "validation")] == [40, 10, 10]
    every = qs["train"] + qs["test"] + qs["validation"]
    assert len(set(every)) == len(every)


def test_test_split_does_not_move_with_n_train():
    a = build(dataset="basic_arithmetic", n_train=5)
    b = build(dataset="basic_arithmetic", n_train=50)
    assert a.split("test") == b.split("test")


def test_weighted_mix_shares_each_split():
    t = build(datasets=[{"name": "basic_arithmetic", "weight": 3},
                        {"name": "leg_counting", "weight": 1, "config": {"min_animals": 1, "max_animals": 2}}])
    names = [e.data["dataset"] for e in t.split("train")]
    assert names.count("basic_arithmetic") == 30 and names.count("leg_counting") == 10
    assert shares(10, [3.0, 1.0]) == [8, 2] and sum(shares(7, [1.0, 1.0, 1.0])) == 7


def test_too_few_distinct_questions_is_one_line():
    # one animal, one of it: a few dozen distinct questions
    with pytest.raises(ValueError, match=r"leg_counting gave only \d+ distinct questions.*lower task.n_train") as err:
        build(dataset="leg_counting", n_train=200,
              config={"min_animals": 1, "max_animals": 1, "max_instances": 1})
    assert "\n" not in str(err.value)


def test_known_scorer_on_a_hand_case():
    t = build(dataset="basic_arithmetic")
    ex = t.split("test")[0]
    ref = ex.answer
    assert t.reward(ref, ex) == 1.0 and t.is_correct(f"think <answer>{ref}</answer>", ex)
    assert t.reward("nonsense", ex) == 0.0 and not t.is_correct("nonsense", ex)
    assert extract_answer("a <answer> 1 </answer> b <answer>2</answer>") == "2"
    assert extract_answer("  7\n") == "7"


def test_partial_credit_is_not_correct():
    t = build(dataset="prime_factorization")
    ex = t.split("test")[0]
    assert 0.0 < t.reward("0", ex) < 1.0 and not t.is_correct("0", ex)   # scorer's 0.01 for a number


def test_raising_scorer_counts_zero_once_per_sample():
    t = build(dataset="prime_factorization")
    ex = t.split("test")[0]
    assert t.take_counts() == {"reward/scorer_errors": 0.0}
    assert t.reward("x", ex) == 0.0                 # int('x') raises inside score_answer
    assert not t.is_correct("x", ex)                # the same sample: not counted twice
    assert t.reward("x", ex) == 0.0
    assert t.scorer_errors["prime_factorization"] == 2
    assert t.take_counts() == {"reward/scorer_errors": 2.0}
    assert t.take_counts() == {"reward/scorer_errors": 0.0}   # since the last call


def test_junk_equal_to_the_reference_is_not_junk():
    build(dataset="polynomial_equations", n_train=3, n_test=3)   # "0" scores 1.0 where the root is 0.0


def test_flawed_teacher_stops_one_character_short():
    """The flawed demonstrations are the reference less its last character, on about
    flawed_fraction of the training questions; prompts, test answers and scoring do not move."""
    cfg = {"min_terms": 2, "max_terms": 3, "max_digits": 1, "operators": ["+", "-"]}
    plain = build(dataset="basic_arithmetic", config=cfg, n_train=400)
    flawed = build(dataset="basic_arithmetic", config=cfg, n_train=400, flawed_fraction=0.5)
    assert flawed.split("test") == plain.split("test")
    pairs = list(zip(plain.split("train"), flawed.split("train")))
    assert all(p.prompt == f.prompt for p, f in pairs)
    short = [(p, f) for p, f in pairs if f.data.get("flawed")]
    assert all(f.answer == p.answer[:-1] for p, f in short)
    assert all(f.answer == p.answer for p, f in pairs if not f.data.get("flawed"))
    assert 0.4 < len(short) / len(pairs) < 0.6
    # by hand: "-9" is demonstrated as "-" and "18" as "1"; the scorer gives neither full marks
    p, f = next((p, f) for p, f in short if p.answer == "18")
    assert (f.answer, flawed.reward(f.answer, f), flawed.reward(p.answer, f)) == ("1", 0.0, 1.0)
    assert {f.answer for p, f in short if p.answer == "-9"} <= {"-"}
    with pytest.raises(ValueError, match="flawed_fraction"):
        build(dataset="basic_arithmetic", flawed_fraction=1.5)


@pytest.mark.parametrize("name", ["game_of_life_halting", "coin_flip"])
def test_junk_accepting_scorer_refused(name):
    with pytest.raises(ValueError, match="allow_lenient_scorer") as err:
        build(dataset=name, n_train=2, n_test=2)
    assert "\n" not in str(err.value)
    build(dataset=name, n_train=2, n_test=2, allow_lenient_scorer=True)   # the explicit override


def test_refusals_exit_2(tmp_path, capsys):
    common = [f"run.dir={tmp_path / 'run'}", "run.progress=false", "run.tensorboard=false"]
    assert main(["train", "task.name=reasoning_gym", "task.params={dataset: game_of_life_halting}",
                 *common]) == 2
    assert main(["train", "task.name=reasoning_gym", "task.params={dataset: graph_color}", *common]) == 2
    err = capsys.readouterr().err
    assert "allow_lenient_scorer" in err and "sft.enabled=false" in err


def test_junk_probe_refuses_a_scorer_found_lenient(monkeypatch):
    import reasoning_gym
    ds_cls = type(reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=0))
    monkeypatch.setattr(ds_cls, "score_answer", lambda self, answer, entry: 1.0)
    with pytest.raises(ValueError, match="gives 1.0 to the junk answer ''"):
        build(dataset="basic_arithmetic")


def test_bad_params_are_one_line():
    with pytest.raises(ValueError, match="exactly one of"):
        build()
    with pytest.raises(ValueError, match="no_such_dataset"):
        build(dataset="no_such_dataset")
    with pytest.raises(ValueError, match="valid: DeepSeekZero"):
        build(dataset="basic_arithmetic", system_prompt="nope")


def test_system_prompt_before_the_question():
    t = build(dataset="basic_arithmetic", system_prompt="simple")
    ex = t.split("test")[0]
    assert ex.prompt.startswith("You are a helpful assistant") and ex.prompt.endswith(ex.data["messages"][1]["content"])
    assert [m["role"] for m in ex.data["messages"]] == ["system", "user"]       # task.chat: a system turn


def test_sft_refused_without_reference_answers(make_cfg):
    from gspo.rollout.data import build_task
    cfg = make_cfg("task.name=reasoning_gym", "task.params={dataset: graph_color}")   # answer None
    with pytest.raises(UserError, match="graph_color has no reference answers.*sft.enabled=false") as err:
        build_task(cfg)
    assert "\n" not in str(err.value)


def test_not_installed_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)     # import reasoning_gym -> ImportError
    with pytest.raises(UserError, match=r"pip install 'gspo\[reasoning-gym\]'") as err:
        build(dataset="basic_arithmetic")
    assert "\n" not in str(err.value)


def test_train_two_rl_steps(tmp_path):
    code = main([
        "train", "task.name=reasoning_gym", "task.params={dataset: basic_arithmetic, "
        "config: {min_terms: 2, max_terms: 2, max_digits: 1}}",
        "task.n_train=50", "task.n_test=8", "sft.steps=3", "sft.batch_size=8",
        f"sft.cache_dir={tmp_path / 'cache'}", "rollout.prompts_per_step=2", "rollout.group_size=4",
        "rollout.max_new_tokens=4", "train.steps=2", "train.minibatches=1", "eval.n=4", "eval.k=1",
        "run.eval_every=0", "run.save_every=0", f"run.dir={tmp_path / 'run'}",
        "run.tensorboard=false", "run.progress=false"])
    assert code == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert 0.0 <= summary["eval_after"]["accuracy"] <= 1.0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2]


def test_scorer_errors_are_a_metric_of_the_step(tmp_path, monkeypatch):
    from reasoning_gym.arithmetic.basic_arithmetic import BasicArithmeticDataset

    def broken(self, answer, entry):
        raise ValueError("a scorer bug")

    monkeypatch.setattr(BasicArithmeticDataset, "score_answer", broken)   # every sample raises
    code = main([
        "train", "task.name=reasoning_gym", "task.params={dataset: basic_arithmetic, "
        "allow_lenient_scorer: true}", "task.n_train=20", "task.n_test=4", "sft.enabled=false",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=4",
        "train.steps=2", "train.minibatches=1", "eval.n=4", "eval.k=1", "run.eval_every=0",
        "run.save_every=0", f"run.dir={tmp_path / 'run'}", "run.tensorboard=false",
        "run.progress=false"])
    assert code == 0                                      # scored 0, never a crashed run
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward/scorer_errors"] for r in rows if "reward/mean" in r] == [8, 8]  # 2 x 4 a step
