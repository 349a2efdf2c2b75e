"""The training loop with rollout.engine=vllm (skipped where vLLM is not installed; `make
test-vllm` runs this file in a pytest process of its own: vLLM serves one model architecture per
process; engines of the same one, built one after the other, are fine).

A short default-job run samples every step through vLLM (built once after the cold start), logs
mismatch/* every step and resolves train.rollout_correction to tis; the weights are synced in
place: on every step the engine's log-probs equal the trainer's recomputation (both float32) to
TOL, and after training the engine's samples are scored by the trained policy to TOL while the
cold-start policy is off by more (the steps moved the log-probs beyond the tolerance, so a
missed sync would fail the check).

With model.lora the engine samples the policy's base with the adapters merged into its weights,
synced before every step: its log-probs are the trainer's (through peft's adapters) to TOL; under
rollout.async at s = 0 a thread worker syncing it from its own copy makes the same run.

Stopped after step 1 and resumed, such a run repeats the uninterrupted one exactly (time/* aside).

Under rollout.async: s = 0 is the synchronous vllm run exactly; at s = 1 the process worker (its
own engine) and the thread worker (the trainer's engine, shared) make the same run, and so does
the thread worker's run resumed after step 3 with a stale batch in flight.
"""

import json
import shutil

import pytest
import torch

pytest.importorskip("vllm")

from gspo.config import load_config  # noqa: E402
from gspo.core.logprobs import response_logprobs  # noqa: E402
from gspo.models.presets import load_model  # noqa: E402
from gspo.observe.metrics import read_metrics  # noqa: E402
from gspo.rollout import engines  # noqa: E402
from gspo.training.trainer import Trainer  # noqa: E402

STEPS = 3
TOL = 5e-5
"""Max over every response token of a batch, float32 both sides: observed 6e-6 to 1.0e-5 per step
over 30-step default-job runs; a missed sync gave 4.09 (the standalone test_vllm.py: < 1e-5)."""


def score(model, batch, temperature):
    with torch.no_grad():
        return response_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_mask,
                                 temperature=temperature, with_entropy=False).logp          # [N, T]


@pytest.fixture(scope="module")
def sft_cache(tmp_path_factory):
    """One cold start (cached by sft.cache_dir) for every run of this file."""
    return tmp_path_factory.mktemp("sft-cache")


def vllm_config(run_dir, cache, *overrides):
    """The default job made tiny (150 SFT steps, 8 prompts x 4, 16 test prompts), sampled by vllm."""
    return load_config("configs/default.yaml", [
        f"run.dir={run_dir}", f"sft.cache_dir={cache}", "run.progress=false",
        "rollout.engine=vllm", "sft.steps=150", f"train.steps={STEPS}", "train.lr=1e-3",
        "rollout.prompts_per_step=8", "rollout.group_size=4", "task.n_test=16", "run.eval_every=0",
        "run.trackers=[]", *overrides])


def test_a_short_vllm_run_samples_synced_weights(tmp_path, monkeypatch, sft_cache):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    cfg = vllm_config(tmp_path / "run", sft_cache)
    assert cfg.train.rollout_correction.mode == "tis"
    trainer = Trainer(cfg)
    try:
        summary = trainer.train()
        rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
        steps = [r for r in rows if "mismatch/kl" in r]
        assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
        for r in steps:   # float32 sampler synced before each step's generation
            assert r["mismatch/token_abs_max"] < TOL, r
            assert abs(r["mismatch/ratio_max"] - 1) < TOL and abs(r["mismatch/ratio_min"] - 1) < TOL
            assert r["mismatch/is_weight_mean"] == pytest.approx(1, abs=TOL)
        assert any(r["reward/std"] > 0 for r in steps)          # some steps had a signal to train on
        assert summary["steps"] == STEPS
        engine = trainer.collector.engine
        assert isinstance(engine, engines.VLLMEngine)           # built once, used by the loop
        examples = trainer.train_set[:8]
        batch = engines.generate_batch(engine, trainer.tokenizer, examples,
                                       trainer.collector.sampling, group_size=4, seed=123,
                                       with_logprobs=True)       # synced by the final evaluation
        m = batch.response_mask > 0
        trained = (batch.rollout_logp - score(trainer.model, batch, cfg.rollout.temperature)).abs()[m]
        assert trained.max().item() < TOL, trained.max().item()
        cold = load_model(trainer.init_info["checkpoint"])[0]   # the weights the engine was built from
        before = (batch.rollout_logp - score(cold, batch, cfg.rollout.temperature)).abs()[m]
        assert before.max().item() > 1e-3, before.max().item()
    finally:
        trainer.collector.close()


