"""Bad input gets one clear line and exit 2, before any model is built and before anything is written:
config keys and values, registry names, missing files, the model architecture, the output folder."""

import random
import shutil
from collections import namedtuple

import pytest

from gspo.tools import preflight
from gspo.cli import main


pytestmark = pytest.mark.usefixtures("no_model_built")  # every check here runs before a model


def _fails(capsys, tmp_path, *argv: str, command: str = "train") -> str:
    """Exit 2, one line on stderr, no traceback, nothing on stdout, no run folder."""
    run = tmp_path / "run"
    code = main([command, f"run.dir={run}", f"sft.cache_dir={tmp_path / 'cache'}", *argv])
    out = capsys.readouterr()
    assert code == 2, out.err
    assert out.err.startswith("gspo: error: ") and out.err.count("\n") == 1, out.err
    assert "Traceback" not in out.err and out.out == ""
    assert not run.exists() and not (tmp_path / "cache").exists()
    return out.err


# ------------------------------------------------------------------------------- config

@pytest.mark.parametrize("override, expected", [
    ("rollout.group_sise=4", "unknown key 'rollout.group_sise'; did you mean 'group_size'?"),
    ("train.steps=many", "train.steps: Input should be a valid integer"),
    ("objective.eps_low=0", "objective.eps_low: Input should be greater than 0"),
    ("objective.eps_high=-0.1", "objective.eps_high: Input should be greater than 0"),
    ("rollout.group_size=1", "rollout.group_size: Input should be greater than or equal to 2"),
    ("train.minibatches=3", "train.minibatches=3 must divide the batch"),
    ("train.minibatches=64", "train.minibatch_by=groups deals whole groups: train.minibatches=64 needs at least as many rollout.prompts_per_step, not 32"),
    ("train.minibatch_by=prompts", "train.minibatch_by: Input should be 'groups' or 'rows'"),
    ("rollout.temperature=0", "rollout.temperature: Input should be greater than 0"),
    ("eval.temperature=-1", "eval.temperature: Input should be greater than 0"),
    ("objective.name=gspp", "objective.name: unknown objective 'gspp'; did you mean 'gspo'?"),
    ("objective.params={tau: 1}", "objective.params: objective 'gspo' has no hyper-parameter 'tau'"),
    ("task.name=countdwn", "task.name: unknown task 'countdwn'; did you mean 'countdown'?"),
    ("model.preset=tiny-dens", "model.preset: unknown model preset 'tiny-dens'; did you mean 'tiny-dense'?"),
    ("rewards.sources=[{type: fuction, fn: 'm:f'}]", "rewards.sources.0.type: unknown reward type 'fuction'; did you mean 'function'?"),
    ("rewards.sources=[{type: function}]", "rewards.sources.0: a reward of type 'function' needs 'fn'"),
    ("rewards.on_error=ignore", "rewards.on_error: Input should be 'fail', 'zero' or 'drop'"),
    ("rewards.timeout_s=0", "rewards.timeout_s: Input should be greater than 0"),
    ("data.on_error=drop", "data.on_error: Input should be 'fail' or 'skip'"),
    ("task.name=custom", "task.train_file is required when task.name=custom"),
])
def test_bad_config_values(capsys, tmp_path, override, expected):
    assert expected in _fails(capsys, tmp_path, override)


def test_missing_config_file(capsys, tmp_path):
    assert "config file missing.yaml not found" in _fails(capsys, tmp_path, "missing.yaml")


# ------------------------------------------------------------------------------- files

