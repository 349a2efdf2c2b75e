"""Routing capture, Routing Replay (old policy and rollout) and routing metrics on tiny MoE models."""

import math

import pytest
import torch
import torch.nn.functional as F
import transformers

from gspo.core.logprobs import response_logprobs
from gspo.core.packing import pack_rows
from gspo.models.presets import build_model
from gspo.models.moe import (
    capture_routing,
    expert_load,
    load_imbalance,
    moe_layers,
    packed_routing,
    replay_routing,
    response_routing,
    router_aux_loss,
    routing_change_rate,
    routing_metrics,
    supports_moe,
)
from gspo.rollout.generate import SamplingParams, generate
from gspo.tasks import Example

PROMPTS = ["12+7=", "3*4-1=", "hello 9"]  # left-padded to Lp = 8 with <bos>
RESPONSE_LENS = [5, 2, 4]  # right-padded to T = 5


def _tiny_moe(seed: int = 0):
    return build_model("tiny-moe", seed)


def _batch(tokenizer, seed: int = 0):
    """input_ids [N, L], attention_mask [N, L], response_mask [N, T] in rollout layout."""
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    g = torch.Generator().manual_seed(seed)
    T = max(RESPONSE_LENS)
    response = torch.randint(4, len(tokenizer), (len(PROMPTS), T), generator=g)
    mask = (torch.arange(T)[None] < torch.tensor(RESPONSE_LENS)[:, None]).float()  # [N, T]
    response = torch.where(mask.bool(), response, tokenizer.pad_token_id)
    return (torch.cat([enc["input_ids"], response], 1),
            torch.cat([enc["attention_mask"], mask.long()], 1), mask)


