"""Hub ids (``model.path=org/name``) read from a Hugging Face cache the tests build themselves
(huggingface_hub's layout: ``models--org--name/snapshots/<commit>/`` and ``refs/main``), with
``HF_HUB_OFFLINE=1``: nothing is downloaded."""

from __future__ import annotations

import json
import pytest
from conftest import SMALL, cache_entry, parity_rewards

from gspo.cli import main
from gspo.errors import UserError
from gspo import hub

COMMIT = "0123456789abcdef0123456789abcdef01234567"   # cache_entry's default


@pytest.fixture
def hf_cache(tmp_path, saved_tiny, monkeypatch):
    """An offline Hugging Face cache holding the tiny model as ``gspo-test/tiny``."""
    cache = tmp_path / "hf"
    cache_entry(cache, "gspo-test/tiny", saved_tiny)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_hub_id_is_org_slash_name_not_a_local_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub.is_hub_id("Qwen/Qwen3-0.6B") and hub.is_hub_id("gspo-test/tiny")
    assert not hub.is_hub_id("/abs/path") and not hub.is_hub_id("one") and not hub.is_hub_id("a/b/c")
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not hub.is_hub_id("org/name")  # an existing local folder wins
    assert hub.local_path("org/name") == "org/name"


def test_cached_id_resolves_to_its_snapshot_and_revision(hf_cache):
    path = hub.local_path("gspo-test/tiny")
    assert path.endswith(f"models--gspo-test--tiny/snapshots/{COMMIT}")
    assert hub.cached_revision("gspo-test/tiny") == COMMIT
    assert hub.cached_revision(path) is None  # a local folder has no hub revision


def test_uncached_id_offline_names_it(hf_cache):
    with pytest.raises(UserError, match="model.path: 'gspo-test/absent' is neither a local folder "
                                        "nor in the Hugging Face cache .* HF_HUB_OFFLINE"):
        hub.local_path("gspo-test/absent")


def test_train_from_a_cached_hub_id_offline_records_the_revision(hf_cache, tmp_path, reward_module, capsys):
    run = tmp_path / "run"
    argv = ["train", *SMALL, "model.path=gspo-test/tiny", "sft.enabled=false", "train.steps=1",
            "eval.n=4", parity_rewards(reward_module), f"run.dir={run}",
            f"sft.cache_dir={tmp_path / 'sft'}"]
    assert main(argv) == 0, capsys.readouterr().err
    prov = json.loads((run / "provenance.json").read_text())
    assert prov["hub"] == {"model.path": {"id": "gspo-test/tiny", "revision": COMMIT}}
    assert prov["config"]["model"]["path"] == "gspo-test/tiny"


@pytest.mark.parametrize("command, argv", [
    ("train", ["model.path=gspo-test/absent"]),
    ("eval", ["--checkpoint", "gspo-test/absent"]),
])
def test_uncached_id_offline_is_one_line_exit_2(hf_cache, tmp_path, capsys, command, argv):
    code = main([command, f"run.dir={tmp_path / 'run'}", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "'gspo-test/absent'" in err and "HF_HUB_OFFLINE" in err
    assert not (tmp_path / "run").exists()


def test_a_preset_on_a_tokenizer_named_by_hub_id(tmp_path, monkeypatch, reward_module, capsys):
    """model.tokenizer=org/name: a cache entry holding only a tokenizer (here the local BPE of the
    chat tests, ChatML template, saved) builds the preset sized to its vocabulary, trains chat
    offline, and provenance records the tokenizer's revision; a folder works as well; an uncached
    id and a folder without a tokenizer are one line, exit 2."""
    from gspo import tasks
    from gspo.rollout.tokenization import preset_tokenizer
    tok = preset_tokenizer("bpe", tasks.build("arithmetic", n_train=200, n_test=10).split("train"), 400)
    tok.save_pretrained(tmp_path / "tok")
    cache_entry(tmp_path / "hf", "gspo-test/tokenizer", tmp_path / "tok", commit="e" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    common = ["train", *SMALL, "task.chat=true", "sft.enabled=false", "train.steps=1", "eval.n=4",
              parity_rewards(reward_module), f"sft.cache_dir={tmp_path / 'sft'}"]
    assert main([*common, "model.tokenizer=gspo-test/tokenizer", f"run.dir={tmp_path / 'run'}"]) == 0, \
        capsys.readouterr().err
    prov = json.loads((tmp_path / "run" / "provenance.json").read_text())
    assert prov["hub"] == {"model.tokenizer": {"id": "gspo-test/tokenizer", "revision": "e" * 40}}
    built = json.loads((tmp_path / "run" / "checkpoints" / "step_000001" / "config.json").read_text())
    assert built["vocab_size"] == len(tok) and built["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    assert main([*common, f"model.tokenizer={tmp_path / 'tok'}", f"run.dir={tmp_path / 'run2'}"]) == 0
    capsys.readouterr()
    for name, says in [("gspo-test/absent", "HF_HUB_OFFLINE"), (str(tmp_path / "hf"), "not a tokenizer folder")]:
        code = main([*common, f"model.tokenizer={name}", f"run.dir={tmp_path / 'run3'}"])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err and says in err, err
        assert not (tmp_path / "run3").exists()


# ------------------------------------------------------------------------------ datasets
def dataset_entry(cache, repo_id: str, rows: dict[str, list[dict]], commit: str = COMMIT):
    """A dataset repo of one JSONL file per split, in ``cache`` as huggingface_hub stores it."""
    repo = cache / f"datasets--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for split, items in rows.items():
        (snap / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_dataset_task_reads_hub_splits_from_the_cache(tmp_path, monkeypatch):
    from gspo import tasks
    cache = tmp_path / "hf"
    dataset_entry(cache, "gspo-test/qa", {
        "train": [{"q": "1+1=", "a": "2"}, {"q": "2+2=", "a": "4"}],
        "test": [{"q": "3+3=", "a": "6"}], "dev": [{"q": "5+5=", "a": "10"}]})
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    task = tasks.build("dataset", dataset="gspo-test/qa", columns={"prompt": "q", "answer": "a"},
                       splits={"validation": "validation"})  # datasets names dev.jsonl so
    assert [e.prompt for e in task.split("train")] == ["1+1=", "2+2="]
    assert [e.answer for e in task.split("test")] == ["6"]
    assert [e.answer for e in task.split("validation")] == ["10"]
    assert task.locations["train"] == [("gspo-test/qa[train]", 1), ("gspo-test/qa[train]", 2)]
    assert hub.cached_revision("gspo-test/qa", "dataset") == COMMIT
    with pytest.raises(UserError, match="task.dataset: 'gspo-test/absent' is neither"):
        tasks.build("dataset", dataset="gspo-test/absent")


def test_dataset_task_needs_files_or_a_dataset():
    from gspo import tasks
    with pytest.raises(ValueError, match="needs task.train_file and task.test_file, or task.dataset"):
        tasks.build("dataset")


def test_eval_of_a_cached_hub_checkpoint_records_its_revision(hf_cache, tmp_path, capsys):
    out = tmp_path / "eval"
    code = main(["eval", "--checkpoint", "gspo-test/tiny", "--out", str(out), "eval.n=2", "eval.k=1",
                 "task.n_train=10", "task.n_test=4"])
    assert code == 0, capsys.readouterr().err
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["hub"] == {"--checkpoint": {"id": "gspo-test/tiny", "revision": COMMIT}}
