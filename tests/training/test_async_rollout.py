"""Asynchronous rollouts (gspo.training.async_rollout): s = 0 is the synchronous run exactly, s = 1 trains
on batches sampled one step earlier with π_old = the weights that sampled them, resume is exact
(the RL update leaves torch's global RNG, which the worker samples from, alone), a stop joins the
worker, and what it cannot serve is refused in one line.

All runs: tiny-dense, no SFT, the first-character-parity reward (a signal in most groups), one
torch thread per side (conftest's run.threads default), on CPU."""

import contextlib
import copy
import multiprocessing
import shutil
import threading
from types import SimpleNamespace

import pytest
import torch

from gspo.training import async_rollout, batch_source
from gspo.config import ConfigError, load_config
from gspo.errors import Interrupted, UserError
from gspo.core import correction, objectives
from gspo.core.logprobs import response_logprobs
from gspo.observe.metrics import read_metrics
from gspo.core.trajectory import scored_mask
from gspo.rollout.generate import RolloutBatch
from gspo.models.presets import (build_model, dropout_rates, enable_activation_checkpointing,
                                 load_model)
from gspo.training.trainer import Trainer
from conftest import parity_rewards


def _run(make_cfg, reward_module, *overrides, run="run", resume=False, logs=None):
    cfg = make_cfg("sft.enabled=false", "train.steps=3", "run.save_every=1", "run.keep_checkpoints=5",
                   parity_rewards(reward_module), *overrides, run=run)
    Trainer(cfg, resume=resume, log=(logs.append if logs is not None else lambda m: None)).run()
    return cfg.run.dir


BEHAVIOUR = ("rollout.async=true", "rollout.max_staleness=1", "rollout.async_ratio=behaviour")
"""s = 1 with π_old = the behaviour policy (gspo's default under rollout.async is decoupled)."""


def _strip(rows):
    """Rows without timings and without the async/* keys (which a synchronous run lacks)."""
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "async/"))} for r in rows]


def _weights(run_dir, step):
    model, _ = load_model(f"{run_dir}/checkpoints/step_{step:06d}")
    return {k: v.clone() for k, v in model.state_dict().items()}


def _worker_threads():
    """Rollout workers still running: threads, or child processes (the default)."""
    return ([t for t in threading.enumerate() if t.name == "gspo-rollout"]
            + [p for p in multiprocessing.active_children() if p.name == "gspo-rollout"])


@pytest.mark.parametrize("kind", ["process", "thread"])
def test_staleness_zero_reproduces_the_synchronous_run(make_cfg, reward_module, kind):
    sync = _run(make_cfg, reward_module, run="sync")
    lock = _run(make_cfg, reward_module, "rollout.async=true", "rollout.max_staleness=0",
                f"rollout.async_worker={kind}", run="s0")
    a, b = read_metrics(sync), read_metrics(lock)
    assert _strip(a) == _strip(b)
    assert [r["async/staleness"] for r in b[1:]] == [0.0, 0.0, 0.0]
    assert any(r["reward/std"] > 0 for r in a[1:]), "the parity reward gives a signal"
    for step in (1, 3):
        wa, wb = _weights(sync, step), _weights(lock, step)
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not _worker_threads()                          # joined at the end


@contextlib.contextmanager
def recorded_batches():
    """{step: the batch the trainer got} while the block runs (AsyncSource.collect wrapped)."""
    seen, original = {}, batch_source.AsyncSource.collect

    def recording(self, step):
        out = original(self, step)
        seen[step] = out[0]
        return out
    batch_source.AsyncSource.collect = recording
    try:
        yield seen
    finally:
        batch_source.AsyncSource.collect = original


@pytest.fixture(scope="module")
def stale(tmp_path_factory, small_config, reward_module):
    """One s = 1 run, its batches recorded as the trainer got them."""
    root = tmp_path_factory.mktemp("stale")
    make_cfg = lambda *o, run="run": small_config(root, *o, run=run)  # noqa: E731
    with recorded_batches() as seen:
        run = _run(make_cfg, reward_module, *BEHAVIOUR)
    return SimpleNamespace(root=root, make_cfg=make_cfg, run=run, seen=seen, reward=reward_module,
                           rows=read_metrics(run))


