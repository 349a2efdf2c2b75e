"""Bad training data is named by file:line and reason (exit 2, nothing written), or skipped and
counted under data.on_error=skip; the checks include the tokenizer and the model's context."""

import json
import os
import subprocess
import sys

import pytest

from gspo.cli import main
from gspo.config import load_config
from gspo.rollout.data import example_problems, tokenizer_and_context
from gspo.training.cold_start import cache_key
from gspo.tasks import Example

GOOD = '{"prompt": "1+1=", "answer": "2"}'
TEST = '{"prompt": "2+2=", "answer": "4"}\n{"prompt": "3+3=", "answer": "6"}\n'


@pytest.fixture
def files(tmp_path, reward_module):
    """files(train_rows, test_text=TEST) -> overrides of a custom task over those files."""
    def write(train: list[str], test: str = TEST) -> list[str]:
        (tmp_path / "train.jsonl").write_text("".join(r + "\n" for r in train))
        (tmp_path / "test.jsonl").write_text(test)
        return ["task.name=custom", f"task.train_file={tmp_path / 'train.jsonl'}",
                f"task.test_file={tmp_path / 'test.jsonl'}", f"task.reward={reward_module}",
                f"run.dir={tmp_path / 'run'}", f"sft.cache_dir={tmp_path / 'cache'}"]
    return write


def _fails(capsys, tmp_path, argv) -> str:
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gspo: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()
    return err


@pytest.mark.parametrize("row, reason", [
    ('{"prompt": "1+1=", "answer": "2"', "bad JSON: Expecting ',' delimiter"),
    ('["1+1=", "2"]', "expected a JSON object, got list"),
    ('{"answer": "2"}', "missing 'prompt'"),
    ('{"prompt": 11, "answer": "2"}', "'prompt' must be a string, got int"),
    ('{"prompt": "1+1=", "answer": 2}', "'answer' must be a string, got int"),
    ('{"prompt": "", "answer": "2"}', "empty 'prompt'"),
    ('{"prompt": "1+1=\\u20ac", "answer": "2"}', "prompt has characters the tokenizer cannot encode: '€'"),
    ('{"prompt": "1+1=", "answer": "zwei\\u00df"}', "answer has characters the tokenizer cannot encode: 'ß'"),
])
def test_bad_row_names_file_line_and_reason(capsys, tmp_path, files, row, reason):
    err = _fails(capsys, tmp_path, files([GOOD, row, GOOD]))
    assert f"train.jsonl:2: {reason}" in err


def test_prompt_longer_than_the_context(capsys, tmp_path, files):
    long = json.dumps({"prompt": "1+" * 20 + "1=", "answer": "21"})
    err = _fails(capsys, tmp_path, [*files([GOOD, GOOD, long]), "model.overrides={max_position_embeddings: 32}",
                                    "rollout.max_new_tokens=4"])
    assert "train.jsonl:3: prompt of 43 tokens + 4 response tokens" in err
    assert "exceed the model's context of 32" in err


def test_bad_row_in_the_test_file(capsys, tmp_path, files):
    err = _fails(capsys, tmp_path, files([GOOD], TEST + '{"prompt": null, "answer": "1"}\n'))
    assert "test.jsonl:3: 'prompt' must be a string, got NoneType" in err


def test_built_in_task_too_long_for_the_context(capsys, tmp_path):
    err = _fails(capsys, tmp_path, [f"run.dir={tmp_path / 'run'}", "task.n_train=20", "task.n_test=5",
                                    "rollout.max_new_tokens=600"])
    assert "task multistep train example 1" in err and "context of 512" in err   # the main job's


def test_skip_policy_drops_counts_and_reports(capsys, tmp_path, files):
    rows = [GOOD, "{oops", '{"prompt": "", "answer": "1"}', '{"prompt": "4+4=\\u00e9", "answer": "8"}',
            '{"prompt": "5+5=", "answer": "10"}']
    argv = [*files(rows), "data.on_error=skip", "sft.enabled=false", "train.steps=1",
            "rollout.prompts_per_step=2", "rollout.group_size=2", "train.minibatches=1",
            "rollout.max_new_tokens=2", "eval.k=1", "run.progress=false", "run.tensorboard=false"]
    assert main(["train", *argv]) == 0
    err = capsys.readouterr().err
    assert "data: skipped 3 bad example(s) (data.on_error=skip; 2 unparsable rows, 1 train / 0 test" in err
    data = json.loads((tmp_path / "run" / "summary.json").read_text())["data"]
    assert data["splits"] == {"train": {"kept": 2, "skipped": 1}, "test": {"kept": 2, "skipped": 0},
                              "validation": {"kept": 0, "skipped": 0}}  # no task.validation_file
    assert data["skipped_total"] == 3 and data["skipped_rows"] == 2
    assert [s.split(": ")[0].rsplit("/", 1)[-1] for s in data["skipped"]] == \
        ["train.jsonl:2", "train.jsonl:3", "train.jsonl:4"]


