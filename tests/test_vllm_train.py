"""The training loop with rollout.engine=vllm (skipped where vLLM is not installed; `make
test-vllm` runs this file in a pytest process of its own: one vLLM engine per process).

A short default-job run samples every step through vLLM (built once after the cold start), logs
mismatch/* every step and resolves train.rollout_correction to tis; the weights are synced in
place: on every step the engine's log-probs equal the trainer's recomputation (both float32) to
TOL, and after training the engine's samples are scored by the trained policy to TOL while the
cold-start policy is off by more (the steps moved the log-probs beyond the tolerance, so a
missed sync would fail the check).
"""

import json

import pytest
import torch

pytest.importorskip("vllm")

from gspo.config import load_config  # noqa: E402
from gspo.core.logprobs import response_logprobs  # noqa: E402
from gspo.models.presets import load_model  # noqa: E402
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


def test_a_short_vllm_run_samples_synced_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    cfg = load_config("configs/default.yaml", [
        f"run.dir={tmp_path / 'run'}", f"sft.cache_dir={tmp_path / 'cache'}", "run.progress=false",
        "rollout.engine=vllm", "sft.steps=150", f"train.steps={STEPS}", "train.lr=1e-3",
        "rollout.prompts_per_step=8", "rollout.group_size=4", "task.n_test=16", "run.eval_every=0",
        "run.trackers=[]"])
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