def test_stale_batches_are_one_step_old_and_change_the_run(stale, make_cfg, reward_module):
    rows = stale.rows[1:]
    # batch 0 and 1 are sampled by the initial weights, batch 2 by those after step 1
    assert [r["async/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(r["async/dropped_batches"] == 0 for r in rows)
    assert all(r["async/wait_s/trainer"] >= 0 and r["async/wait_s/worker"] >= 0 for r in rows)
    sync = read_metrics(_run(make_cfg, reward_module, run="sync"))
    assert _strip(sync)[:2] == _strip(stale.rows)[:2]      # step 1: the same batch and update
    assert _strip(sync)[2]["reward/mean"] != _strip(stale.rows)[2]["reward/mean"] or \
        _strip(sync)[2]["policy/loss"] != _strip(stale.rows)[2]["policy/loss"]


def test_old_logprobs_of_a_stale_batch_are_the_behaviour_policys(stale, small_config):
    """π_old of batch 2 (sampled by version 1) = log-probs under the step-1 checkpoint, not θ_2.
    Here the sampler is transformers on the worker's float32 policy, so they are the sampler's
    own, for every row (sampler_is_behaviour), and the batch carries no sampler log-probs."""
    cfg = small_config(stale.root, "sft.enabled=false")
    batch = stale.seen[2]
    old = batch.behaviour_logp                                                   # [N, T]
    assert stale.seen[0].behaviour_logp is None    # on-policy: the trainer recomputes
    assert batch.rollout_logp is None and stale.seen[0].rollout_logp is None
    behaviour, _ = load_model(f"{stale.run}/checkpoints/step_000001")
    current, _ = load_model(f"{stale.run}/checkpoints/step_000002")
    with torch.no_grad():
        want = response_logprobs(behaviour, batch.input_ids, batch.attention_mask,
                                 batch.response_mask, temperature=cfg.rollout.temperature).logp
        newer = response_logprobs(current, batch.input_ids, batch.attention_mask,
                                  batch.response_mask, temperature=cfg.rollout.temperature).logp
    torch.testing.assert_close(old, want, atol=2e-5, rtol=0)                      # every row
    assert (newer - want).abs().max() > 1e-4      # the trained weights would give other values


def test_behaviour_logprobs_come_from_the_sampler_only_where_it_is_the_behaviour_policy(
        small_config, tmp_path, monkeypatch):
    """The sampler's log-probs stand for π_v only when the sampler is the worker's policy itself
    (hf, its own dtype), under the behaviour ratio, for a dense model, when the config does not
    keep them as a mismatched sampler's, and when generate's logits stack fits the budget."""
    worker = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(vocab_size=40)))
    dense = SimpleNamespace(is_moe=False)
    ok = lambda *o, passes=dense: async_rollout.sampler_is_behaviour(  # noqa: E731
        small_config(tmp_path, *BEHAVIOUR, *o), worker, passes)
    assert ok()
    assert not ok("rollout.dtype=bfloat16")
    assert not ok("train.log_rollout_logprobs=true")
    assert not ok("train.rollout_correction.mode=seq_tis")
    assert not ok("rollout.async_ratio=decoupled", "train.rollout_correction.mode=seq_tis")
    assert not async_rollout.sampler_is_behaviour(                      # gspo's default: decoupled
        small_config(tmp_path, "rollout.async=true"), worker, dense)
    assert not ok(passes=SimpleNamespace(is_moe=True))
    cfg = small_config(tmp_path, *BEHAVIOUR)
    need = cfg.batch_size * cfg.rollout.max_new_tokens * 40 * 4               # N x T x V x 4 bytes
    monkeypatch.setattr(async_rollout, "SAMPLER_LOGPROBS_BYTES", need)
    assert ok()
    monkeypatch.setattr(async_rollout, "SAMPLER_LOGPROBS_BYTES", need - 1)
    assert not ok()