def _perturb_routers(model, scale: float = 0.005, seed: int = 1) -> None:
    """Move every router by noise at 1/4 of its init std (0.02): flips about a third of the top-2 sets."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in moe_layers(model):
            layer.router.weight.add_(scale * torch.randn(layer.router.weight.shape, generator=g))


def test_capture_leaves_outputs_unchanged():
    model, tok = _tiny_moe()
    ids, attn, _ = _batch(tok)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=attn).logits
        with capture_routing(model) as cap:
            out = model(input_ids=ids, attention_mask=attn).logits
    assert torch.equal(out, ref)
    assert cap.routing.shape == (3, ids.shape[1], 4, 2) and cap.routing.dtype == torch.uint8
    assert len(cap.forwards) == 1 and cap.layer_names[0] == "model.layers.0.mlp.gate"
    real = cap.routing[attn.bool()]  # [tokens, layers, k]
    assert (real[..., 0] != real[..., 1]).all() and int(real.max()) < 8  # k distinct valid experts


def test_replay_of_own_routing_is_identity_in_value_and_gradient():
    model, tok = _tiny_moe()
    ids, attn, mask = _batch(tok)
    routers = [layer.router.weight for layer in moe_layers(model)]

    def loss_and_grads(replay=None):
        model.zero_grad()
        if replay is None:
            logp = response_logprobs(model, ids, attn, mask).logp
        else:
            with replay_routing(model, replay):
                logp = response_logprobs(model, ids, attn, mask).logp
        (logp * mask).sum().backward()
        return logp.detach(), [w.grad.clone() for w in routers]

    with capture_routing(model) as cap:
        ref_logp, ref_grads = loss_and_grads()
    logp, grads = loss_and_grads(cap.routing)
    assert torch.equal(logp, ref_logp)
    for g, ref in zip(grads, ref_grads):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-8)


def test_replay_of_own_routing_is_exact_in_bfloat16():
    """The replayed weights are cast back to the dtype the router returned (bf16 for Qwen3-MoE)."""
    model, tok = build_model("tiny-moe", 0, dtype=torch.bfloat16)
    ids, attn, _ = _batch(tok)
    with torch.no_grad():
        with capture_routing(model) as cap:
            ref = model(input_ids=ids, attention_mask=attn).logits
        with replay_routing(model, cap.routing):
            assert torch.equal(model(input_ids=ids, attention_mask=attn).logits, ref)


def _expert_mlp(experts, e: int, h: torch.Tensor) -> torch.Tensor:
    """Qwen3-MoE expert e by hand: down_e · (silu(gate_e h) ⊙ up_e h)."""
    gate, up = (h @ experts.gate_up_proj[e].T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ experts.down_proj[e].T


def test_replay_forces_captured_experts_after_the_router_moved():
    model, tok = _tiny_moe()
    ids, attn, mask = _batch(tok)
    real = attn.bool()
    with torch.no_grad(), capture_routing(model) as cap:
        model(input_ids=ids, attention_mask=attn)
    old = cap.routing  # [N, L, layers, k] under the old router weights

    _perturb_routers(model)
    with torch.no_grad(), capture_routing(model) as cap:
        free = model(input_ids=ids, attention_mask=attn).logits
    new = cap.routing  # what the moved router picks without replay
    rate, per_layer = routing_change_rate(old, new, real)
    assert 0.1 < rate < 0.9 and (per_layer > 0).all()  # routing flipped on every layer (0.36 here)

    # Record each MoE block's input and output during the replayed forward.
    layers = moe_layers(model)
    seen = {}
    hooks = [layer.block.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, (a[0], o)))
             for i, layer in enumerate(layers)]
    try:
        with torch.no_grad(), replay_routing(model, old) as live, capture_routing(model) as used:
            replayed = model(input_ids=ids, attention_mask=attn).logits
    finally:
        for h in hooks:
            h.remove()
    assert torch.equal(used.routing, old)  # the forward used exactly the replayed experts
    assert torch.equal(live.routing[:, :, 0], new[:, :, 0])  # live top-k: layer 0's input is unchanged
    assert not torch.allclose(replayed, free)

    # Each block = Σ_j w_j · expert_{e_j}(h), e = old ids, w = softmax(W_new h)[e] / Σ_e (renormalised).
    for i, layer in enumerate(layers):
        h_in, out = seen[i]
        h = h_in.reshape(-1, h_in.shape[-1])  # [N·L, H]
        e = old[:, :, i].reshape(-1, 2).long()  # [N·L, k]
        w = torch.softmax(h @ layer.router.weight.T, -1).gather(-1, e)
        w = w / w.sum(-1, keepdim=True)
        experts = layer.block.experts
        ref = torch.stack([sum(w[r, j] * _expert_mlp(experts, int(e[r, j]), h[r]) for j in range(2))
                           for r in range(h.shape[0])])  # [N·L, H]
        torch.testing.assert_close(out.reshape(-1, h.shape[-1]), ref, rtol=1e-5, atol=1e-6)


def test_router_gets_gradient_under_replay():
    model, tok = _tiny_moe()
    ids, attn, mask = _batch(tok)
    with torch.no_grad(), capture_routing(model) as cap:
        model(input_ids=ids, attention_mask=attn)
    _perturb_routers(model)
    model.zero_grad()
    with replay_routing(model, cap.routing):
        logp = response_logprobs(model, ids, attn, mask).logp
    (logp * mask).sum().backward()
    for layer in moe_layers(model):
        g = layer.router.weight.grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0


def test_capture_ignores_activation_checkpoint_recompute():
    model, tok = _tiny_moe()
    ids, attn, mask = _batch(tok)
    model.activation_checkpointing_enable()  # transformers v5 name; non-reentrant by default
    model.train()
    with capture_routing(model) as cap:
        logp = response_logprobs(model, ids, attn, mask).logp
        (logp * mask).sum().backward()  # re-runs every decoder layer's forward
    assert len(cap.forwards) == 1
    with replay_routing(model, cap.routing) as live:  # replay is stateless: recompute sees the same ids
        logp2 = response_logprobs(model, ids, attn, mask).logp
        (logp2 * mask).sum().backward()
    assert len(live.forwards) == 1 and torch.equal(logp2, logp)


def test_replay_rejects_a_routing_of_the_wrong_shape():
    model, tok = _tiny_moe()
    ids, attn, _ = _batch(tok)
    with torch.no_grad(), capture_routing(model) as cap:
        model(input_ids=ids, attention_mask=attn)
    with pytest.raises(ValueError, match=r"must be \[N, L, 4, 2\]"):
        with replay_routing(model, cap.routing[:, :, :3]):
            pass
    with pytest.raises(ValueError, match="got 33 positions"):  # 3 rows x 11 columns, routing has 3 x 13
        with torch.no_grad(), replay_routing(model, cap.routing):
            model(input_ids=ids[:, :11], attention_mask=attn[:, :11])


def test_routing_change_rate_counts_sets_per_layer():
    # One sequence, T = 3, 2 layers, k = 2; token 2 is masked out (changed in both layers: ignored).
    old = torch.tensor([[[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 1], [0, 1]]]])
    new = torch.tensor([[[[1, 0], [3, 2]], [[4, 6], [7, 6]], [[7, 6], [5, 4]]]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # layer 0: t0 {0,1}={1,0} same, t1 {4,5}≠{4,6} changed -> 1/2; layer 1: both same (order) -> 0
    rate, per_layer = routing_change_rate(old, new, mask)
    torch.testing.assert_close(per_layer, torch.tensor([0.5, 0.0]))
    torch.testing.assert_close(rate, torch.tensor(0.25))  # 1 changed of 4 (token, layer) pairs
    rate, per_layer = routing_change_rate(old.to(torch.uint8), old, mask)
    assert rate == 0 and (per_layer == 0).all()


def test_expert_load_and_imbalance_against_hand_numbers():
    # One sequence, T = 4 (last token masked), 2 layers, k = 2, E = 4.
    routing = torch.tensor([[[[0, 1], [0, 1]], [[0, 2], [2, 3]], [[0, 1], [1, 0]], [[3, 0], [3, 2]]]])
    mask = torch.tensor([[1, 1, 1, 0]])
    load = expert_load(routing, mask, num_experts=4)
    # layer 0: e0 3, e1 2, e2 1, e3 0; layer 1: e0 2, e1 2, e2 1, e3 1
    torch.testing.assert_close(load, torch.tensor([[3.0, 2.0, 1.0, 0.0], [2.0, 2.0, 1.0, 1.0]]))
    max_over_mean, cv = load_imbalance(load)
    # layer 0: mean 1.5, max/mean 2, std = sqrt((1.5²+0.5²+0.5²+1.5²)/4) = sqrt(1.25); layer 1: 4/3, 0.5/1.5
    torch.testing.assert_close(max_over_mean, torch.tensor([2.0, 4 / 3]))
    torch.testing.assert_close(cv, torch.tensor([math.sqrt(1.25) / 1.5, 1 / 3]))

    stats = routing_metrics(routing, mask, 4, old=routing)
    torch.testing.assert_close(stats["moe/expert_load_max_over_mean"], torch.tensor((2 + 4 / 3) / 2))
    torch.testing.assert_close(stats["moe/expert_load_cv"], torch.tensor((math.sqrt(1.25) / 1.5 + 1 / 3) / 2))
    torch.testing.assert_close(stats["moe/expert_load_cv/layer_1"], torch.tensor(1 / 3))
    assert stats["moe/routing_change_rate"] == 0 and "moe/routing_change_rate/layer_1" in stats
    assert "moe/routing_change_rate" not in routing_metrics(routing, mask, 4)


def test_rollout_routing_replay_matches_a_full_forward():
    model, tok = _tiny_moe()
    examples = [Example(prompt=p, answer="") for p in PROMPTS]
    # seed 1: one row stops at EOS after 9 tokens, so post-EOS columns (fed unmasked by generate,
    # masked in training) are part of the batch.
    with capture_routing(model) as cap:  # every forward on all N rows: no shared prompt prefill
        batch = generate(model, tok, examples, SamplingParams(max_new_tokens=12), group_size=2, seed=1,
                         share_prompts=False)
    N, L = batch.input_ids.shape
    T = batch.response_mask.shape[1]
    assert [f.shape[1] for f in cap.forwards] == [L - T] + [1] * (T - 1)  # prefill, then one per step
    rollout = cap.generated_routing(L)  # [N, L, layers, k]; column L-1 was never fed, filled 0..k-1
    assert torch.equal(rollout[:, -1].long(), torch.arange(2).expand(N, 4, 2))

    with torch.no_grad(), capture_routing(model) as full:
        ref = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_mask).logp
    # Compare where the training forward attends (after EOS generate fed pads unmasked, training masks them).
    seen = batch.attention_mask[:, : L - 1].bool()
    agree = (rollout[:, : L - 1] == full.routing[:, : L - 1]).all(-1)[seen]  # [tokens, layers]
    assert agree.float().mean() >= 0.99  # exact in practice: smallest top-2 margin ≈ 2e-4 ≫ fp32 noise
    rate, _ = routing_change_rate(response_routing(rollout, T), response_routing(full.routing, T),
                                  batch.response_mask)
    assert rate <= 0.01

    with torch.no_grad(), replay_routing(model, rollout):
        replayed = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_mask).logp
    torch.testing.assert_close(replayed, ref, rtol=0, atol=1e-5)


def test_aux_loss_matches_transformers():
    model, tok = _tiny_moe()
    ids, attn, _ = _batch(tok)
    with torch.no_grad(), capture_routing(model, keep_logits=True) as cap:
        out = model(input_ids=ids, attention_mask=attn, output_router_logits=True)
    aux = router_aux_loss(model, cap.router_logits(), attn)
    torch.testing.assert_close(aux, out.aux_loss, rtol=0, atol=0)
    assert 1.5 < aux < 3.0  # E·Σ_e f_e·P_e with Σ_e f_e = k = 2: exactly 2 when perfectly balanced

    with replay_routing(model, cap.routing, keep_logits=True) as live:
        response_logprobs(model, ids, attn, torch.ones(3, 2))
    aux = router_aux_loss(model, live.router_logits(), attn)
    aux.backward()
    assert moe_layers(model)[0].router.weight.grad.abs().sum() > 0


def test_unsupported_model_is_refused():
    dense, _ = build_model("tiny-dense", 0)
    assert not supports_moe(dense)
    with pytest.raises(ValueError, match=r"model type 'qwen3' is not a supported MoE \(supported: mixtral, "
                                         r"olmoe, qwen2_moe, qwen3_moe\)"):
        with capture_routing(dense):
            pass
    with pytest.raises(ValueError, match="routing replay: model type 'qwen3'"):
        with replay_routing(dense, torch.zeros(1, 1, 1, 2, dtype=torch.uint8)):
            pass


def _other_family(name: str) -> transformers.PreTrainedModel:
    common = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2)
    if name == "mixtral":
        config = transformers.MixtralConfig(**common, intermediate_size=48, num_local_experts=4)
    elif name == "qwen2_moe":  # shared expert; layer 0 dense (decoder_sparse_step=2)
        config = transformers.Qwen2MoeConfig(**common, intermediate_size=48, moe_intermediate_size=24,
                                             shared_expert_intermediate_size=48, num_experts=4,
                                             decoder_sparse_step=2, norm_topk_prob=False)
    else:
        config = transformers.OlmoeConfig(**common, intermediate_size=48, num_experts=4)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_other_families_capture_and_replay(family):
    model = _other_family(family)
    assert supports_moe(model)
    ids = torch.randint(1, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        with capture_routing(model) as cap:
            assert torch.equal(model(input_ids=ids).logits, ref)
        with replay_routing(model, cap.routing):
            assert torch.equal(model(input_ids=ids).logits, ref)
    assert cap.routing.shape == (2, 9, 1 if family == "qwen2_moe" else 2, 2)


@pytest.mark.parametrize("shared", [False, True])
def test_trimmed_shared_forwards_lay_out_the_same_routing(shared):
    """A trimmed (and prompt-shared) log-prob pass under a capture: the same log-probs and
    gradients in float64, and `cap.routing` laid out by its layout gives the untrimmed pass's
    experts at every scored position (response_routing under the response mask). float32: the
    experts' grouped matmul has no float64 kernel."""
    model, tok = _tiny_moe()
    ids, attn, mask = _batch(tok)
    rows = torch.tensor([0, 2, 0, 1, 2, 0])                       # groups 0, 2, 0, 1, 2, 0
    g = torch.Generator().manual_seed(3)
    N, T = len(rows), mask.shape[1] + 2
    ids = torch.cat([torch.zeros(N, 1, dtype=ids.dtype), ids[rows], torch.zeros(N, 2, dtype=ids.dtype)], 1)
    attn = torch.cat([torch.zeros(N, 1, dtype=attn.dtype), attn[rows], torch.zeros(N, 2, dtype=attn.dtype)], 1)
    mask = torch.cat([mask[rows], torch.zeros(N, 2)], 1)           # [N, T]: 1 pad column left, 2 right
    ids[:, -T:] = torch.where(mask.bool(), torch.randint(4, len(tok), (N, T), generator=g), 0)
    results = []
    for split in (False, True):
        model.zero_grad(set_to_none=True)
        with capture_routing(model) as cap:
            out = response_logprobs(model, ids, attn, mask, trim=split,
                                    prompt_groups=rows if split and shared else None)
        cap.layout = out.layout
        out.logp.sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results.append((out.logp.detach(), grads, cap.routing, len(cap.forwards)))
    (logp, grads, routing, n), (split_logp, split_grads, split_routing, split_n) = results
    assert (n, split_n) == (1, 2 if shared else 1)
    torch.testing.assert_close(split_logp, logp, atol=1e-5, rtol=1e-5)
    for a, b in zip(split_grads, grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert split_routing.shape == routing.shape == (N, ids.shape[1], 4, 2)
    scored = mask.bool()
    assert torch.equal(response_routing(split_routing, T)[scored], response_routing(routing, T)[scored])


def test_packed_groups_capture_lays_out_each_rows_experts():
    """Packed groups (a prompt once for its rows) under a capture: each row gets its group's
    prompt experts and its own response experts, those of the padded pass at every scored
    position."""
    model, tok = _tiny_moe()
    ids, attn, mask = _batch(tok)
    rows = torch.tensor([0, 2, 0, 1, 2, 0])
    g = torch.Generator().manual_seed(3)
    ids, attn, mask = ids[rows].clone(), attn[rows].clone(), mask[rows].clone()
    T = mask.shape[1]
    ids[:, -T:] = torch.where(mask.bool(), torch.randint(4, len(tok), (len(rows), T), generator=g), 0)
    with torch.no_grad():
        with capture_routing(model) as padded_cap:
            response_logprobs(model, ids, attn, mask)
        with capture_routing(model) as packed_cap:
            packed_cap.layout = response_logprobs(model, ids, attn, mask,
                                                  packed=pack_rows(attn, mask, 16, rows)).layout
    scored = mask.bool()
    assert torch.equal(response_routing(packed_cap.routing, T)[scored],
                       response_routing(padded_cap.routing, T)[scored])


@pytest.mark.parametrize("max_tokens", [None, 14])   # one packed row | several, with tails
def test_packed_rows_capture_and_replay_line_up_token_by_token(max_tokens):
    """Packed rows under a capture lay out the padded pass's experts at every scored position;
    under replay (routers moved since the capture, so live routing differs) the packed pass,
    replaying the stored [N, L] experts laid out as its packed rows, gives the padded replay's
    log-probs and gradients within 1e-5 in float32; experts captured packed replay in a padded
    pass alike. Multi-turn: an observation hole inside row 0's response."""
    model, tok = _tiny_moe()
    ids, attn, mask = _batch(tok)
    mask = mask.clone()
    mask[0, 1:3] = 0                                   # tool output: attended, not scored
    packed = pack_rows(attn, mask, max_tokens)
    assert (packed.index.shape[0] == 1) == (max_tokens is None)
    with torch.no_grad():
        with capture_routing(model) as padded_cap:
            response_logprobs(model, ids, attn, mask)
        with capture_routing(model) as packed_cap:
            packed_cap.layout = response_logprobs(model, ids, attn, mask, packed=packed).layout
    T, scored = mask.shape[1], mask.bool()
    stored, stored_packed = padded_cap.routing, packed_cap.routing      # [N, L, layers, k]
    assert stored_packed.shape == stored.shape
    assert torch.equal(response_routing(stored_packed, T)[scored], response_routing(stored, T)[scored])
    _perturb_routers(model)

    def replayed(routing, layout):
        model.zero_grad(set_to_none=True)
        forced = routing if layout is None else packed_routing(routing, layout)
        with replay_routing(model, forced) as live:
            out = response_logprobs(model, ids, attn, mask, packed=layout)
        (out.logp.sum() + 0.3 * out.entropy.sum()).backward()
        return out.logp.detach(), [p.grad.clone() for p in model.parameters()], live

    logp, grads, live = replayed(stored, None)
    for routing, layout in ((stored, packed), (stored_packed, packed), (stored_packed, None)):
        p_logp, p_grads, _ = replayed(routing, layout)
        torch.testing.assert_close(p_logp, logp, atol=1e-5, rtol=1e-5)
        for a, b in zip(p_grads, grads):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    changed = response_routing(live.routing, T)[scored] != response_routing(stored, T)[scored]
    assert changed.any()                               # the replay forced experts the router moved off