def test_a_lora_vllm_run_samples_the_merged_adapters(tmp_path, monkeypatch, sft_cache):
    """model.lora with vllm: the engine is built from the LoRA policy's base with the adapters
    merged into its weights (gspo.rollout.engine_host) and synced so before every step: on every
    step its log-probs equal the trainer's (peft's adapters) to TOL; after training, its samples
    are scored by the trained LoRA policy to TOL, by the base with the adapters off beyond it (the
    adapter steps reached the engine), and only the adapters trained."""
    from gspo.training import lora
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    cfg = vllm_config(tmp_path / "run", sft_cache, "model.lora={r: 8, alpha: 16}")
    trainer = Trainer(cfg)
    try:
        trainer.train()
        steps = [r for r in read_metrics(tmp_path / "run") if "mismatch/kl" in r]
        assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
        assert all(r["mismatch/token_abs_max"] < TOL for r in steps), steps
        assert any(r["reward/std"] > 0 for r in steps)
        assert lora.is_lora(trainer.model)
        engine = trainer.collector.engine
        assert isinstance(engine, engines.VLLMEngine)
        batch = engines.generate_batch(engine, trainer.tokenizer, trainer.train_set[:8],
                                       trainer.collector.sampling, group_size=4, seed=123,
                                       with_logprobs=True)
        m = batch.response_mask > 0
        trained = (batch.rollout_logp - score(trainer.model, batch, cfg.rollout.temperature)).abs()[m]
        assert trained.max().item() < TOL, trained.max().item()
        with lora.reference(trainer.model):                     # the base: adapters off
            base = (batch.rollout_logp - score(trainer.model, batch, cfg.rollout.temperature)).abs()[m]
        assert base.max().item() > 1e-3, base.max().item()
    finally:
        trainer.collector.close()


