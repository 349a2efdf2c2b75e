"""configs/long.yaml, the long-response job: structural checks only (no training).

What the job promises and can be checked without a model: worked-step answers (no direct
answers), a budget of at least 96 new tokens that every correct held-out answer fits with its EOS,
correct answers averaging at least 40 tokens, and a flawed teacher that errs only on long lists.
The learning outcomes (cold start per seed, RL gain, wall time) are measured runs, reported in
docs/results/long-job.md.
"""

import statistics

from gspo import tasks
from gspo.config import load_config
from gspo.models.presets import build_char_tokenizer
from gspo.rollout.data import build_task

CONFIG = "configs/long.yaml"


def correct_answers(cfg) -> list[tuple[tasks.Example, str]]:
    """Held-out examples with their right worked answer (the same prompts without the teacher's flaw)."""
    right = tasks.build(cfg.task.name, seed=cfg.seed, n_train=cfg.task.n_train, n_test=cfg.task.n_test,
                        **{**cfg.task.params, "flawed_fraction": 0.0})
    return [(e, e.answer) for e in right.split("test")]


def test_long_config_loads_with_worked_steps_and_a_96_token_budget():
    cfg = load_config(CONFIG)
    assert cfg.task.name == "multistep" and cfg.task.params.get("direct_fraction", 0.0) == 0.0
    assert cfg.rollout.max_new_tokens >= 96
    assert cfg.sft.enabled and cfg.sft.steps > 0 and cfg.train.steps > 0
    assert cfg.run.threads == 1
    assert cfg.batch_size % cfg.train.minibatches == 0


def test_long_config_correct_answers_are_long_and_fit_the_budget():
    cfg = load_config(CONFIG)
    tokenizer = build_char_tokenizer()
    pairs = correct_answers(cfg)
    assert len(pairs) == cfg.task.n_test
    lengths = [len(tokenizer(answer, add_special_tokens=False)["input_ids"]) for _, answer in pairs]
    assert statistics.mean(lengths) >= 40
    assert max(lengths) + 1 <= cfg.rollout.max_new_tokens  # + EOS: no right answer is truncated
    task = build_task(cfg)
    assert [e.prompt for e in task.split("test")] == [e.prompt for e, _ in pairs]
    for example, answer in pairs:  # the verifier accepts every right worked answer
        assert "," in answer and task.reward(answer, example) == 1.0


def test_long_config_teacher_errs_only_on_long_lists():
    cfg = load_config(CONFIG)
    task = build_task(cfg)
    k_min = cfg.task.params["flawed_min_terms"]
    short = [e for e in task.split("train") if len(e.data["numbers"]) < k_min]
    long = [e for e in task.split("train") if len(e.data["numbers"]) >= k_min]
    assert short and all(task.reward(e.answer, e) == 1.0 for e in short)
    wrong = sum(task.reward(e.answer, e) == 0.0 for e in long) / len(long)
    assert abs(wrong - cfg.task.params["flawed_fraction"]) < 0.05
    # Share of held-out prompts a cold start that learned the teacher exactly gets right: the
    # short lists (what keeps it "partly right"), between 10% and 40%.
    tests = task.split("test")
    share_short = sum(len(e.data["numbers"]) < k_min for e in tests) / len(tests)
    assert 0.10 <= share_short <= 0.40
