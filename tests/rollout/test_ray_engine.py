"""Generators on Ray (gspo.rollout.engines.ray_generators), the engine alone: two hf generators on a local
cluster, one engine for the module (its start costs seconds). The weights are bit-equal on every
generator after every sync, versioned, a stale sync refused; each shard is seeded by its first
prompt; a SIGKILLed generator is replaced and its prompts re-issued with the same samples.
The runs, processes and refusals: tests/rollout/test_ray.py."""

import os
import signal

import pytest
import torch

pytest.importorskip("ray")

from gspo.models.presets import build_model  # noqa: E402
from gspo.rollout import engines
from gspo.rollout.engines import ray_cluster, ray_generators  # noqa: E402
from gspo.rollout.generate import SamplingParams  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_without_auth")


@pytest.fixture(scope="module")
def two():
    """(RayEngine with two hf generators, model, tokenizer) on a local cluster."""
    model, tokenizer = build_model("tiny-dense", 0)
    model.eval()
    engine = ray_generators.build("hf", model, tokenizer, ray_cluster.RaySpec(generators=2, cpus=1))
    yield engine, model, tokenizer
    engine.close()


def generator_weights(engine, j):
    return engine.ray.get(engine.generators[j].actor.weights.remote())


def assert_bit_equal(got, want):
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), \
        [k for k in want if not torch.equal(got[k], want[k])]


PARAMS = SamplingParams(8)


def prompts(tokenizer):
    return [tokenizer(p)["input_ids"] for p in ("12+3=", "7*8=", "40-9=")]


def test_weights_are_bit_equal_after_every_sync_and_versioned(two):
    engine, model, _ = two
    for j in range(2):                                     # the first sync, at start
        assert_bit_equal(generator_weights(engine, j), model.state_dict())
    for version in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 1e-3)
        engine.update_weights(model.state_dict(), version)
        for j in range(2):
            assert_bit_equal(generator_weights(engine, j), model.state_dict())
    syncs = engine.syncs
    engine.update_weights(model.state_dict(), 2)           # this version is there: not sent again
    assert engine.syncs == syncs
    stats = engine.metrics()
    assert stats["ray/sync_mb"] > 0 and stats["ray/generator_restarts"] == 0
    # a generator asked to sample with another sync's weights refuses
    stale = engine.generators[0].actor.generate.remote([[1, 2]], 2, PARAMS, 0, False, syncs - 1)
    with pytest.raises(engine.ray.exceptions.RayTaskError, match="holds the weights of sync"):
        engine.ray.get(stale)


def test_shards_are_seeded_by_their_first_prompt(two):
    """Generator j samples prompts a_j.. with seed + a_j; each shard is what a local hf engine
    samples for those prompts with that seed."""
    engine, model, tokenizer = two
    engine.update_weights(model.state_dict(), None)
    ids = prompts(tokenizer)
    got = engine.generate(ids, 4, PARAMS, seed=5, with_logprobs=True)
    local = engines.build("hf", model, tokenizer)
    for rows, part, seed in ((slice(0, 8), ids[:2], 5), (slice(8, 12), ids[2:], 7)):
        want = local.generate(part, 4, PARAMS, seed=seed, with_logprobs=True)
        T = want.response_ids.shape[1]
        assert torch.equal(got.response_ids[rows, :T], want.response_ids)
        assert torch.equal(got.logp[rows, :T], want.logp)
        assert not got.response_mask[rows, T:].any()


def test_a_killed_generator_is_replaced_and_its_prompts_reissued(two):
    engine, model, tokenizer = two
    engine.update_weights(model.state_dict(), None)
    ids = prompts(tokenizer)
    before = engine.generate(ids, 4, PARAMS, seed=3, with_logprobs=True)
    dead = engine.pids()[1]
    os.kill(dead, signal.SIGKILL)
    after = engine.generate(ids, 4, PARAMS, seed=3, with_logprobs=True)
    assert torch.equal(before.response_ids, after.response_ids)
    assert torch.equal(before.logp, after.logp)
    assert engine.metrics()["ray/generator_restarts"] == 1
    assert engine.pids()[1] != dead
    assert_bit_equal(generator_weights(engine, 1), model.state_dict())


def test_a_lora_policys_merged_weights_reach_the_generators(two):
    """A LoRA policy on Ray (what EngineHost hands generators, which sample whole weights only):
    its adapters merged into its base's weights (engines.weights.merged_adapters), sent in the
    buckets laid out for the base's names; every generator holds them bit for bit and samples
    with the trainer's log-probs (through peft's adapters) to 1e-5."""
    import copy
    from gspo.config import LoRAConfig
    from gspo.core.logprobs import response_logprobs
    from gspo.rollout.engines.weights import merged_adapters
    from gspo.rollout.generate import left_pad, rollout_batch
    from gspo.tasks import Example
    from gspo.training.lora import attach
    engine, model, tokenizer = two
    policy = attach(copy.deepcopy(model), LoRAConfig(r=4), seed=0, base="tiny-dense").eval()
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    merged = dict(merged_adapters(policy))
    try:
        engine.update_weights(merged, None)
        for j in range(2):
            assert_bit_equal(generator_weights(engine, j), merged)
        ids = prompts(tokenizer)
        got = engine.generate(ids, 4, PARAMS, seed=3, with_logprobs=True)
        pad, mask = left_pad(ids, tokenizer.pad_token_id)
        batch = rollout_batch(tokenizer, pad, mask, got, [Example("", "")] * len(ids), 4)
        with torch.no_grad():
            trainer = response_logprobs(policy, batch.input_ids, batch.attention_mask,
                                        batch.response_mask, with_entropy=False).logp   # [N, T]
        m = batch.response_mask > 0
        assert (trainer - got.logp).abs()[m].max() < 1e-5
    finally:
        engine.update_weights(model.state_dict(), None)