@pytest.fixture
def custom(tmp_path):
    (tmp_path / "ok.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    return ["task.name=custom", "task.reward=gspo_test_rewards:first_char_parity"]


@pytest.mark.parametrize("argv, expected", [
    (["task.train_file=nope.jsonl", "task.test_file={ok}"], "task.train_file: no such file 'nope.jsonl'"),
    (["task.train_file={ok}", "task.test_file=nope.jsonl"], "task.test_file: no such file 'nope.jsonl'"),
])
def test_missing_data_files(capsys, tmp_path, custom, argv, expected):
    argv = [a.format(ok=tmp_path / "ok.jsonl") for a in argv]
    assert expected in _fails(capsys, tmp_path, *custom, *argv)


def test_missing_model_and_reward_model_paths(capsys, tmp_path):
    err = _fails(capsys, tmp_path, f"model.path={tmp_path / 'nowhere'}")
    assert "model.path:" in err and "no config.json" in err
    err = _fails(capsys, tmp_path, f"rewards.sources=[{{type: model, path: '{tmp_path / 'rm'}'}}]")
    assert "rewards.sources[0].path:" in err and "no config.json" in err


def test_pickled_weights_are_refused(capsys, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "pytorch_model.bin").write_bytes(b"pickle")
    err = _fails(capsys, tmp_path, f"model.path={ckpt}")
    assert "model.path:" in err and "no *.safetensors weights" in err


@pytest.fixture
def corrupt(saved_tiny, tmp_path):
    """A checkpoint folder whose config.json and tokenizer are fine, model.safetensors random bytes."""
    path = tmp_path / "corrupt"
    shutil.copytree(saved_tiny, path)
    (path / "model.safetensors").write_bytes(random.Random(0).randbytes(4096))
    return path


@pytest.mark.parametrize("argv, command, key", [
    (["model.path={ckpt}"], "train", "model.path"),
    (["rewards.sources=[{{type: model, path: '{ckpt}'}}]"], "train", "rewards.sources[0].path"),
    (["--checkpoint", "{ckpt}"], "eval", "--checkpoint"),
])
def test_corrupt_safetensors_is_one_line_naming_the_file(capsys, tmp_path, corrupt, argv, command, key):
    err = _fails(capsys, tmp_path, *[a.format(ckpt=corrupt) for a in argv], command=command)
    assert f"{key}: '{corrupt / 'model.safetensors'}' is not a readable safetensors file" in err
    assert "header too large" in err                             # what safetensors found wrong


def test_truncated_safetensors_is_refused(capsys, tmp_path, corrupt, saved_tiny):
    whole = (saved_tiny / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(whole[:len(whole) // 2])   # header intact
    err = _fails(capsys, tmp_path, f"model.path={corrupt}")
    assert "is not a readable safetensors file" in err and "not fully covered" in err


def test_custom_task_reward_that_raises_is_named_as_the_user_wrote_it(capsys, tmp_path, monkeypatch):
    (tmp_path / "zerodiv_reward.py").write_text("def score(completion, **row):\n    return 1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for split, rows in (("train", range(4)), ("test", range(4, 6))):
        (tmp_path / f"{split}.jsonl").write_text(
            "".join(f'{{"prompt": "q{i}:", "answer": "yes"}}\n' for i in rows))
    err = _fails(capsys, tmp_path, "task.name=custom", f"task.train_file={tmp_path / 'train.jsonl'}",
                 f"task.test_file={tmp_path / 'test.jsonl'}", "task.reward=zerodiv_reward:score")
    assert ("rewards: task.reward 'zerodiv_reward:score' fails on the demonstration of training "
            "example 1") in err
    assert "ZeroDivisionError: division by zero" in err and "verifier" not in err


@pytest.mark.parametrize("spec, expected", [
    ("no_such_module:fn", "task.reward: cannot import module 'no_such_module'"),
    ("gspo_test_rewards:nope", "task.reward: module 'gspo_test_rewards' has no attribute 'nope'"),
])
def test_bad_reward_function(capsys, tmp_path, reward_module, spec, expected):
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "test.jsonl").write_text('{"prompt": "2+2=", "answer": "4"}\n')
    err = _fails(capsys, tmp_path, "task.name=custom", f"task.train_file={tmp_path / 'train.jsonl'}",
                 f"task.test_file={tmp_path / 'test.jsonl'}", f"task.reward={spec}")
    assert expected in err


def test_bad_function_reward_source(capsys, tmp_path, reward_module):
    err = _fails(capsys, tmp_path, "rewards.sources=[{type: function, fn: 'gspo_test_rewards:nope'}]")
    assert "rewards.sources[0] (type 'function'):" in err and "no attribute 'nope'" in err


# ------------------------------------------------------------------------------- model

@pytest.mark.parametrize("override, expected", [
    ("model.overrides={hidden: 64}", "model.overrides: the tiny-dense config has no field 'hidden'"),
    ("moe.routing_replay=rollout", "moe.routing_replay: needs a Mixture-of-Experts model; model type 'qwen3'"),
    # no config file: the main job's task, multistep (configs/default.yaml)
    ("task.params={max_value: 0}", "task.params: multistep: max_value must be >= 1, got 0"),
    ("task.params={digits: 2}", "task.params: task 'multistep': unexpected argument(s) 'digits'"),
])
def test_model_and_task_options(capsys, tmp_path, override, expected):
    assert expected in _fails(capsys, tmp_path, override)


# ------------------------------------------------------------------------------- output folder

def test_run_dir_under_a_file(capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    err = _fails(capsys, tmp_path, f"run.dir={tmp_path / 'file' / 'run'}")
    assert "run.dir: cannot create" in err and "is a file, not a folder" in err


@pytest.mark.skipif(not shutil.os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_unwritable_run_dir(capsys, tmp_path):
    """/proc refuses new files even to root (chmod would not stop root)."""
    err = _fails(capsys, tmp_path, "run.dir=/proc/gspo-run")
    assert "run.dir: cannot write to '/proc'" in err


def test_full_disk(capsys, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: usage(10 << 20, 9 << 20, 1 << 20))
    err = _fails(capsys, tmp_path, f"run.dir={tmp_path / 'run'}")
    assert "run.dir: only 1 MB free" in err and "MB are needed" in err


@pytest.mark.parametrize("keep, on_disk, expected", [
    (2, 0, 3), (2, 1, 2), (2, 2, 1), (2, 3, 1), (1, 1, 1), (5, 2, 4)])
def test_checkpoints_still_to_write(keep, on_disk, expected):
    """At its fullest the folder holds max(keep, on disk) + the one being written (renamed into
    place before rotation deletes the oldest); those already on disk need no new room."""
    assert preflight.checkpoints_to_write(keep, on_disk) == expected


def test_resume_counts_the_checkpoints_already_on_disk(tmp_path, monkeypatch):
    """A resumed run with its 2 kept checkpoints on disk needs room for one more (+ the margin):
    with exactly that it proceeds, with a byte less it is refused; a fresh run needs all three."""
    from gspo.config import load_config
    run = tmp_path / "run"
    for step in (5, 10):
        (run / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
    cfg = load_config(None, [f"run.dir={run}", "sft.enabled=false"])   # keep_checkpoints: 2
    size = 10 * preflight.MB
    monkeypatch.setattr(preflight, "checkpoint_bytes", lambda cfg: size)
    usage = namedtuple("usage", "total used free")
    just_enough = size + preflight.MIN_FREE_MB * preflight.MB

    def free(n):
        monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: usage(1 << 40, 0, n))
    free(just_enough)
    preflight.check_run_dir(cfg, resume=True)
    free(just_enough - 1)
    with pytest.raises(preflight.UserError, match=r"\(2 kept \+ one being written, 2 of them "
                                                  r"already on disk"):
        preflight.check_run_dir(cfg, resume=True)
    cfg.run.overwrite = True                            # replacing it: nothing on disk counts
    free(3 * size + preflight.MIN_FREE_MB * preflight.MB - 1)
    with pytest.raises(preflight.UserError, match=r"about 94 MB are needed \(2 kept \+ one "
                                                  r"being written, see"):
        preflight.check_run_dir(cfg, resume=False)


def test_sft_cache_dir_unwritable(capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    code = main(["train", f"run.dir={tmp_path / 'run'}", f"sft.cache_dir={tmp_path / 'file' / 'c'}"])
    err = capsys.readouterr().err
    assert code == 2 and "sft.cache_dir: cannot create" in err and not (tmp_path / "run").exists()


def test_previous_run_is_not_overwritten(capsys, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    assert main(["train", f"run.dir={run}"]) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and f"--resume {run}" in err
    assert [p.name for p in run.iterdir()] == ["metrics.jsonl"]          # untouched


def test_resume_of_a_folder_that_is_not_a_run(capsys, tmp_path):
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "no config.yaml (not a gspo run folder)" in capsys.readouterr().err


def test_checkpoint_size_estimate_of_a_preset():
    from gspo.config import load_config
    from gspo.models.presets import build_model
    model, _ = build_model("tiny-dense", 0)
    n = sum(p.numel() for p in model.parameters())
    assert preflight.checkpoint_bytes(load_config()) == 3 * 4 * n          # weights + 2 AdamW moments


# ------------------------------------------------------------------------------- other commands

def test_eval_and_sft_check_their_input(capsys, tmp_path):
    assert main(["eval", "--checkpoint", str(tmp_path), "task.n_train=5"]) == 2
    assert "--checkpoint:" in capsys.readouterr().err
    assert main(["sft", "model.preset=big"]) == 2
    assert "model.preset: unknown model preset 'big'" in capsys.readouterr().err


def test_reward_that_fails_on_every_demonstration(capsys, tmp_path, monkeypatch):
    """A wrong signature would score every sample 0 under on_error=zero: caught before training."""
    (tmp_path / "narrow.py").write_text("def reward(completion):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    err = _fails(capsys, tmp_path, "rewards.sources=[{type: function, fn: 'narrow:reward'}]",
                 "rewards.on_error=zero", "task.n_train=20", "task.n_test=5")
    assert "rewards: 'narrow.reward' fails on the demonstration of training example 1" in err
    assert "TypeError: reward() got an unexpected keyword argument" in err


@pytest.mark.parametrize("override, expected", [
    ("rollout.prompts_per_step=1 train.minibatches=1", "rollout.prompts_per_step=1 is below the number of ranks (2)"),
    ("audit.every=1", "audit.every: audit records are single-process only"),
    ("dist.strategy=fsdp", "model.lora with dist.strategy=fsdp: sharded adapters are not built"),
])
def test_torchrun_refusals(capsys, tmp_path, monkeypatch, override, expected):
    """Under torchrun (WORLD_SIZE=2): LoRA trains with ddp (test_distributed), not with fsdp."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    lora = ["model.lora={r: 4, alpha: 8}"] if "fsdp" in override else []
    assert expected in _fails(capsys, tmp_path, *override.split(), *lora)
