"""`task.name=dataset`: local JSONL / JSON / parquet / CSV / arrow files through Hugging Face
datasets, columns renamed by task.columns, conversations, the custom task's row checks and
data.on_error policy, bad input as one line and exit 2 before anything is built."""

import json
import re

import datasets
import pytest

from gspo import tasks
from gspo.cli import main
from gspo.tasks import TaskDataError

# several tests read one file as both splits, on purpose
pytestmark = pytest.mark.filterwarnings("ignore:dataset task.*appear in both:UserWarning")
datasets.disable_progress_bars()  # imported before gspo.cli could turn them off (as it does for a run)

ROWS = [{"question": "Tom has 3 apples and buys 4 more. How many apples?", "solution": "3 + 4 = 7\n#### 7",
         "level": 1},
        {"question": "A rope of 6 m is cut in 4. How long is a piece?", "solution": "#### 1.5", "level": 2}]
TEST_ROWS = [{"question": "Ann has 2 cats and 5 dogs. How many pets?", "solution": "#### 7", "level": 1}]
COLUMNS = {"prompt": "question", "answer": "solution"}


def write(path, rows):
    """Write rows in the format the suffix names (arrow: a datasets stream file)."""
    ds = datasets.Dataset.from_list(rows)
    suffix = path.suffix
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".parquet":
        ds.to_parquet(str(path))
    elif suffix == ".csv":
        ds.to_csv(str(path), index=False)
    elif suffix == ".arrow":
        ds.save_to_disk(str(path.with_suffix(".dir")))
        next(path.with_suffix(".dir").glob("*.arrow")).rename(path)
    return str(path)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv", ".arrow"])
def test_every_format_reads_the_same_examples(tmp_path, suffix):
    task = tasks.build("dataset", train_file=write(tmp_path / f"train{suffix}", ROWS),
                       test_file=write(tmp_path / f"test{suffix}", TEST_ROWS), columns=COLUMNS)
    train = task.split("train")
    assert [(e.prompt, e.answer, e.data) for e in train] == \
        [(r["question"], r["solution"], {"level": r["level"]}) for r in ROWS]
    assert task.locations["train"] == [(str(tmp_path / f"train{suffix}"), 1), (str(tmp_path / f"train{suffix}"), 2)]
    assert task.is_correct("so 7 apples.\n#### 7", train[0]) and task.reward(r"\boxed{3/2}", train[1]) == 1.0
    assert not task.is_correct("#### 8", train[0])


def test_csv_numbers_become_text_and_unset_fields_use_their_own_names(tmp_path):
    rows = [{"prompt": "2+2=", "answer": 4}, {"prompt": "half of 1", "answer": 0.5}]
    task = tasks.build("dataset", train_file=write(tmp_path / "t.csv", rows), test_file=write(tmp_path / "s.csv", rows))
    assert [e.answer for e in task.split("test")] == ["4", "0.5"]


