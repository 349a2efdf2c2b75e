"""gspo.rollout.engines without vLLM: the hf engine wraps rollout.sample (same tokens as generate), its
dtype copy and weight sync, the registry and the one-line refusals. vLLM itself: test_vllm.py."""

import dataclasses
import importlib.util

import pytest
import torch

from gspo.rollout import engines
from gspo.models.presets import build_model
from gspo.rollout.generate import SamplingParams, encode_prompts, generate, left_pad
from gspo.tasks import Example

PROMPTS = ["S 4 7 3:", "S 1 2:", "S 9 9 9 9:"]


@pytest.fixture(scope="module")
def policy():
    return build_model("tiny-dense", 0)


def prompt_ids(tokenizer):
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


def test_hf_engine_samples_what_generate_samples(policy):
    model, tok = policy
    params = SamplingParams(max_new_tokens=6)
    engine = engines.build("hf", model, tok)
    out = engine.generate(prompt_ids(tok), 2, params, seed=5)
    examples = [Example(prompt=p, answer="") for p in PROMPTS]
    batch = generate(model, tok, examples, params, group_size=2, with_logprobs=True, seed=5)
    assert torch.equal(out.response_ids, batch.response_ids)
    assert torch.equal(out.response_mask, batch.response_mask)
    assert torch.equal(out.truncated, batch.truncated)
    assert torch.equal(out.logp, batch.rollout_logp)


def test_left_padded_token_ids_match_the_tokenizer(policy):
    _, tok = policy
    ids, mask = left_pad(prompt_ids(tok), tok.pad_token_id)
    enc = encode_prompts(tok, PROMPTS, "cpu")
    assert torch.equal(ids, enc["input_ids"]) and torch.equal(mask, enc["attention_mask"])


def test_hf_engine_in_bfloat16_is_a_synced_copy(policy):
    model, tok = policy
    engine = engines.build("hf", model, tok, dtype=torch.bfloat16)
    assert engine.owns_copy and next(engine.model.parameters()).dtype == torch.bfloat16
    params = SamplingParams(max_new_tokens=6)
    out = engine.generate(prompt_ids(tok), 4, params, seed=1)
    assert out.logp.dtype == torch.float32 and torch.all(out.logp[out.response_mask > 0] < 0)
    moved = build_model("tiny-dense", 1)[0]             # other weights: the copy follows them
    engine.update_weights(moved.state_dict(), 1)
    w = moved.model.embed_tokens.weight
    assert torch.equal(engine.model.model.embed_tokens.weight, w.to(torch.bfloat16))
    assert not torch.equal(engine.model.model.embed_tokens.weight.float(), w)   # really rounded
    assert engine.version == 1
    same = engines.build("hf", model, tok, dtype=torch.float32)
    assert not same.owns_copy and same.model is model


def test_hf_engine_copies_weights_into_its_module_and_knows_when_it_is_the_policy(policy):
    model, tok = policy
    engine = engines.build("hf", model.__class__(model.config), tok)   # its own module
    assert not engine.samples_on(model)
    engine.update_weights(model.state_dict(), 3)       # copied in, in place
    assert all(torch.equal(a, b) for a, b in zip(engine.model.parameters(), model.parameters()))
    assert engine.version == 3
    assert engines.build("hf", model, tok).samples_on(model)   # on the policy: nothing to update


def test_an_engine_takes_only_the_options_it_honours(policy):
    """hf has no seed of its own and no sleep mode: it refuses both rather than ignoring them;
    a run offers each engine only the settings its constructor takes."""
    model, tok = policy
    for option in ({"seed": 0}, {"enable_sleep_mode": True}):
        with pytest.raises(TypeError):
            engines.build("hf", model, tok, **option)
    settings = {"dtype": None, "seed": 0, "enable_sleep_mode": True, "share_prompts": False}
    assert engines.options_for("hf", settings) == {"dtype": None, "share_prompts": False}
    assert engines.options_for("vllm", settings) == {"dtype": None, "seed": 0,
                                                     "enable_sleep_mode": True}


def test_policy_weights_include_the_tied_head(policy):
    model, _ = policy
    names = dict(engines.policy_weights(model))
    assert "lm_head.weight" in names
    assert names["lm_head.weight"].data_ptr() == model.model.embed_tokens.weight.data_ptr()


class CountingReads(dict):
    """A state_dict that records the order its tensors are read in."""

    def __init__(self, state):
        super().__init__(state)
        self.reads = []

    def __getitem__(self, name):
        self.reads.append(name)
        return super().__getitem__(name)


def test_policy_weights_stream_one_tensor_at_a_time_as_the_checkpoint_stores_them():
    """A MoE's fused experts come out one tensor per expert, as the whole-dict revert (and
    save_pretrained) gives them, and each weight is read only when its turn comes: the i-th
    tensor out was produced by at most i+1 reads (a gathering mapping holds one at once)."""
    from transformers.core_model_loading import revert_weight_conversion
    model, _ = build_model("tiny-moe", 0)
    state = CountingReads(model.state_dict())
    whole = revert_weight_conversion(model, dict(model.state_dict()))
    streamed, reads_before = {}, []
    for name, tensor in engines.policy_weights(model, state):
        reads_before.append(len(state.reads))
        streamed[name] = tensor
    assert len(streamed) > len(state) and set(whole) <= set(streamed)   # experts split apart
    assert all(torch.equal(streamed[k], whole[k]) for k in whole)
    assert sorted(state.reads) == sorted(state) and len(state.reads) == len(state)   # each once
    assert all(r <= i + 1 for i, r in enumerate(reads_before))


def test_registry_and_refusals(policy, monkeypatch):
    model, tok = policy
    assert engines.available() == ["hf", "vllm"]
    with pytest.raises(engines.EngineUnavailable, match="unknown engine 'vlm'; valid: hf, vllm"):
        engines.build("vlm", model, tok)
    assert engines.VLLMEngine.capabilities.refuses == {}   # qwen3_moe is served (test_vllm_moe.py)
    refusing = dataclasses.replace(engines.VLLMEngine.capabilities, refuses={"qwen3_moe": "a reason"})
    monkeypatch.setattr(engines.VLLMEngine, "capabilities", refusing)   # the hook still works
    moe, moe_tok = build_model("tiny-moe", 0)
    with pytest.raises(engines.EngineUnavailable, match="cannot serve a qwen3_moe model: a reason") as err:
        engines.build("vllm", moe, moe_tok)
    assert "\n" not in str(err.value)
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(engines.EngineUnavailable, match="needs the 'vllm' package") as err:
            engines.build("vllm", model, tok)
        assert "\n" not in str(err.value)