def test_resume_at_staleness_one_is_exact(stale):
    """Resume from step 1: batch 1 is regenerated by version 0 (kept in the checkpoint), and steps
    2-3 reproduce the uninterrupted run (metrics and weights)."""
    run = stale.root / "resumed"
    shutil.copytree(stale.run, run)
    for step in (2, 3):
        shutil.rmtree(run / "checkpoints" / f"step_{step:06d}")
    (run / "summary.json").unlink()
    assert (run / "checkpoints" / "step_000001" / "behaviour-0.safetensors").is_file()
    logs = []
    _run(stale.make_cfg, stale.reward, *BEHAVIOUR,
         run="resumed", resume=True, logs=logs)
    assert any("(step 1)" in line for line in logs)
    assert not any("no weights of versions" in line for line in logs)
    assert _strip(read_metrics(run)) == _strip(stale.rows)
    a, b = _weights(run, 3), _weights(stale.run, 3)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_stop_saves_and_joins_the_worker(make_cfg, reward_module):
    cfg = make_cfg("sft.enabled=false", "train.steps=5", parity_rewards(reward_module),
                   "rollout.async=true", "rollout.max_staleness=1")
    trainer = Trainer(cfg, log=lambda m: None)
    trainer.stop = SimpleNamespace(signum=None)
    original = trainer.log_row

    def stop_after_two(row):          # as a SIGTERM during step 2 would (gspo.training.signals)
        original(row)
        if row.get("step") == 2:
            trainer.stop.signum = 15
    trainer.log_row = stop_after_two
    with pytest.raises(Interrupted):
        trainer.run()
    assert not _worker_threads()
    assert (trainer.run_dir / "checkpoints" / "step_000002").is_dir()
    assert [r["step"] for r in read_metrics(trainer.run_dir)] == [0, 1, 2]


@pytest.mark.parametrize("kind, ratio", [("process", "behaviour"), ("thread", "behaviour"),
                                         ("process", "decoupled")])
def test_settle_returns_once_the_worker_waits_for_new_weights(fresh, kind, ratio):
    """After step 0 and the weights of version 1, the worker can make batches 1 (version 0) and 2
    (version 1), then must wait for version 2: settle returns once it has both, not before
    (decoupled: with π_prox of batch 1 between them)."""
    t = fresh("rollout.async=true", "rollout.max_staleness=1", "train.steps=4",
              f"rollout.async_worker={kind}", f"rollout.async_ratio={ratio}",
              "train.rollout_correction.mode=" + ("seq_tis" if ratio == "decoupled" else "none"))
    try:
        t.step(0)
        t.rollouts.publish(1)
        t.rollouts.settle()
        assert t.rollouts.ready_steps == [1, 2]
        t.rollouts.settle()                        # nothing more can come: returns at once
        assert t.rollouts.ready_steps == [1, 2]
    finally:
        t.rollouts.close()
    assert not _worker_threads()


def test_the_process_worker_runs_the_thread_workers_run(stale, make_cfg, reward_module):
    """Same seed, same run, whichever side of a process boundary the worker is: metrics and
    weights equal (both on this CPU). A worker whose policy aliased the trainer's parameters
    (shared memory) would sample and score with weights the trainer is updating, and differ."""
    thread = _run(make_cfg, reward_module, *BEHAVIOUR,
                  "rollout.async_worker=thread", run="thread")
    assert _strip(read_metrics(thread)) == _strip(stale.rows)
    for step in (1, 2, 3):
        a, b = _weights(thread, step), _weights(stale.run, step)
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_failing_worker_raises_its_error_in_the_trainer(fresh, reward_dir):
    """An exception in the worker process reaches the trainer at its next batch, with the
    worker's traceback as a note; a worker that dies is a RuntimeError that says so."""
    (reward_dir / "gspo_failing_reward.py").write_text(
        "def broken(completion, **row):\n    raise ZeroDivisionError('no reward today')\n")
    t = fresh("rollout.async=true", "rewards.on_error=fail",
              "rewards.sources=[{type: function, fn: 'gspo_failing_reward:broken'}]")
    try:
        with pytest.raises(Exception, match="no reward today") as err:
            t.step(0)
        assert any("in the rollout worker process" in note for note in err.value.__notes__)
    finally:
        t.rollouts.close()
        t.run_lock.release()
    t = fresh("rollout.async=true", "rollout.max_staleness=1", "train.steps=4")
    try:
        t.step(0)
        t.rollouts.worker._proc.kill()
        t.rollouts.publish(1)
        with pytest.raises(RuntimeError, match="worker process ended"):
            t.step(1)
            t.step(2)
    finally:
        t.rollouts.close()
    assert not _worker_threads()


