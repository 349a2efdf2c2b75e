"""The vllm engine on tiny-moe (vLLM's Qwen3-MoE) against transformers; run in its own process (see
test_vllm.py: vLLM serves one architecture per process).

* greedy tokens equal the hf engine's (EOS made likely, so the mask up to EOS is compared too);
* after a weight sync, of unchanged and of moved weights, vLLM's sampling log-probs equal the
  trainer's recomputation to 1e-5 in float32;
* vLLM's own ``reload_weights`` alone still leaves the CPU experts stale (log-probs off by about
  0.13): what ``engines.vllm.forget_moe_kernels`` repairs. When that test fails, vLLM repairs it itself
  and the repair can go;
* a short default-job run on tiny-moe samples synced experts on every step.
"""

import pytest
import torch

pytest.importorskip("vllm")

from gspo.observe.metrics import read_metrics  # noqa: E402
from gspo.rollout import engines  # noqa: E402
from gspo.rollout.generate import SamplingParams  # noqa: E402
from gspo.training.trainer import Trainer  # noqa: E402
from test_vllm import G, NEW, eos_prone, ids_of, trainer_gap  # noqa: E402
from test_vllm_train import STEPS, TOL, vllm_config  # noqa: E402

SAMPLED = SamplingParams(max_new_tokens=NEW, temperature=0.8)


@pytest.fixture(scope="module")
def moe():
    model, tok = eos_prone("tiny-moe")
    engine = engines.build("vllm", model, tok, seed=0)        # no longer refused
    yield model, tok, engine
    engine.close()


def gap(moe) -> float:
    model, tok, engine = moe
    return trainer_gap(model, tok, engine.generate(ids_of(tok), G, SAMPLED, seed=7), 0.8)


def test_moe_greedy_tokens_equal_transformers(moe):
    model, tok, engine = moe
    greedy = SamplingParams(max_new_tokens=NEW, greedy=True)
    ours = engine.generate(ids_of(tok), 1, greedy, with_logprobs=False)
    ref = engines.build("hf", model, tok).generate(ids_of(tok), 1, greedy, with_logprobs=False)
    assert ref.truncated.any() and (~ref.truncated).any(), "EOS cases not exercised"
    assert torch.equal(ours.response_mask, ref.response_mask)
    assert torch.equal(ours.response_ids, ref.response_ids)


def test_moe_logprobs_equal_the_trainers_after_weight_syncs(moe):
    model, _, engine = moe
    assert gap(moe) < 1e-5                                     # as built
    engine.update_weights(model.state_dict(), None)                                 # unchanged weights (was 0.13 off)
    assert gap(moe) < 1e-5
    with torch.no_grad():                                      # a step's worth of change, everywhere
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(1e-2 * torch.randn(p.shape, generator=gen))
    assert gap(moe) > 1e-3                                     # before the sync: the old weights
    engine.update_weights(model.state_dict(), None)
    assert gap(moe) < 1e-5
    engine.update_weights(model.state_dict(), None)                                 # twice in a row: still right
    assert gap(moe) < 1e-5


def test_vllms_reload_alone_leaves_the_cpu_experts_stale(moe):
    """The finding behind forget_moe_kernels, kept measured: vLLM 0.32's reload_weights of the very
    same weights, without the repair, moves the CPU experts' log-probs by far more than 1e-5."""
    model, _, engine = moe
    engine.update_weights(model.state_dict(), None)
    assert gap(moe) < 1e-5
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": engines.policy_weights(model)})
    engine.llm.reset_prefix_cache()
    assert gap(moe) > 1e-2
    engine.update_weights(model.state_dict(), None)                                 # and the repair repairs it
    assert gap(moe) < 1e-5


def test_a_short_tiny_moe_run_samples_synced_experts(tmp_path, monkeypatch):
    """The loop on tiny-moe with vllm (no longer refused): on every step the engine's log-probs equal
    the trainer's recomputation to TOL (0.13 off before the repair: a stale-expert sampler)."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    cfg = vllm_config(tmp_path / "run", tmp_path / "cache", "model.preset=tiny-moe", "sft.steps=100")
    summary = Trainer(cfg).run()
    assert summary["steps"] == STEPS
    steps = [r for r in read_metrics(tmp_path / "run") if "mismatch/kl" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        assert r["mismatch/token_abs_max"] < TOL, r