def test_conversations_final_assistant_turn_is_the_answer(tmp_path):
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"},
                          {"role": "assistant", "content": "#### 2"}]},
            {"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}]
    task = tasks.build("dataset", train_file=write(tmp_path / "t.jsonl", rows),
                       test_file=write(tmp_path / "s.jsonl", rows), chat=True)
    first, second = task.split("train")
    assert (first.prompt, first.answer) == ("1+1?", "#### 2")
    assert first.data["messages"] == rows[0]["messages"][:2]
    assert (second.answer, second.data["messages"]) == ("4", rows[1]["messages"])
    with pytest.raises(TaskDataError, match="holds conversations: set task.chat=true"):
        tasks.build("dataset", train_file=str(tmp_path / "t.jsonl"), test_file=str(tmp_path / "s.jsonl"))


@pytest.mark.parametrize("row, reason", [
    ({"question": None, "solution": "#### 1"}, "t.parquet:2: missing 'question' (null)"),
    ({"question": "", "solution": "#### 1"}, "t.parquet:2: empty 'question'"),
    ({"question": "q", "solution": None}, "t.parquet:2: missing 'solution' (null)"),
])
def test_bad_rows_name_file_and_row(tmp_path, row, reason):
    path = write(tmp_path / "t.parquet", [ROWS[0], row])
    with pytest.raises(TaskDataError, match=re.escape(reason)):
        tasks.build("dataset", train_file=path, test_file=path, columns=COLUMNS)
    task = tasks.build("dataset", train_file=path, test_file=path, columns=COLUMNS, on_error="skip")
    assert len(task.split("train")) == 1 and len(task.skipped) == 2  # the row in both files


def test_unreadable_and_unknown_files(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "answer": "1"}\n{oops\n')
    with pytest.raises(TaskDataError, match=r"bad.jsonl: cannot read as json"):
        tasks.build("dataset", train_file=str(tmp_path / "bad.jsonl"), test_file=str(tmp_path / "bad.jsonl"))
    with pytest.raises(TaskDataError, match=r"unknown file type '.txt'"):
        tasks.build("dataset", train_file=str(tmp_path / "a.txt"), test_file=str(tmp_path / "a.txt"))


# --------------------------------------------------------------------------- the command line
@pytest.fixture
def argv(tmp_path):
    def make(train_rows, *extra, suffix=".parquet"):
        train = write(tmp_path / f"train{suffix}", train_rows)
        test = write(tmp_path / f"test{suffix}", TEST_ROWS)
        return ["train", "task.name=dataset", f"task.train_file={train}", f"task.test_file={test}",
                f"run.dir={tmp_path / 'run'}", f"sft.cache_dir={tmp_path / 'cache'}",
                "task.columns={prompt: question, answer: solution}", *extra]
    return make


def _one_line_exit_2(capsys, tmp_path, argv) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("gspo: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()  # nothing built
    return err


def test_missing_column_is_one_line_exit_2(capsys, tmp_path, argv):
    err = _one_line_exit_2(capsys, tmp_path, argv(ROWS, "task.columns={prompt: problem, answer: solution}"))
    assert "train.parquet: no column 'problem' (task.columns.prompt); columns: question, solution, level" in err


def test_unknown_columns_field_is_a_config_error(capsys, tmp_path, argv):
    err = _one_line_exit_2(capsys, tmp_path, argv(ROWS, "task.columns={prompts: question}"))
    assert "unknown task.columns field 'prompts'; did you mean 'prompt'?" in err


def test_chat_row_without_a_user_message_is_one_line_exit_2(capsys, tmp_path, argv):
    rows = [{"messages": [{"role": "user", "content": "1+1?"}], "solution": "2"},
            {"messages": [{"role": "system", "content": "hi"}], "solution": "2"}]
    conversation = ["task.columns={messages: messages, answer: solution}", "task.chat=true", "model.tokenizer=bpe"]
    err = _one_line_exit_2(capsys, tmp_path, argv(rows, *conversation, suffix=".jsonl"))
    assert "train.jsonl:2: the conversation has no user message" in err


def test_files_are_required():
    from gspo.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="task.test_file is required when task.name=dataset"):
        load_config(None, ["task.name=dataset", "task.train_file=a.parquet"])


def test_parquet_chat_bpe_math_run_end_to_end(tmp_path, argv, capsys):
    """The whole pipeline on a parquet file with renamed columns: BPE tokenizer trained on it,
    chat prompts, the math reward, SFT, two RL steps, a checkpoint AutoTokenizer loads."""
    from transformers import AutoTokenizer
    rows = [{"question": f"Tom has {a} apples and buys {b} more. How many apples?",
             "solution": f"{a} + {b} = {a + b}\n#### {a + b}", "level": 1} for a in range(1, 5) for b in range(1, 5)]
    extra = ["model.tokenizer=bpe", "task.chat=true", "task.system_prompt=Solve it.",
             "rewards.sources=[{type: math}, {type: think_format, weight: 0.1}]", "sft.steps=3", "sft.batch_size=8",
             "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
             "train.steps=2", "train.minibatches=1", "eval.k=1", "run.eval_every=0",
             "run.progress=false", "run.tensorboard=false"]
    assert main(argv(rows, *extra)) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["data"]["splits"]["train"] == {"kept": 16, "skipped": 0}
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"reward/math", "reward/think_format"} <= set(metrics[-1])
    checkpoint = sorted((tmp_path / "run" / "checkpoints").iterdir())[-1]
    tok = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    assert tok.convert_ids_to_tokens(tok(" apples")["input_ids"]) == ["Ġapples"]  # learned from the file