def test_the_worker_process_ends_when_the_trainer_is_gone(fresh):
    """Its watchdog ends it once the trainer's end of its pipe closes, as when the trainer dies
    without stopping it (here the trainer's end is closed by hand, mid-run)."""
    t = fresh("rollout.async=true", "rollout.max_staleness=1", "train.steps=4")
    try:
        t.step(0)
        proc = t.rollouts.worker._proc
        assert proc.is_alive()                      # waiting for the weights of version 1
        t.rollouts.worker._alive.close()
        proc.join(timeout=30)
        assert not proc.is_alive()
    finally:
        t.rollouts.close()
    assert not _worker_threads()


def test_device_tensors_cross_on_the_cpu_and_go_back():
    """A batch from a worker on an accelerator: its device tensors cross wrapped as CPU copies
    and are moved back on arrival; CPU tensors (``batch.correct``), strings and numbers stay.
    (No accelerator here: the wrapped tensors are built by hand, and go back to the CPU.)"""
    wrap = async_rollout._OnDevice
    batch = RolloutBatch(wrap(torch.ones(2, 3)), wrap(torch.ones(2, 3)), wrap(torch.ones(2, 1)),
                         wrap(torch.zeros(2, dtype=torch.bool)), ["a", "b"], [1, 2],
                         behaviour_logp=wrap(torch.full((2, 1), -0.5)),
                         correct=torch.tensor([True, False]))
    item = (3, 2, (batch, wrap(torch.tensor([1.0, 0.0])), {"reward/mean": 0.5}), {"index": 8}, {})
    back = async_rollout._from_host(item, "cpu")
    b = back[2][0]
    assert isinstance(b, RolloutBatch) and b.completions == ["a", "b"] and b.examples == [1, 2]
    assert torch.equal(b.behaviour_logp, torch.full((2, 1), -0.5))
    assert torch.equal(b.input_ids, torch.ones(2, 3)) and b.correct is batch.correct
    assert torch.equal(back[2][1], torch.tensor([1.0, 0.0])) and back[2][2] == {"reward/mean": 0.5}
    assert back[:2] == (3, 2) and back[3] == {"index": 8}
    cpu_only = (b, torch.ones(1))
    assert async_rollout._to_host(cpu_only)[1] is cpu_only[1]       # CPU tensors are not wrapped


def test_a_part_that_does_not_pickle_is_named_in_one_line(fresh):
    t = fresh("rollout.async=true")
    t.collector.task.hook = lambda: None            # a lambda cannot cross to the worker process
    try:
        with pytest.raises(UserError, match="worker's copy of the task cannot be pickled") as err:
            t.rollouts.collect(0)
        assert "\n" not in str(err.value) and "rollout.async_worker=thread" in str(err.value)
    finally:
        t.rollouts.close()


@pytest.mark.parametrize("checkpointing", ["false", "true"])
def test_the_rl_update_leaves_torchs_global_rng_alone(fresh, monkeypatch, checkpointing):
    """The worker samples from torch's global RNG while the trainer updates, so the update must
    neither draw from it nor set it. (Activation checkpointing restored the RNG state in its
    recompute and so rewound the worker's stream: other tokens for the same seed, one run in a
    few.) Pinned on a whole synchronous RL step minus its generation, both checkpointings."""
    t = fresh(f"train.activation_checkpointing={checkpointing}")
    batch, rewards, metrics = t.collector.collect(0)
    assert rewards.view(-1, t.cfg.rollout.group_size).std(-1).gt(0).any(), "a signal to train on"
    t.step.source = SimpleNamespace(collect=lambda step: (batch, rewards, metrics),
                                    seed=t.collector.seed, proximal=lambda step: None)
    sets, set_rng_state = [], torch.set_rng_state
    monkeypatch.setattr(torch, "set_rng_state", lambda state: (sets.append(1), set_rng_state(state)))
    before = torch.get_rng_state()
    row = t.step(0)
    assert row["optim/grad_norm"] > 0                       # it did train, through the head
    assert sets == [] and torch.equal(torch.get_rng_state(), before)


