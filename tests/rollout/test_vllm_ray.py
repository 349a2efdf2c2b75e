"""vLLM generators on Ray (rollout.placement=ray, rollout.engine=vllm; gspo.rollout.remote): two
generators, their prompts split with seed offsets, sample exactly the batch of one colocated
vLLM call (tokens and log-probs), before and after a weight sync, and hold the trainer's weights
bit for bit. Runs where both vllm and ray are installed (make test-vllm: .venv-vllm)."""

import os

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("ray")

from gspo.models.presets import build_model  # noqa: E402
from gspo.rollout import engines, remote  # noqa: E402
from gspo.rollout.generate import SamplingParams  # noqa: E402


def test_two_vllm_generators_sample_the_one_call_batch(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    model, tokenizer = build_model("tiny-dense", 0)
    model.eval()
    with torch.no_grad():                       # weights the generators' from_config cannot have
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    ids = [tokenizer(p)["input_ids"] for p in ("12+3=", "7*8=", "40-9=", "5+5=", "9-1=")]
    params = SamplingParams(8)
    before = {p for p in os.listdir("/tmp") if p.startswith("gspo-ray-")}
    ray_engine = remote.build("vllm", model, tokenizer, remote.RaySpec(generators=2, cpus=1),
                              seed=0, kv_cache_gib=1)
    local = None
    try:
        local = engines.build("vllm", model, tokenizer, seed=0, kv_cache_gib=1)
        for version in (None, 1):
            if version is not None:
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.01)
                ray_engine.update_weights(model.state_dict(), version)
                local.update_weights(model.state_dict(), version)
            for j in range(2):
                got = ray_engine.ray.get(ray_engine.generators[j].actor.weights.remote())
                assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())
            remote_samples = ray_engine.generate(ids, 4, params, seed=11, with_logprobs=True)
            want = local.generate(ids, 4, params, seed=11, with_logprobs=True)
            T = want.response_ids.shape[1]
            assert torch.equal(remote_samples.response_ids[:, :T], want.response_ids)
            assert torch.equal(remote_samples.logp[:, :T], want.logp)
    finally:
        if local is not None:
            local.close()
        ray_engine.close()
    assert {p for p in os.listdir("/tmp") if p.startswith("gspo-ray-")} <= before   # removed
