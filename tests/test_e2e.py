"""End to end: a user task given as JSONL + `module:function` trains and improves held-out accuracy.

The teacher's demonstrations answer "yes" for 30% of the prompts (those whose number ends in 0-2)
and "no" otherwise; the user's reward function pays only for "yes". The cold start therefore
scores about 0.3 on the held-out prompts, and RL with the user's reward must move it up: the
behaviour to learn ("always answer yes") is general, so it shows on prompts never trained on.
"""

import json

from gspo.cli import main


def _write_task(root):
    for name, rows in (("train.jsonl", range(300)), ("test.jsonl", range(300, 360))):
        with open(root / name, "w") as fh:
            for i in rows:
                fh.write(json.dumps({"prompt": f"q{i}:", "answer": "yes" if i % 10 < 3 else "no",
                                     "id": i}) + "\n")
    (root / "user_reward.py").write_text(
        "def score(completion, **row):\n"
        "    assert 'id' in row and 'prompt' in row  # extra columns reach the function\n"
        "    return 1.0 if completion.strip() == 'yes' else 0.0\n")


def test_custom_jsonl_task_trains_and_improves(tmp_path, monkeypatch):
    _write_task(tmp_path)
    monkeypatch.chdir(tmp_path)                     # the reward module is imported from the cwd
    code = main([
        "train", "task.name=custom", "task.train_file=train.jsonl", "task.test_file=test.jsonl",
        "task.reward=user_reward:score", "sft.steps=40", "sft.batch_size=32",
        f"sft.cache_dir={tmp_path / 'cache'}", "train.steps=20", "rollout.prompts_per_step=8",
        "rollout.group_size=8", "rollout.max_new_tokens=4", "train.lr=1e-3",
        "train.warmup_steps=5", "run.eval_every=0", "run.save_every=0",
        f"run.dir={tmp_path / 'run'}", "run.tensorboard=false", "run.progress=false"])
    assert code == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    before, after = summary["eval_before"]["accuracy"], summary["eval_after"]["accuracy"]
    # Margins measured over seeds 0-4 on an AMD EPYC (60 held-out prompts): cold start 0.3, 0.1,
    # 0.3, 0.3, 0.3; after RL 1.0 in every seed (gain >= 0.7); training reward of step 1 0.13-0.44,
    # of step 20 0.98-1.0. Each bound below leaves >= 0.2 (and >= 3 binomial std) of room.
    assert before <= 0.5                   # the cold start imitates the 30% teacher, no better
    assert after >= before + 0.3, (before, after)
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["reward/mean"] >= rows[1]["reward/mean"] + 0.3   # training reward moved too