def test_a_policy_with_dropout_is_refused(fresh):
    """Its training forward would draw from the RNG the worker samples from (one line)."""
    t = fresh()
    t.model.config.attention_dropout = 0.1
    with pytest.raises(UserError, match="config.attention_dropout=0.1") as err:
        batch_source.AsyncSource(t.cfg, t.collector, t.step.passes, skip_rows=True)
    assert "\n" not in str(err.value)
    t.model.config.attention_dropout = 0.0
    batch_source.AsyncSource(t.cfg, t.collector, t.step.passes, skip_rows=True)   # no worker yet


def test_checkpointing_repeats_the_dropout_masks_of_a_model_with_dropout():
    model, _ = build_model("tiny-dense", 0)
    model.config.attention_dropout = 0.5
    for m in model.modules():
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.5
    model.train()
    ids = torch.randint(4, 60, (2, 8), generator=torch.Generator().manual_seed(0))

    def grads(m, seed):
        torch.manual_seed(seed)
        m.zero_grad()
        m(input_ids=ids).logits.float().pow(2).mean().backward()
        return [p.grad.clone() for p in m.parameters()]
    checkpointed = copy.deepcopy(model)
    enable_activation_checkpointing(checkpointed)
    assert dropout_rates(model) == {"config.attention_dropout": 0.5}
    want = grads(model, 1)
    assert any(not torch.equal(a, b) for a, b in zip(want, grads(model, 2))), "dropout is on"
    assert all(torch.equal(a, b) for a, b in zip(want, grads(checkpointed, 1)))


def test_the_decoupled_ratio_by_hand():
    """docs/math.md's example: π_v = (0.5, 0.5), π_prox = (0.6, 0.3), π_θ = (0.66, 0.3), Â = 1,
    grpo (ε 0.2/0.27, token mean) with tis (C = 2). Decoupled: weights π_prox/π_v = (1.2, 0.6),
    ratios π_θ/π_prox = (1.1, 1.0), none clipped: loss −(1.2·1.1 + 0.6·1.0)/2 = −0.96, gradient
    on log π_θ −(1.32, 0.6)/2. Behaviour (coupled): ratios (1.32, 0.6), the first clipped at 1.27:
    loss −(1.27 + 0.6)/2 = −0.935, gradient (0, −0.3)."""
    v, prox = torch.tensor([[0.5, 0.5]]).log(), torch.tensor([[0.6, 0.3]]).log()
    theta = torch.tensor([[0.66, 0.3]]).log().requires_grad_()
    mask, adv = torch.ones(1, 2), torch.ones(1)
    grpo = objectives.spec("grpo").fn
    kw = dict(eps_low=0.2, eps_high=0.27, aggregation="seq-mean-token-mean")
    fix = correction.spec("tis").fn(prox, v, mask, cap=2.0)
    torch.testing.assert_close(fix.weight, torch.tensor([[1.2, 0.6]]))
    weighted = correction.weighted_advantages(adv, fix.weight, mask, per_row=False)    # [1, 2]
    loss, _ = grpo(theta, prox, weighted, mask, **kw)
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor(-0.96))
    torch.testing.assert_close(theta.grad, torch.tensor([[-0.66, -0.30]]))
    theta.grad = None
    loss, _ = grpo(theta, v, adv, mask, **kw)
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor(-0.935))
    torch.testing.assert_close(theta.grad, torch.tensor([[0.0, -0.30]]))


@pytest.fixture(scope="module")
def decoupled(tmp_path_factory, small_config, reward_module):
    """A 3-step run at s = 1 with rollout.async_ratio=decoupled (tis), the batches the trainer
    got and the π_prox the worker handed over for each stale one."""
    root = tmp_path_factory.mktemp("decoupled")
    make_cfg = lambda *o, run="run": small_config(root, *o, run=run)  # noqa: E731
    extra = ("rollout.async=true", "rollout.max_staleness=1", "rollout.async_ratio=decoupled",
             "train.rollout_correction.mode=tis")
    handed, original = {}, batch_source.AsyncSource._take_proximal

    def recording(self, step):
        handed[step] = original(self, step)
        return handed[step]
    batch_source.AsyncSource._take_proximal = recording
    try:
        with recorded_batches() as seen:
            run = _run(make_cfg, reward_module, *extra)
    finally:
        batch_source.AsyncSource._take_proximal = original
    return SimpleNamespace(root=root, make_cfg=make_cfg, run=run, seen=seen, handed=handed,
                           extra=extra, reward=reward_module, rows=read_metrics(run))