def test_a_vllm_run_resumes_exactly(tmp_path, monkeypatch, sft_cache):
    """Stopped after step 1 and resumed, a rollout.engine=vllm run repeats the uninterrupted one.

    Why it can be exact: step k's generation seeds prompt p's G samples with
    rollout_seed(seed, k) + p (a per-request generator in vLLM, independent of what the engine
    sampled before), the resumed engine is built from the restored float32 checkpoint (bit-equal
    to the weights the uninterrupted engine was synced to), and a step's batch is the same
    prompts in the same order, so vLLM runs the same forwards. Step 2 of the resumed run is sampled
    by a freshly built engine, step 3 by one synced in place after step 2's update: both paths.

    Exact here (compared with ==): every metric of steps 2 and 3 (rewards, losses, the vLLM
    log-prob metrics mismatch/*, the final greedy and pass@k evaluation through the engine) and
    every weight of the final checkpoint. Not exact: time/* (wall clock). Not claimed: the same on
    a GPU, where vLLM's kernels may pick other reduction orders for other batch shapes (the resumed
    batches have the same shapes, but vLLM does not promise batch-invariant numerics)."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    straight = tmp_path / "straight"
    every_step = ("run.save_every=1", "run.keep_checkpoints=4")   # step 1's checkpoint kept
    summary = Trainer(vllm_config(straight, sft_cache, *every_step)).run()
    assert summary["steps"] == STEPS
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    for later in range(2, STEPS + 1):                 # as if stopped right after step 1's checkpoint
        shutil.rmtree(resumed / "checkpoints" / f"step_{later:06d}")
    (resumed / "summary.json").unlink()
    logs = []
    again = Trainer(vllm_config(resumed, sft_cache, *every_step), resume=True, log=logs.append).run()
    assert any("restored" in line and "(step 1)" in line for line in logs), logs
    strip = lambda row: {k: v for k, v in row.items() if not k.startswith("time/")}  # noqa: E731
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(STEPS + 1))
    assert all("mismatch/kl" in r for r in b[2:])     # the resumed steps sampled through vLLM
    assert [strip(r) for r in b] == [strip(r) for r in a]
    assert again["eval_after"] == summary["eval_after"]
    final = f"step_{STEPS:06d}"
    w_a = load_model(straight / "checkpoints" / final)[0].state_dict()
    w_b = load_model(resumed / "checkpoints" / final)[0].state_dict()
    assert w_a.keys() == w_b.keys() and all(torch.equal(w_a[k], w_b[k]) for k in w_a)


def _timeless(rows):
    """Metrics rows without timings (time/*, async/*_s)."""
    return [{k: v for k, v in r.items() if not k.startswith("time/")
             and not (k.startswith("async/") and (k.endswith("_s") or "/wait_s" in k))} for r in rows]


def test_vllm_with_async_staleness_zero_is_the_synchronous_run(tmp_path, monkeypatch, sft_cache):
    """rollout.async with vllm and s = 0, thread worker: the worker samples batch k through the
    trainer's own engine (``Engine.shared``), synced to its copy of the weights of version k, so
    the run is the synchronous one, every metric (vLLM's mismatch/* included) and every weight."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    sync = tmp_path / "sync"
    Trainer(vllm_config(sync, sft_cache)).run()
    lock = tmp_path / "s0"
    trainer = Trainer(vllm_config(lock, sft_cache, "rollout.async=true", "rollout.max_staleness=0",
                                  "rollout.async_worker=thread"))
    trainer.run()
    a, b = read_metrics(sync), read_metrics(lock)
    assert [r["async/staleness"] for r in b[1:]] == [0.0] * STEPS
    assert all("mismatch/kl" in r for r in b[1:])
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("async/")}  # noqa: E731
                          for r in _timeless(rows)]
    assert strip(a) == strip(b)
    final = f"step_{STEPS:06d}"
    w_a = load_model(sync / "checkpoints" / final)[0].state_dict()
    w_b = load_model(lock / "checkpoints" / final)[0].state_dict()
    assert all(torch.equal(w_a[k], w_b[k]) for k in w_a)


def test_a_lora_vllm_run_with_a_thread_worker_at_staleness_zero_is_the_synchronous_run(
        tmp_path, monkeypatch, sft_cache):
    """model.lora, rollout.async with s = 0 and a thread worker: the worker syncs the trainer's
    engine with its own copy's adapters merged (the same EngineHost path), so the run is the
    synchronous LoRA run, every metric (vLLM's mismatch/* included)."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    lora = "model.lora={r: 8, alpha: 16}"
    Trainer(vllm_config(tmp_path / "sync", sft_cache, lora)).run()
    Trainer(vllm_config(tmp_path / "s0", sft_cache, lora, "rollout.async=true",
                        "rollout.max_staleness=0", "rollout.async_worker=thread")).run()
    a, b = read_metrics(tmp_path / "sync"), read_metrics(tmp_path / "s0")
    assert all("mismatch/kl" in r for r in b[1:])
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("async/")}  # noqa: E731
                          for r in _timeless(rows)]
    assert strip(a) == strip(b)


def test_vllm_with_async_staleness_one_process_and_thread_workers_agree(tmp_path, monkeypatch,
                                                                        sft_cache):
    """s = 1 with vllm: stale batches (staleness 1 from step 2), the decoupled ratio with seq_tis
    weighing π_prox against vLLM's log-probs, which now belong to the weights one step earlier
    (mismatch/* far above the synced tolerance). The process worker builds its own engine in
    its process, the thread worker shares the trainer's: the same run, every metric and weight
    (vLLM seeds each prompt's requests, and both engines hold the same float32 weights); and the
    thread worker's run stopped after step 3 and resumed repeats it too."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    steps, runs = 6, {}
    stale = lambda run, kind: vllm_config(  # noqa: E731
        run, sft_cache, "rollout.async=true", "rollout.max_staleness=1", f"train.steps={steps}",
        f"rollout.async_worker={kind}", "run.save_every=1", f"run.keep_checkpoints={steps}")
    for kind in ("thread", "process"):
        cfg = stale(tmp_path / kind, kind)
        assert (cfg.rollout.async_ratio, cfg.train.rollout_correction.mode) == ("decoupled", "seq_tis")
        Trainer(cfg).run()
        runs[kind] = read_metrics(tmp_path / kind)
    # resumed after step 3: batch 4 in flight, sampled by version 2 (the checkpoint's behaviour file)
    shutil.copytree(tmp_path / "thread", tmp_path / "resumed")
    for later in range(4, steps + 1):
        shutil.rmtree(tmp_path / "resumed" / "checkpoints" / f"step_{later:06d}")
    (tmp_path / "resumed" / "summary.json").unlink()
    assert (tmp_path / "resumed" / "checkpoints" / "step_000003" / "behaviour-2.safetensors").exists()
    Trainer(stale(tmp_path / "resumed", "thread"), resume=True).run()
    runs["resumed"] = read_metrics(tmp_path / "resumed")
    rows = runs["thread"][1:]
    assert [r["async/staleness"] for r in rows] == [0.0] + [1.0] * (steps - 1)
    assert all(r["async/dropped_batches"] == 0 for r in rows)
    assert rows[0]["mismatch/token_abs_max"] < TOL        # step 1: sampled by the weights it trains
    # the batch of step k+1 was sampled before step k's update: off by it when that update moved
    # the weights (a step with a signal), within the synced tolerance when it did not (a step
    # without a signal trains no row and logs no mismatch/*)
    mismatch = {r["step"]: r["mismatch/token_abs_max"] for r in rows if "mismatch/kl" in r}
    signal = {r["step"] for r in rows if r["reward/std"] > 0}
    after_update = [k + 1 for k in signal if k + 1 in mismatch]
    after_none = [k + 1 for k in range(1, steps) if k not in signal and k + 1 in mismatch]
    assert after_update, (mismatch, signal)     # (which steps have a signal depends on the machine)
    assert all(mismatch[k] > 100 * TOL for k in after_update), mismatch
    assert all(mismatch[k] < TOL for k in after_none), mismatch
    assert _timeless(runs["thread"]) == _timeless(runs["process"]) == _timeless(runs["resumed"])
    final = f"step_{steps:06d}"
    w_a = load_model(tmp_path / "thread" / "checkpoints" / final)[0].state_dict()
    for other in ("process", "resumed"):
        w_b = load_model(tmp_path / other / "checkpoints" / final)[0].state_dict()
        assert all(torch.equal(w_a[k], w_b[k]) for k in w_a), other
