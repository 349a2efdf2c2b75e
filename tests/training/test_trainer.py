"""The RL loop on tiny-dense: one shared short run checked from every side, the on-policy first
minibatch, the SFT cache, exact resume, the other objectives and options, and the data plumbing.

Rewards: the arithmetic verifier gives an untrained model reward 0 everywhere (no signal), so most
runs use the first-character-parity reward of conftest, which varies inside groups."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from gspo.rollout import collect as collect_module
from gspo.rollout.data import build_task
from gspo.training import cold_start
from gspo.core.advantages import group_advantages
from gspo.config import load_config
from gspo.observe.metrics import read_metrics
from gspo.models.presets import load_model
from gspo.observe.report import build_report
from gspo.core.plan import split_minibatches
from gspo.rollout.collect import DataCursor
from gspo.training.cold_start import initial_policy
from gspo.training.trainer import Trainer
from gspo.training.old_policy import OldLogprobs
from conftest import parity_rewards

STEP_KEYS = [
    "step", "reward/mean", "reward/std", "reward/frac_zero_std_groups", "policy/loss",
    "policy/clip_frac_tokens", "policy/clip_frac_seqs", "policy/ratio_mean", "policy/approx_kl",
    "policy/entropy", "response/length_mean", "response/truncated_frac", "optim/grad_norm",
    "optim/lr", "time/generate_s", "time/train_s", "time/step_s",
]


_parity = parity_rewards


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _steps(run_dir) -> list[int]:
    return [row["step"] for row in read_metrics(run_dir)]


# ------------------------------------------------------------------------------- the shared run

@pytest.fixture(scope="module")
def base(tmp_path_factory, small_config, reward_module):
    """SFT 5 steps (cached), then 2 GSPO steps, checkpoint every step; report built after."""
    root = tmp_path_factory.mktemp("base")
    overrides = ["run.save_every=1", _parity(reward_module)]
    cfg = small_config(root, *overrides)
    logs: list[str] = []
    summary = Trainer(cfg, log=logs.append).run()
    report = build_report(cfg.run.dir)
    return dict(root=root, cfg=cfg, overrides=overrides, summary=summary, logs=logs, report=report,
                rows=read_metrics(cfg.run.dir))


def test_run_logs_every_required_metric(base):
    rows = base["rows"]
    assert [r["step"] for r in rows] == [0, 1, 2]      # eval before RL, then one row per step
    for row in rows[1:]:
        missing = [k for k in STEP_KEYS if k not in row]
        assert not missing, f"step {row['step']} lacks {missing}"
        assert all(isinstance(row[k], (int, float)) and math.isfinite(row[k]) for k in STEP_KEYS)
        assert 0 <= row["reward/mean"] <= 1 and 0 <= row["reward/frac_zero_std_groups"] <= 1
        assert 0 <= row["policy/clip_frac_tokens"] <= 1 and 0 <= row["policy/clip_frac_seqs"] <= 1
        assert 1 <= row["response/length_mean"] <= 4            # max_new_tokens = 4
        assert row["optim/lr"] == pytest.approx(1e-4)           # constant schedule, no warm-up
        assert row["time/step_s"] >= row["time/train_s"] > 0
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[-1]   # before and after
    assert "eval/accuracy" not in rows[1]                               # eval_every = 0
    assert any(r["reward/std"] > 0 for r in rows[1:]), "the parity reward gives a signal"


def test_run_summary(base):
    s = json.loads((base["root"] / "run" / "summary.json").read_text())
    assert s == base["summary"]
    assert (s["objective"], s["task"], s["steps"]) == ("gspo", "arithmetic", 2)
    assert s["wall_s"] >= 0
    for key in ("eval_before", "eval_after"):
        assert 0 <= s[key]["accuracy"] <= 1 and s[key]["n"] == 8 and s[key]["k"] == 2
    assert s["accuracy_gain"] == pytest.approx(s["eval_after"]["accuracy"] - s["eval_before"]["accuracy"])
    assert s["eval_after"]["accuracy"] == base["rows"][-1]["eval/accuracy"]
    assert s["final_checkpoint"].endswith("checkpoints/step_000002")
    assert s["cold_start"]["sft_steps"] == 5
    assert s["cold_start"]["checkpoint"].startswith(str(base["root"] / "sft-cache"))


def test_run_outputs_on_disk(base):
    run = base["root"] / "run"
    assert load_config(run / "config.yaml") == base["cfg"]
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == ["step_000001", "step_000002"]
    assert base["report"] == run / "report.md"
    text = base["report"].read_text()
    assert "Objective **gspo** on task **arithmetic**" in text
    pngs = sorted((run / "plots").glob("*.png"))
    assert {"reward_mean.png", "eval_accuracy.png", "policy_clip_frac_tokens.png"} <= {p.name for p in pngs}
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"(plots/{png.name})" in text
    assert not (run / "tb").exists()                   # run.tensorboard = false


# ------------------------------------------------------------------------------- SFT cache

def test_sft_cache_is_reused(base, monkeypatch):
    """Same model/task/sft/seed: no SFT runs again, the same folder is returned."""
    cfg = base["cfg"]
    def no_sft(*args, **kwargs):
        raise AssertionError("SFT ran again despite a cached checkpoint")
    monkeypatch.setattr(cold_start, "train_sft", no_sft)
    logs = []
    model, _, info = initial_policy(cfg, build_task(cfg), log=logs.append,
                                    progress=False)
    assert info["checkpoint"] == base["summary"]["cold_start"]["checkpoint"]
    assert any("reusing cached SFT checkpoint" in line for line in logs)
    cached, _ = load_model(info["checkpoint"])
    assert _same_weights(_params(model), _params(cached))
    # a different SFT setting is a cache miss (SFT would run)
    other = base["cfg"].model_copy(update={"sft": cfg.sft.model_copy(update={"lr": 1e-3})})
    with pytest.raises(AssertionError, match="SFT ran again"):
        initial_policy(other, build_task(other), log=logs.append, progress=False)


def test_first_run_logged_sft(base):
    assert any("cold start: SFT for 5 steps" in line for line in base["logs"])


# ------------------------------------------------------------------------------- resume

def _copy_run(base, name):
    dst = base["root"] / name
    shutil.copytree(base["root"] / "run", dst)
    return dst


def test_resume_continues_from_last_checkpoint(base, small_config):
    run = _copy_run(base, "resumed")
    cfg = small_config(base["root"], *base["overrides"], "train.steps=3", run="resumed")
    logs = []
    summary = Trainer(cfg, resume=True, log=logs.append).run()
    assert any("restored" in line and "(step 2)" in line for line in logs)
    assert not any("held-out before RL" in line for line in logs)     # not evaluated again
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[:3] == base["rows"]
    assert summary["steps"] == 3
    assert summary["eval_before"] == base["summary"]["eval_before"]
    assert (run / "checkpoints" / "step_000003").is_dir()


def test_resume_is_exact(base, small_config):
    """Resume from the step-1 checkpoint: step 2 reproduces the uninterrupted run exactly."""
    run = _copy_run(base, "exact")
    shutil.rmtree(run / "checkpoints" / "step_000002")
    (run / "summary.json").unlink()
    cfg = small_config(base["root"], *base["overrides"], run="exact")
    logs = []
    Trainer(cfg, resume=True, log=logs.append).run()
    assert any("(step 1)" in line for line in logs)
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    strip = lambda row: {k: v for k, v in row.items() if not k.startswith("time/")}  # noqa: E731
    assert strip(rows[2]) == strip(base["rows"][2])
    resumed, _ = load_model(run / "checkpoints" / "step_000002")
    straight, _ = load_model(base["root"] / "run" / "checkpoints" / "step_000002")
    assert _same_weights(_params(resumed), _params(straight))


def test_resume_without_checkpoint_starts_from_scratch(make_cfg, reward_module):
    cfg = make_cfg("sft.enabled=false", "train.steps=0", _parity(reward_module))
    logs = []
    summary = Trainer(cfg, resume=True, log=logs.append).run()
    assert any("no usable checkpoint" in line for line in logs)
    assert summary["steps"] == 0 and summary["eval_after"] == summary["eval_before"]


def test_fresh_run_in_used_dir(base, small_config):
    _copy_run(base, "reused")
    cfg = small_config(base["root"], *base["overrides"], "train.steps=0", run="reused")
    try:
        summary = Trainer(cfg, log=lambda m: None).run()
    except (ValueError, FileExistsError):
        return                        # refusing to overwrite a run is an acceptable fix
    assert _steps(cfg.run.dir) == [0]
    assert Path(summary["final_checkpoint"]).is_dir()


# ------------------------------------------------------------------------------- one step

def test_first_minibatch_is_exactly_on_policy(fresh):
    t = fresh("train.minibatches=1")
    batch, rewards, _ = t.collector.collect(0)
    old = t.step.old_logprobs(batch)                                          # [N, T]
    t.model.train()
    new = t.step.passes.logprobs(t.model, batch, with_entropy=True).logp            # with grad, like update
    assert torch.equal(new.detach(), old)                                 # bit for bit
    adv = group_advantages(rewards, t.cfg.rollout.group_size)
    assert adv.abs().sum() > 0
    loss, stats = t.step.objective(new, old, adv, batch.response_mask, **t.cfg.objective_kwargs())
    assert stats["ratio_min"].item() == stats["ratio_max"].item() == 1.0
    assert stats["clip_frac_tokens"].item() == stats["clip_frac_seqs"].item() == 0.0
    assert stats["approx_kl"].item() == 0.0
    # s_i = 1 for all i: loss = -(1/N) Σ Â_i = 0, since Â is centred within each group
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in t.model.parameters())


def test_a_step_changes_the_parameters(fresh):
    t = fresh("train.minibatches=1")
    before = _params(t.model)
    row = t.step(0)
    assert row["step"] == 1
    # one minibatch on the rollout batch itself: the ratio is exactly 1 and nothing is clipped
    assert row["policy/ratio_min"] == row["policy/ratio_max"] == row["policy/ratio_mean"] == 1.0
    assert row["policy/clip_frac_tokens"] == 0.0 and row["policy/approx_kl"] == 0.0
    assert row["optim/grad_norm"] > 0
    after = _params(t.model)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert "model.embed_tokens.weight" in changed and len(changed) > len(before) // 2


def test_second_minibatch_is_off_policy(fresh):
    t = fresh("train.minibatches=2")
    row = t.step(0)
    # averaged over 2 minibatches: the first has ratio 1, the second moved after one update
    assert row["policy/approx_kl"] != 0.0
    assert row["policy/ratio_min"] != 1.0 or row["policy/ratio_max"] != 1.0


# ------------------------------------------------------------------------------- other options

def test_grpo_with_kl_and_rollout_logprobs(make_cfg, reward_module):
    cfg = make_cfg("sft.enabled=false", _parity(reward_module), "objective.name=grpo",
                   "train.beta=0.04", "train.old_logprobs=rollout", "train.steps=1",
                   "rollout.temperature=0.8")  # != 1: both sides must divide by it
    summary = Trainer(cfg, log=lambda m: None).run()
    assert summary["objective"] == "grpo"
    row = read_metrics(cfg.run.dir)[1]
    assert math.isfinite(row["policy/kl_ref"]) and row["policy/kl_ref"] >= 0   # k3 >= 0
    for key in ("mismatch/token_abs_mean", "mismatch/token_abs_max", "mismatch/seq_logratio_abs_mean"):
        assert 0 <= row[key] < 1e-4   # generator and trainer: same weights, same temperature
    assert 0 <= row["policy/clip_frac_tokens"] <= 1


def test_kl_reference_is_the_frozen_initial_policy(fresh):
    t = fresh("train.beta=0.04", "train.minibatches=1")
    initial = _params(t.model)
    first = t.step(0)
    # one minibatch, policy == reference: every per-token k3 term is exp(0) - 0 - 1 = 0
    assert first["policy/kl_ref"] == 0.0
    second = t.step(1)
    assert second["policy/kl_ref"] > 0                  # the policy moved, the reference did not
    assert _same_weights(_params(t.ref_model), initial)
    assert not _same_weights(_params(t.model), initial)


def test_mask_truncated_drops_truncated_responses(fresh):
    t = fresh("train.mask_truncated=true", "train.minibatches=1")
    before = _params(t.model)
    row = t.step(0)
    # an untrained model never emits EOS within 4 tokens here: every response is truncated,
    # so nothing is left in the loss and the update is exactly zero
    assert row["response/truncated_frac"] == 1.0 and row["reward/std"] > 0
    assert row["optim/grad_norm"] == 0.0 and row["policy/loss"] == 0.0
    assert _same_weights(_params(t.model), before)


def test_no_kl_no_mismatch_by_default(base):
    row = base["rows"][1]
    assert "policy/kl_ref" not in row and not any(k.startswith("mismatch/") for k in row)


def test_dynamic_sampling_keeps_whole_informative_groups(fresh, monkeypatch):
    """G=2 parity rewards: about half the groups are constant and get dropped, then refilled.
    multistep prompts (8-26 characters) make widths differ between rounds: re-padding is exercised."""
    t = fresh("rollout.group_size=2", "train.minibatches=2", "train.dynamic_sampling=true",
              "train.max_refill_rounds=3", "task.name=multistep")
    G, P = 2, 4
    widths, real_generate = [], collect_module.engines.generate_batch

    def spy(*args, **kwargs):
        out = real_generate(*args, **kwargs)
        widths.append(out.input_ids.shape[1] - out.response_mask.shape[1])   # prompt width
        return out

    monkeypatch.setattr(collect_module.engines, "generate_batch", spy)
    batch, rewards, stats = t.collector.collect(0)
    assert stats["reward/refill_rounds"] >= 1, "this seed must exercise the refill"
    assert len(set(widths)) > 1, "rounds of different prompt widths"
    N = len(rewards)
    assert N % G == 0 and 0 < N <= P * G
    assert rewards.view(-1, G).std(-1).gt(0).all()                     # only informative groups
    assert batch.input_ids.shape[0] == len(batch.completions) == N
    # the re-padded batch is still consistent: rewards re-scored from it, prompts and responses
    assert torch.equal(t.rewards(batch.completions, batch.examples).total, rewards.cpu())
    T = batch.response_mask.shape[1]
    for i in range(N):
        assert batch.examples[i] == batch.examples[i - i % G]            # groups stay together
        prompt = batch.input_ids[i, :-T][batch.attention_mask[i, :-T].bool()]
        assert t.tokenizer.decode(prompt, skip_special_tokens=True) == batch.examples[i].prompt
        assert batch.response_mask[i].sum() == batch.attention_mask[i, -T:].sum()
        assert torch.equal(batch.response_mask[i].nonzero().squeeze(-1),
                           torch.arange(int(batch.response_mask[i].sum())))  # ones then zeros
    adv = group_advantages(rewards, G)
    row, _ = t.step.update(batch, OldLogprobs(t.step.old_logprobs(batch), adv),
                           t.step.plan(batch, adv, 0, speed_paths=False))
    assert math.isfinite(row["policy/loss"])


def test_dynamic_sampling_all_groups_constant(make_cfg):
    # the verifier gives an untrained model reward 0 everywhere: every group is dropped
    cfg = make_cfg("sft.enabled=false", "rollout.group_size=2", "train.dynamic_sampling=true",
                   "train.max_refill_rounds=1")
    Trainer(cfg, log=lambda m: None).run()
    rows = read_metrics(cfg.run.dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[1]["train/skipped"] == rows[2]["train/skipped"] == 1.0
    assert "eval/accuracy" in rows[-1]


def test_update_with_fewer_rows_than_minibatches(fresh):
    t = fresh("rollout.group_size=2", "train.minibatches=4")
    batch, rewards, _ = t.collector.collect(0)
    g = next(j for j in range(4) if rewards[2 * j] != rewards[2 * j + 1])
    rows = torch.tensor([2 * g, 2 * g + 1])                              # one informative group
    small = batch.select(rows)
    adv = group_advantages(rewards[rows], 2)
    row, _ = t.step.update(small, OldLogprobs(t.step.old_logprobs(small), adv),
                           t.step.plan(small, adv, 0, speed_paths=False))
    assert math.isfinite(row["policy/loss"])
    assert all(torch.isfinite(p).all() for p in t.model.parameters())


# ------------------------------------------------------------------------------- data plumbing

def test_data_cursor_epochs_are_permutations():
    c = DataCursor(size=10, seed=3)
    first, second = c.take(10), c.take(10)
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second                                              # reshuffled per epoch
    assert c.state() == {"epoch": 1, "index": 10}
    assert DataCursor(10, 3).take(20) == first + second                 # deterministic in seed
    assert DataCursor(10, 4).take(10) != first


def test_data_cursor_chunking_does_not_matter():
    whole = DataCursor(7, 0).take(30)                                   # spans 5 epochs
    c = DataCursor(7, 0)
    assert sum((c.take(n) for n in (3, 4, 1, 7, 9, 6)), []) == whole


@pytest.mark.parametrize("stop", [0, 4, 7, 10, 14, 17])
def test_data_cursor_resume(stop):
    """take() after load(state) continues exactly like the uninterrupted cursor."""
    whole = DataCursor(7, 5).take(stop + 12)
    c = DataCursor(7, 5)
    c.take(stop)
    resumed = DataCursor(7, 5)
    resumed.load(json.loads(json.dumps(c.state())))                     # through JSON, as saved
    assert c.take(12) == resumed.take(12) == whole[stop:]


def test_split_minibatches_partitions():
    parts = split_minibatches(10, 4, torch.Generator().manual_seed(0))
    assert [len(p) for p in parts] == [3, 3, 2, 2]                      # tensor_split sizes
    assert sorted(torch.cat(parts).tolist()) == list(range(10))
    again = split_minibatches(10, 4, torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(parts, again))
    other = split_minibatches(10, 4, torch.Generator().manual_seed(1))
    assert not all(torch.equal(a, b) for a, b in zip(parts, other))
    assert [len(p) for p in split_minibatches(16, 4, torch.Generator())] == [4] * 4


def test_split_minibatches_by_groups_deals_whole_groups():
    """train.minibatch_by=groups: 6 groups of 4 consecutive rows into 4 minibatches; each group
    lands whole in one minibatch, the groups are shuffled, and G = 1 is the row split itself."""
    parts = split_minibatches(24, 4, torch.Generator().manual_seed(0), group_size=4)
    assert [len(p) for p in parts] == [8, 8, 4, 4]                       # 2, 2, 1, 1 groups
    assert sorted(torch.cat(parts).tolist()) == list(range(24))
    for p in parts:
        groups = p.view(-1, 4)
        assert torch.equal(groups - groups[:, :1], torch.arange(4).expand_as(groups))
        assert bool((groups[:, 0] % 4 == 0).all())
    draws = [split_minibatches(24, 4, torch.Generator().manual_seed(s), 4) for s in range(6)]
    assert len({tuple(int(p[0]) for p in d) for d in draws}) > 1        # the seed shuffles groups
    rows = split_minibatches(24, 4, torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in
               zip(rows, split_minibatches(24, 4, torch.Generator().manual_seed(0), 1)))
    with pytest.raises(ValueError, match="whole groups"):
        split_minibatches(10, 2, torch.Generator(), group_size=4)


# ------------------------------------------------------------------- the best checkpoint by validation

def _scripted_evaluations(monkeypatch, test_acc: list[float], val_acc: list[float]) -> None:
    """Trainer.evaluate returns these greedy accuracies in turn, per split (test, validation)."""
    from gspo.rollout.evaluation import EvalResult
    queues = {"test": list(test_acc), "validation": list(val_acc)}

    def evaluate(self, examples=None):
        split = "validation" if examples is self.val_set else "test"
        n = len(self.val_set if split == "validation" else self.test_set)
        return EvalResult(accuracy=queues[split].pop(0), pass1=0.0, pass_k=0.0, k=2,
                          mean_reward=0.0, mean_length=1.0, n=n)
    monkeypatch.setattr(Trainer, "evaluate", evaluate)


@pytest.mark.parametrize("test_acc", [[0.3, 0.1, 0.6], [0.6, 0.1, 0.3]])
def test_best_checkpoint_is_chosen_by_validation_not_test(make_cfg, reward_module, monkeypatch,
                                                          test_acc):
    # evaluations at steps 0, 1, 2: validation peaks at step 1, test elsewhere
    _scripted_evaluations(monkeypatch, test_acc, val_acc=[0.2, 0.5, 0.4])
    cfg = make_cfg("task.n_val=6", "run.eval_every=1", "run.save_every=1", _parity(reward_module))
    trainer = Trainer(cfg, log=lambda m: None)
    assert {e.prompt for e in trainer.val_set}.isdisjoint(e.prompt for e in trainer.test_set)
    summary = trainer.run()
    best = summary["best_validation"]
    assert (best["step"], best["accuracy"], best["test_accuracy"]) == (1, 0.5, test_acc[1])
    folder = Path(cfg.run.dir) / "best"
    assert best["checkpoint"] == str(folder)
    saved = load_model(folder)[0].state_dict()                 # the weights after step 1
    step1 = load_model(Path(cfg.run.dir) / "checkpoints" / "step_000001")[0].state_dict()
    assert _same_weights(saved, step1)
    assert [r["val/accuracy"] for r in read_metrics(cfg.run.dir) if "val/accuracy" in r] == [0.2, 0.5, 0.4]
    change = summary["accuracy_change"]
    assert change["fell"] == (test_acc[2] < test_acc[0])
    assert math.isclose(change["change"], test_acc[2] - test_acc[0])
    assert json.loads((Path(cfg.run.dir) / "summary.json").read_text())["best_validation"] == best


def test_no_validation_split_keeps_no_best(make_cfg, reward_module, monkeypatch):
    _scripted_evaluations(monkeypatch, [0.5, 0.4], val_acc=[])
    cfg = make_cfg(_parity(reward_module))                      # no task.n_val: no validation
    summary = Trainer(cfg, log=lambda m: None).run()
    assert summary["best_validation"] is None and not (Path(cfg.run.dir) / "best").exists()
    assert summary["accuracy_change"]["fell"]
    assert not any("val/accuracy" in r for r in read_metrics(cfg.run.dir))


def test_a_rollback_keeps_the_newer_best(make_cfg, reward_module, monkeypatch):
    # validation peaks at the last step (2); restoring the checkpoint of step 1, whose history
    # knew only the best of step 1, must still point to best/, which holds step 2's weights
    from gspo.training.checkpoint import load_latest
    _scripted_evaluations(monkeypatch, [0.3, 0.3, 0.3], val_acc=[0.2, 0.4, 0.5])
    cfg = make_cfg("task.n_val=6", "run.eval_every=1", "run.save_every=1", _parity(reward_module))
    trainer = Trainer(cfg, log=lambda m: None)
    trainer.run()
    loaded = load_latest(cfg.run.dir, accept=lambda state: state["step"] == 1)
    assert loaded.state["history"]["best_validation"]["step"] == 1
    trainer.restore(loaded)
    assert trainer.history["best_validation"]["step"] == 2


def test_a_failed_best_write_leaves_the_previous_best(tmp_path, monkeypatch):
    import errno
    from gspo.errors import WriteFailed
    from gspo.training import checkpoint
    folder = tmp_path / "best"
    folder.mkdir()
    (folder / "best.json").write_text('{"step": 1}')

    def full_disk(model, tokenizer, path):
        Path(path, "model.safetensors").write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(checkpoint, "save_model", full_disk)
    with pytest.raises(WriteFailed):
        checkpoint.save_weights(None, None, folder, {"step": 2})
    assert checkpoint.kept_best(tmp_path) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]