def test_decoupled_takes_pi_prox_from_the_worker_and_weighs_it_to_the_sampler(decoupled,
                                                                             small_config):
    """rollout.async_ratio=decoupled, s = 1: the worker takes no π_v log-probs (the sampler's are
    π_v's); for the stale batch 2 it hands over π_prox of the rows with a signal outside the
    first minibatch, under the weights after step 2 (its checkpoint), and mismatch/kl of step 3
    is KL(π_v ‖ π_prox) over the rows trained on, not the float noise of the on-policy step 1."""
    rows = decoupled.rows[1:]
    assert [r["async/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    assert "async/worker_proximal_s" in rows[2] and "async/worker_proximal_s" not in rows[0]
    assert sorted(decoupled.handed) == [1, 2]                  # each stale batch, once
    batch, got = decoupled.seen[2], decoupled.handed[2]
    assert batch.behaviour_logp is None and batch.rollout_logp is not None
    cfg = small_config(decoupled.root, "sft.enabled=false", *decoupled.extra)
    rewards = torch.tensor([float(ord(c[0]) % 2) if c else 0.0 for c in batch.completions])
    signal = async_rollout.behaviour_rows(rewards, cfg.rollout.group_size)
    assert torch.equal(got.rows, async_rollout.proximal_rows(cfg, rewards, 2, skip_rows=True))
    assert 0 < len(got.rows) < len(signal)                     # the first minibatch's are not in
    proximal, _ = load_model(f"{decoupled.run}/checkpoints/step_000002")
    with torch.no_grad():
        prox = response_logprobs(proximal, batch.input_ids, batch.attention_mask,
                                 batch.response_mask, temperature=cfg.rollout.temperature).logp
    torch.testing.assert_close(got.logp, prox[got.rows], atol=2e-5, rtol=0)
    mask = scored_mask(batch, cfg.train.mask_truncated)                                 # [N, T]
    want = objectives.masked_mean(objectives.kl_k3(batch.rollout_logp[signal], prox[signal]),
                                  mask[signal])
    assert abs(rows[2]["mismatch/kl"] - want.item()) < 1e-5
    assert rows[2]["mismatch/kl"] > 100 * max(rows[0]["mismatch/kl"], 1e-9)


def test_a_proximal_that_lacks_a_needed_row_is_an_error_not_a_zero():
    """π_prox rows the update reads but the worker did not send would be log π_old = 0 (a ratio
    far off 1): fill refuses, naming them."""
    from gspo.training.proximal import LateProximal
    got = SimpleNamespace(rows=torch.tensor([1, 3]), logp=torch.full((2, 2), -0.5), seconds={})
    mask = torch.ones(4, 2)
    late = LateProximal(lambda: got, torch.zeros(4, 2), torch.ones(4), mask, torch.tensor([1, 2, 3]),
                        mode="seq_tis", params={}, per_row=True)
    with pytest.raises(RuntimeError, match=r"lacks rows \[2\]"):
        late.fill(torch.zeros(4, 2))
    fine = LateProximal(lambda: got, torch.zeros(4, 2), torch.ones(4), mask, torch.tensor([3]),
                        mode="seq_tis", params={}, per_row=True)
    old = torch.zeros(4, 2)
    fine.fill(old)
    assert torch.equal(old[[1, 3]], got.logp) and torch.equal(old[[0, 2]], torch.zeros(2, 2))


def test_decoupled_runs_repeat_across_workers_and_resume(decoupled):
    """The thread worker's run equals the process worker's, and a resume from step 1 equals the
    uninterrupted run (metrics and weights): π_prox from the worker is as reproducible as the
    batches are."""
    thread = _run(decoupled.make_cfg, decoupled.reward, *decoupled.extra,
                  "rollout.async_worker=thread", run="thread")
    assert _strip(read_metrics(thread)) == _strip(decoupled.rows)
    run = decoupled.root / "resumed"
    shutil.copytree(decoupled.run, run)
    for step in (2, 3):
        shutil.rmtree(run / "checkpoints" / f"step_{step:06d}")
    (run / "summary.json").unlink()
    _run(decoupled.make_cfg, decoupled.reward, *decoupled.extra, run="resumed", resume=True)
    assert _strip(read_metrics(run)) == _strip(decoupled.rows)
    for other in (thread, run):
        a, b = _weights(other, 3), _weights(decoupled.run, 3)
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_grpo_runs_the_default_decoupled_ratio_per_token(make_cfg, reward_module):
    """grpo under rollout.async at s = 1 takes auto's decoupled ratio with a token-level tis: the
    stale steps log π_prox from the worker and a KL(π_v ‖ π_prox) of one RL step, not float noise."""
    rows = read_metrics(_run(make_cfg, reward_module, "objective.name=grpo", "rollout.async=true",
                             "rollout.max_staleness=1", run="grpo-decoupled"))[1:]
    assert [r["async/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    assert all("async/worker_proximal_s" in r for r in rows[1:])
    assert rows[2]["mismatch/kl"] > 100 * max(rows[0]["mismatch/kl"], 1e-9)
    assert all(r["mismatch/is_weight_mean"] > 0 for r in rows)


@pytest.mark.parametrize("mode", ["tis", "seq_tis", "icepop", "seq_mask"])
def test_the_correction_taken_per_minibatch_is_the_whole_batchs(mode):
    """LateProximal corrects each minibatch's rows as their π_prox comes in; every correction is
    row-local, so those rows get the advantages and mask the whole-batch correction gives them
    (float64, exactly), and the rows it never corrects keep theirs."""
    from gspo.training.proximal import LateProximal
    gen = torch.Generator().manual_seed(0)
    N, T = 8, 5
    mask = (torch.rand(N, T, generator=gen) > 0.2).double()
    prox = -torch.rand(N, T, generator=gen, dtype=torch.float64) * 2
    v = prox + 0.6 * torch.randn(N, T, generator=gen, dtype=torch.float64)
    adv = torch.randn(N, generator=gen, dtype=torch.float64)
    spec = correction.spec(mode)
    for per_row in (True, False):
        whole = spec.fn(prox, v, mask)
        want_adv = correction.weighted_advantages(adv, whole.weight, mask, per_row=per_row)
        late = LateProximal(None, v, adv, mask, None, mode=mode, params={}, per_row=per_row)
        loss_mask = mask.clone()
        for rows in (torch.tensor([5, 1]), torch.tensor([0, 6, 3])):      # row 2, 4, 7: no signal
            late.correct(rows, prox, loss_mask)
        done = torch.tensor([0, 1, 3, 5, 6])
        assert torch.equal(late.advantages[done], want_adv[done])
        assert torch.equal(loss_mask[done], (mask * whole.mask)[done])
        rest = torch.tensor([2, 4, 7])
        assert torch.equal(loss_mask[rest], mask[rest])
        kept = adv if late.advantages.dim() == 1 else adv[:, None].expand(N, T)
        assert torch.equal(late.advantages[rest], kept[rest])


@pytest.mark.parametrize("override, needle", [
    ("model.lora={r: 4, dropout: 0.1}", "model.lora.dropout"),
    ("rollout.async_ratio=decoupled", "rollout.async_ratio=decoupled needs a train.rollout_correction"),
    ("objective.name=ppo", "objective.name=ppo"),
    ("objective.name=dpo", "objective.name=dpo"),
    ("moe.routing_replay=old", "moe.routing_replay=old"),
    ("guard.nan=rollback", "rollback"),
    ("audit.every=1", "audit.every"),
])
def test_what_it_cannot_serve_is_refused_in_one_line(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.async=true", override])
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_torchrun_serves_ddp_and_refuses_fsdp(monkeypatch):
    """A worker per rank (ddp, hf; tests/training/test_async_torchrun.py runs it); fsdp is refused."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert load_config(None, ["rollout.async=true"]).rollout.async_
    with pytest.raises(ConfigError, match="torchrun with dist.strategy=fsdp"):
        load_config(None, ["rollout.async=true", "dist.strategy=fsdp"])


def test_config_round_trips_the_async_key(tmp_path):
    from gspo.config import dump_yaml
    cfg = load_config(None, ["rollout.async=true", "rollout.max_staleness=2"])
    dump_yaml(cfg, tmp_path / "c.yaml")
    assert "async: true" in (tmp_path / "c.yaml").read_text()
    assert load_config(tmp_path / "c.yaml") == cfg
    with pytest.raises(ConfigError):
        load_config(None, ["rollout.max_staleness=-1"])
    with pytest.raises(ConfigError, match="needs rollout.async=true"):
        load_config(None, ["rollout.async_ratio=decoupled", "train.rollout_correction.mode=tis"])


def test_behaviour_rows_are_the_groups_with_a_signal():
    r = torch.tensor([1., 1., 1., 0., 1., 0., 2., 2., float("nan"), 1.])
    assert async_rollout.behaviour_rows(r, 2).tolist() == [2, 3, 4, 5, 8, 9]


def test_a_bfloat16_sampler_with_correction_is_corrected_against_the_behaviour_policy(
        make_cfg, reward_module):
    """rollout.dtype=bfloat16 + tis: the sampler's log-probs (a bf16 copy of π_v, on the worker)
    are weighed against π_v's float32 log-probs of every row: the mismatch is the dtype's alone,
    as small as in the synchronous run, not one RL step of training."""
    extra = ("rollout.dtype=bfloat16", "train.rollout_correction.mode=tis")
    stale = read_metrics(_run(make_cfg, reward_module, *extra, *BEHAVIOUR, run="bf16-async"))[1:]
    sync = read_metrics(_run(make_cfg, reward_module, *extra, run="bf16-sync"))[1:]
    assert [r["async/staleness"] for r in stale] == [0.0, 1.0, 1.0]
    kl = [r["mismatch/kl"] for r in stale]
    assert all(0 <= k < 10 * max(r["mismatch/kl"] for r in sync) for k in kl), (kl, sync)
    assert not _worker_threads()


@pytest.mark.parametrize("overrides, ratio, mode", [
    (["objective.name=gspo"], "decoupled", "seq_tis"),         # sequence-level: decoupled
    (["objective.name=luspo", "train.rollout_correction.mode=tis"], "decoupled", "tis"),  # kept
    (["objective.name=grpo"], "decoupled", "tis"),             # token-level: tis
    (["objective.name=gspo", "rollout.max_staleness=0"], "behaviour", "none"),   # never stale
    (["objective.name=gspo", "train.old_logprobs=rollout"], "behaviour", "none"),
    (["objective.name=gspo", "rollout.async_ratio=behaviour"], "behaviour", "none"),
])
def test_auto_ratio_is_decoupled_where_a_batch_can_be_stale(tmp_path, overrides, ratio, mode):
    """rollout.async_ratio=auto (the default) resolves at load, and the saved config says what ran."""
    from gspo.config import dump_yaml
    cfg = load_config(None, ["rollout.async=true", *overrides])
    assert (cfg.rollout.async_ratio, cfg.train.rollout_correction.mode) == (ratio, mode)
    dump_yaml(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg
    sync = load_config(None, overrides)                        # synchronous: nothing resolved
    assert sync.rollout.async_ratio == ("behaviour" if "rollout.async_ratio=behaviour" in overrides
                                        else "auto")
    assert sync.train.rollout_correction.mode == ("tis" if "tis" in overrides[-1] else "none")


def test_a_misspelt_key_is_told_the_yaml_name():
    with pytest.raises(ConfigError, match="did you mean 'async'"):
        load_config(None, ["rollout.asyn=true"])


@pytest.mark.parametrize("overrides, hinted", [
    (["objective.name=gspo", "rollout.async_ratio=behaviour"], True),
    (["objective.name=luspo", "rollout.max_staleness=2", "rollout.async_ratio=behaviour"], True),
    (["objective.name=gspo"], False),                          # auto: decoupled, the remedy
    (["objective.name=grpo"], False),
    (["objective.name=grpo", "rollout.async_ratio=behaviour"], True),
    (["objective.name=gspo", "rollout.max_staleness=0", "rollout.async_ratio=behaviour"], False),
    (["objective.name=gspo", "rollout.async_ratio=decoupled",
      "train.rollout_correction.mode=seq_tis"], False),       # already the remedy
])
def test_a_stale_behaviour_ratio_points_to_the_decoupled_form(overrides, hinted):
    hint = batch_source.staleness_hint(load_config(None, ["rollout.async=true", *overrides]))
    assert (hint is not None) == hinted
    if hinted:
        assert "rollout.async_ratio=decoupled" in hint and "\n" not in hint
    assert batch_source.staleness_hint(load_config(None, overrides[:1])) is None   # synchronous