def test_skip_policy_with_nothing_left(capsys, tmp_path, files):
    err = _fails(capsys, tmp_path, [*files(["{bad", '{"prompt": ""}']), "data.on_error=skip"])
    assert "train.jsonl: no usable examples (2 skipped)" in err
    err = _fails(capsys, tmp_path, [*files(['{"prompt": "\\u00e9", "answer": "1"}']), "data.on_error=skip"])
    assert "task custom: every train example was skipped (1)" in err


def test_bad_data_in_a_subprocess_exits_2_without_traceback(tmp_path, files, reward_dir):
    argv = files([GOOD, "not json"])
    env = {**os.environ, "OMP_NUM_THREADS": "1",   # this checkout's gspo first, as in-process
           "PYTHONPATH": os.pathsep.join([str(reward_dir), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "gspo", "train", *argv], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        f"gspo: error: {tmp_path / 'train.jsonl'}:2: bad JSON: Expecting value"]
    assert not (tmp_path / "run").exists()


def test_example_problems_unit():
    cfg = load_config(None, ["model.overrides={max_position_embeddings: 12}"])
    tokenizer, context = tokenizer_and_context(cfg)
    assert context == 12
    examples = [Example("1+1=", "2"), Example("1+1=\t", "2"), Example("<unk>=", "1"),
                Example("123456=", "7")]
    problems = example_problems(examples, tokenizer, context, max_new_tokens=4)
    # a tab is not in the character vocabulary; '<unk>' typed literally is text, not a failure;
    # "123456=" is 1 BOS + 7 characters, + 4 response tokens = 12 positions: it fits exactly
    assert problems == {1: "prompt has characters the tokenizer cannot encode: '\\t'"}
    assert 3 in example_problems(examples, tokenizer, context, max_new_tokens=5)


def test_sft_cache_key_follows_the_data(tmp_path):
    cfg = load_config(None, ["task.name=custom", f"task.train_file={tmp_path / 'a.jsonl'}",
                             "task.test_file=t.jsonl", "task.reward=m:f"])
    (tmp_path / "a.jsonl").write_text(GOOD + "\n")
    first = cache_key(cfg.model, cfg.task, cfg.sft, cfg.seed)
    (tmp_path / "a.jsonl").write_text(GOOD + "\n" + GOOD + "\n")
    assert cache_key(cfg.model, cfg.task, cfg.sft, cfg.seed) != first   # same path, new content


def test_eval_split_validation_needs_a_validation_file(capsys, tmp_path, files):
    argv = [*files([GOOD]), "eval.split=validation"]
    err = _fails(capsys, tmp_path, argv)
    assert "eval.split=validation: the task has no validation examples; set task.validation_file" in err


def test_eval_split_validation_scores_the_validation_rows(tmp_path, files):
    from gspo.rollout.data import build_task, eval_examples
    (tmp_path / "val.jsonl").write_text('{"prompt": "7+1=", "answer": "8"}\n')
    argv = [*files([GOOD]), f"task.validation_file={tmp_path / 'val.jsonl'}"]
    val = load_config(None, [*argv, "eval.split=validation"])
    task = build_task(val)
    assert [e.prompt for e in eval_examples(task, val)] == ["7+1="]
    test = load_config(None, argv)  # the default split is still test
    assert [e.prompt for e in eval_examples(task, test)] == ["2+2=", "3+3="]


def test_builtin_task_draws_validation_only_when_asked():
    from gspo.rollout.data import DEFAULT_N_VAL, build_task, eval_examples
    small = ["task.n_train=300", "task.n_test=40", "sft.enabled=false"]
    test_cfg = load_config(None, small)
    assert build_task(test_cfg).split("validation") == []          # not asked: none drawn
    val_cfg = load_config(None, [*small, "eval.split=validation"])
    task = build_task(val_cfg)
    val = eval_examples(task, val_cfg)
    assert len(val) == DEFAULT_N_VAL
    assert not {e.prompt for e in val} & {e.prompt for e in task.split("test") + task.split("train")}
    assert task.split("test") == build_task(test_cfg).split("test")  # test and train do not move
    assert task.split("train") == build_task(test_cfg).split("train")


def test_sft_cache_key_follows_the_library_versions(monkeypatch):
    """Another transformers (or torch) trains another cold start: it gets its own cache entry."""
    import transformers
    cfg = load_config(None, [])
    first = cache_key(cfg.model, cfg.task, cfg.sft, cfg.seed)
    assert cache_key(cfg.model, cfg.task, cfg.sft, cfg.seed) == first
    monkeypatch.setattr(transformers, "__version__", "0.0.0")
    assert cache_key(cfg.model, cfg.task, cfg.sft, cfg.seed) != first
