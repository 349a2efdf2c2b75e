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


def lora_policy(seed: int = 0, **lora):
    """tiny-dense under LoRA adapters (r=4, all linear layers) whose B is not zero: a policy that
    differs from its base. Returns (policy, tokenizer)."""
    from gspo.config import LoRAConfig
    from gspo.training.lora import attach
    model, tok = build_model("tiny-dense", seed)
    policy = attach(model, LoRAConfig(**{"r": 4, **lora}), seed=seed, base="tiny-dense")
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return policy.eval(), tok


def test_a_lora_policy_reaches_a_whole_weight_engine_merged_out_of_place():
    """engines.weights.merged_adapters: the base model's names (no lora_A / lora_B, no
    base_layer), each adapted weight W + B·A·alpha/r (by hand here: q_proj of layer 0), the other
    tensors the policy's own; the policy's weights untouched; a plain model loaded with them
    computes the policy's log-probs."""
    from gspo.core.logprobs import response_logprobs
    from gspo.rollout.engines.weights import architecture, merged_adapters
    policy, tok = lora_policy()
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    merged = merged_adapters(policy)
    plain = build_model("tiny-dense", 0)[0]
    assert sorted(merged) == sorted(plain.state_dict())
    q = policy.base_model.model.model.layers[0].self_attn.q_proj
    A, B, W = q.lora_A["default"].weight, q.lora_B["default"].weight, q.base_layer.weight  # [r, in], [out, r], [out, in]
    assert torch.allclose(merged["model.layers.0.self_attn.q_proj.weight"], W + B @ A * (32.0 / 4),
                          atol=1e-6)
    assert torch.equal(merged["model.embed_tokens.weight"],
                       policy.get_base_model().model.embed_tokens.weight)       # not adapted
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())   # not merged in place
    assert architecture(policy) is policy.get_base_model()
    # computed as read, the merged tensors are fresh each time: only the tied head is an alias
    # (a freed tensor's address, reused by the next, once made them aliases of each other)
    assert engines.weights.aliases(merged) == {"lm_head.weight": "model.embed_tokens.weight"}
    plain.load_state_dict(dict(merged))
    ids = torch.tensor([tok("S 4 7 3: 14")["input_ids"], tok("S 1 2 9: 12")["input_ids"]])   # [2, L]
    with torch.no_grad():
        want, got, base = (response_logprobs(m, ids, torch.ones_like(ids), torch.ones(2, 3),
                                             temperature=1.0, with_entropy=False).logp
                           for m in (policy, plain, build_model("tiny-dense", 0)[0]))
    assert (got - want).abs().max() < 1e-5 < (base - want).abs().max()


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
def test_an_adapter_on_a_tied_weight_is_not_merged():
    """Tied embeddings and output head are one tensor: an adapter on the embeddings would change
    the head too once merged, so it is refused in one line."""
    from gspo.rollout.engines.weights import merged_adapters
    policy, _ = lora_policy(target_modules=["embed_tokens"])
    with pytest.raises(ValueError, match="tied to another weight") as err:
        merged_adapters(policy)
    assert "\n" not in str(err.value)


class WholeWeights(engines.Engine):
    """An engine with kernels of its own (Capabilities.adapters False) that records what it is
    built from and handed."""
    capabilities = engines.Capabilities(own_kernels=True)

    def __init__(self, model, tokenizer, weights=None):
        self.built_from, self.received = model, [dict(weights)]

    def update_weights(self, weights, version):
        self.received.append(dict(weights))

    def generate(self, *args, **kwargs):
        raise NotImplementedError


class OneProcess:
    """The Shards of one process (gspo.rollout.shares.Shards)."""
    world = 1

    def weights(self, model):
        return model.state_dict()


def test_the_engine_host_merges_for_an_engine_without_adapters_only(monkeypatch):
    """EngineHost reads Capabilities.adapters: an engine that samples whole weights only is built
    from the LoRA policy's base and synced with the merged weights before every generation (an
    adapter step reaches it); hf samples on the policy itself, adapters and all."""
    from types import SimpleNamespace
    from gspo.rollout.engine_host import EngineHost
    from gspo.rollout.engines.weights import merged_adapters
    monkeypatch.setattr(engines.base, "ENGINES", engines.ENGINES.copy())
    engines.register("whole")(WholeWeights)
    policy, tok = lora_policy()
    rollout = SimpleNamespace(engine="whole", dtype="model", engine_sleep=False, quantize=None,
                              engine_tp=1, placement="colocated", sampler="multinomial")
    cfg = SimpleNamespace(rollout=rollout, seed=0, run=SimpleNamespace(threads=1))
    host = EngineHost(cfg, policy, tok, OneProcess())
    engine = host.sampler(0)
    assert host.merges() and engine.built_from is policy.get_base_model()
    with torch.no_grad():                                          # an optimizer step on the adapters
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.add_(0.01)
    host.sampler(1)
    first, synced = engine.received
    want = dict(merged_adapters(policy))
    assert synced.keys() == want.keys() == first.keys()
    assert all(torch.equal(synced[k], want[k]) for k in want)
    assert not torch.equal(first["model.layers.0.mlp.up_proj.weight"],
                           synced["model.layers.0.mlp.up_proj.weight"])
    hf = EngineHost(SimpleNamespace(**{**vars(cfg), "rollout": SimpleNamespace(
        **{**vars(rollout), "engine": "hf"})}), policy, tok, OneProcess())
    assert not hf.merges() and hf.sampler(0).samples_on(policy)
