"""Chunked response log-probs against the full-logits reference, generate, and unpadded rows."""

import pytest
import torch
import transformers

from gspo.core.logprobs import (naive_response_logprobs, packed_logprobs, packing_honoured,
                                 position_ids_from_mask, response_logprobs)
from gspo.core.packing import pack_rows

V, PAD = 97, 0
PROMPT_LENS = [5, 3, 7]  # left-padded to P = 7
RESPONSE_LENS = [6, 2, 4]  # right-padded to T = 6 (each includes its EOS)


def _tiny_qwen3(seed: int = 0) -> transformers.PreTrainedModel:
    config = transformers.Qwen3Config(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
    )
    torch.manual_seed(seed)
    return transformers.Qwen3ForCausalLM(config).eval()


def _tiny_gpt2(seed: int = 0) -> transformers.PreTrainedModel:
    """Absolute position embeddings: the model where left-padding position ids change the numbers."""
    config = transformers.GPT2Config(
        vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=1, eos_token_id=2
    )
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module")
def model():
    return _tiny_qwen3()


@pytest.fixture(scope="module", params=["qwen3", "gpt2"])
def any_model(request):
    """RoPE (Qwen3) is shift-invariant under left padding; GPT-2's learned positions are not."""
    return _tiny_qwen3() if request.param == "qwen3" else _tiny_gpt2()


def _batch(seed: int = 1):
    """input_ids, attention_mask [N, P+T] and response_mask [N, T] in the rollout layout."""
    g = torch.Generator().manual_seed(seed)
    P, T = max(PROMPT_LENS), max(RESPONSE_LENS)
    ids = torch.full((len(PROMPT_LENS), P + T), PAD)
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS)):
        ids[i, P - p : P + r] = torch.randint(1, V, (p + r,), generator=g)
    attention_mask = (ids != PAD).long()  # [N, L]
    response_mask = attention_mask[:, P:].clone()  # [N, T]
    return ids, attention_mask, response_mask


def _close(a, b, atol=1e-5):
    torch.testing.assert_close(a, b, atol=atol, rtol=1e-5)


@pytest.mark.parametrize("chunk_size", [1, 3, 5, 7, 12, 1024])  # K = 12 tokens: 5 and 7 leave a remainder
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_naive(any_model, chunk_size, temperature):
    model = any_model
    ids, am, rm = _batch()
    with torch.no_grad():
        fast = response_logprobs(model, ids, am, rm, temperature=temperature, chunk_size=chunk_size)
        ref = naive_response_logprobs(model, ids, am, rm, temperature=temperature)
    _close(fast.logp, ref.logp)
    _close(fast.entropy, ref.entropy)
    assert fast.logp.dtype == fast.entropy.dtype == torch.float32
    assert fast.logp.shape == fast.entropy.shape == rm.shape


def test_masked_positions_are_exactly_zero(model):
    ids, am, rm = _batch()
    with torch.no_grad():
        out = response_logprobs(model, ids, am, rm, chunk_size=5)
    off = rm == 0
    assert off.any() and (out.logp[off] == 0).all() and (out.entropy[off] == 0).all()
    assert (out.logp[~off] < 0).all() and (out.entropy[~off] > 0).all()


@torch.no_grad()
def _response_logits(model, ids, am, rm):
    """A plain forward's logits at the positions that predict the response tokens: [N, T, V]."""
    P, T = ids.shape[1] - rm.shape[1], rm.shape[1]
    logits = model(ids, attention_mask=am, position_ids=position_ids_from_mask(am)).logits
    return logits[:, P - 1 : P + T - 1]


def test_temperature_is_applied(model):
    """log π_τ = log_softmax(logits / τ), from a plain forward: τ = 0.5 differs from τ = 1."""
    ids, am, rm = _batch()
    logits = _response_logits(model, ids, am, rm)
    with torch.no_grad():
        hot = response_logprobs(model, ids, am, rm, temperature=0.5, chunk_size=4).logp
        cold = response_logprobs(model, ids, am, rm, temperature=1.0, chunk_size=4).logp
    P = ids.shape[1] - rm.shape[1]
    expected = torch.log_softmax(logits / 0.5, -1).gather(-1, ids[:, P:, None])[..., 0]
    _close(hot, expected * rm)
    assert not torch.allclose(hot, cold)


def test_entropy_is_minus_sum_p_log_p(model):
    """H = lse(z) − Σ softmax(z)·z equals −Σ p log p of π_τ (computed here in float64)."""
    ids, am, rm = _batch()
    logits = _response_logits(model, ids, am, rm)
    with torch.no_grad():
        got = response_logprobs(model, ids, am, rm, temperature=0.6, chunk_size=5).entropy
    logp = torch.log_softmax(logits.double() / 0.6, -1)  # [N, T, V]
    expected = -(logp.exp() * logp).sum(-1) * rm  # [N, T]
    _close(got, expected.float())


def test_without_entropy(model):
    ids, am, rm = _batch()
    with torch.no_grad():
        out = response_logprobs(model, ids, am, rm, with_entropy=False, chunk_size=5)
        ref = naive_response_logprobs(model, ids, am, rm, with_entropy=False)
    assert out.entropy is None and ref.entropy is None
    _close(out.logp, ref.logp)


def test_empty_response_mask(model):
    ids, am, rm = _batch()
    out = response_logprobs(model, ids, am, torch.zeros_like(rm))
    assert (out.logp == 0).all() and (out.entropy == 0).all()


def _param_grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("chunk_size", [1, 5, 1024])
def test_gradients_equal_naive(model, chunk_size):
    """d/dθ [Σ w·logp + Σ u·H] through checkpointed chunks equals the full-logits gradient."""
    ids, am, rm = _batch()
    g = torch.Generator().manual_seed(2)
    w, u = torch.randn(rm.shape, generator=g), torch.randn(rm.shape, generator=g)  # [N, T]

    def loss(fn, **kw):
        out = fn(model, ids, am, rm, temperature=0.8, entropy_grad=True, **kw)
        return (out.logp * w).sum() + (out.entropy * u).sum()

    fast = _param_grads(model, loss(response_logprobs, chunk_size=chunk_size))
    ref = _param_grads(model, loss(naive_response_logprobs))
    assert fast.keys() == ref.keys() and "lm_head.weight" in fast
    for name in ref:
        _close(fast[name], ref[name], atol=1e-5)


def test_entropy_detached_by_default(model):
    ids, am, rm = _batch()
    out = response_logprobs(model, ids, am, rm, chunk_size=5)
    assert out.logp.requires_grad and not out.entropy.requires_grad
    out = response_logprobs(model, ids, am, rm, chunk_size=5, entropy_grad=True)
    assert out.entropy.requires_grad


def test_matches_generate_with_left_padding(any_model):
    """Greedy generate's raw logits for the tokens it produced: position ids follow the left padding."""
    model = any_model
    ids, am, _ = _batch()
    P, T = max(PROMPT_LENS), 5
    with torch.no_grad():
        gen = model.generate(
            input_ids=ids[:, :P], attention_mask=am[:, :P], max_new_tokens=T, do_sample=False,
            output_logits=True, return_dict_in_generate=True, pad_token_id=PAD, eos_token_id=None,
        )
        seq = gen.sequences  # [N, P+T]
        expected = torch.log_softmax(torch.stack(gen.logits, 1).float() / 0.9, -1)  # [N, T, V]
        expected = expected.gather(-1, seq[:, P:, None])[..., 0]  # [N, T]
        rm = torch.ones(len(PROMPT_LENS), T, dtype=torch.long)
        rm[1, 3:] = 0  # pretend row 1 stopped early: trailing tokens masked out
        full_am = torch.cat([am[:, :P], rm], 1)  # [N, P+T]
        got = response_logprobs(model, seq, full_am, rm, temperature=0.9, chunk_size=4).logp
    _close(got, expected * rm, atol=1e-5)


def test_matches_unpadded_single_rows(any_model):
    """Each row alone, without any padding (position ids 0..len-1), gives the same log-probs."""
    model = any_model
    ids, am, rm = _batch()
    P = ids.shape[1] - rm.shape[1]
    with torch.no_grad():
        batched = response_logprobs(model, ids, am, rm, chunk_size=3)
        for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS)):
            row = ids[i : i + 1, P - p : P + r]  # [1, p+r]
            out = response_logprobs(model, row, torch.ones_like(row), torch.ones(1, r, dtype=torch.long))
            _close(batched.logp[i, :r], out.logp[0])
            _close(batched.entropy[i, :r], out.entropy[0])


def _tiny(config_cls, model_cls, **extra):
    config = config_cls(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, **extra,
    )
    torch.manual_seed(0)
    return model_cls(config).eval()


@pytest.mark.parametrize(
    "build",
    [
        lambda: _tiny(transformers.Gemma2Config, transformers.Gemma2ForCausalLM, final_logit_softcapping=0.5),
        lambda: _tiny(transformers.CohereConfig, transformers.CohereForCausalLM, logit_scale=3.0),
    ],
    ids=["gemma2-softcap", "cohere-logit-scale"],
)
def test_head_transforms(build):
    model = build()
    ids, am, rm = _batch()
    with torch.no_grad():
        fast = response_logprobs(model, ids, am, rm, temperature=0.7, chunk_size=5)
        ref = naive_response_logprobs(model, ids, am, rm, temperature=0.7)
    _close(fast.logp, ref.logp)
    _close(fast.entropy, ref.entropy)


def test_rejects_bad_layout(model):
    ids, am, rm = _batch()
    with pytest.raises(ValueError):
        response_logprobs(model, ids[:, :4], am[:, :4], rm)


def _saved_shapes(fn):
    """Shapes of every tensor autograd saves for backward while `fn` runs (outside checkpoints)."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return shapes


def test_no_vocab_sized_activation_kept_for_backward(model):
    """With grad on, chunk logits are recomputed in backward: nothing [.., V] is saved, unlike naive."""
    ids, am, rm = _batch()
    fast = _saved_shapes(lambda: response_logprobs(model, ids, am, rm, chunk_size=5, entropy_grad=True))
    ref = _saved_shapes(lambda: naive_response_logprobs(model, ids, am, rm, entropy_grad=True))
    assert not [s for s in fast if s and s[-1] == V]
    assert [s for s in ref if s and s[-1] == V]


def test_shared_prompts_equal_the_full_forward(any_model):
    """Rows of one group share their prompt columns: running each prompt once (its KV cache
    gathered to the group's rows) gives the full forward's log-probs, entropies and gradients."""
    ids, am, rm = _batch()
    g = torch.Generator().manual_seed(5)
    rows = torch.tensor([0, 2, 0, 1, 2, 0])                           # groups 0, 2, 0, 1, 2, 0
    ids, am = ids[rows].clone(), am[rows]
    T = rm.shape[1]
    ids[:, -T:] = torch.where(rm[rows].bool(), torch.randint(1, V, (len(rows), T), generator=g), PAD)
    rm = rm[rows]
    results = []
    for groups in (None, rows):
        any_model.zero_grad(set_to_none=True)
        out = response_logprobs(any_model, ids, am, rm, chunk_size=5, prompt_groups=groups)
        out.logp.sum().backward()
        grads = [p.grad.clone() for p in any_model.parameters() if p.grad is not None]
        results.append((out.logp.detach(), out.entropy, grads))
    (logp, ent, grads), (shared_logp, shared_ent, shared_grads) = results
    _close(shared_logp, logp)
    _close(shared_ent, ent)
    assert len(grads) == len(shared_grads)
    for a, b in zip(shared_grads, grads):
        _close(a, b, atol=1e-4)


def _padded_batch():
    """`_batch` with 2 more left-padding columns and 3 more response columns, padding in every row."""
    ids, am, rm = _batch()
    N, T = rm.shape
    pad = lambda x, left, right: torch.cat([x.new_zeros(N, left), x, x.new_zeros(N, right)], 1)  # noqa: E731
    return pad(ids, 2, 3), pad(am, 2, 3), pad(rm, 0, 3)


@pytest.mark.parametrize("shared", [False, True])
def test_trimmed_columns_equal_the_full_forward(any_model, shared):
    """trim=True runs the decoder on the columns the response depends on only (no all-padding
    column, not the last): the same log-probs, entropies and gradients as the untrimmed path,
    in float64, with and without prompts shared by group."""
    model = any_model.double()
    ids, am, rm = _padded_batch()
    rows = torch.tensor([0, 2, 0, 1, 2, 0])                           # groups, as above
    g = torch.Generator().manual_seed(6)
    ids, am, rm = ids[rows].clone(), am[rows], rm[rows]
    T = rm.shape[1]
    ids[:, -T:] = torch.where(rm.bool(), torch.randint(1, V, (len(rows), T), generator=g), PAD)
    results = []
    for trim in (False, True):
        model.zero_grad(set_to_none=True)
        out = response_logprobs(model, ids, am, rm, chunk_size=5, trim=trim,
                                prompt_groups=rows if shared else None)
        (out.logp.sum() + 0.3 * out.entropy.sum()).backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results.append((out.logp.detach(), out.entropy, grads))
    model.float()
    (logp, ent, grads), (trim_logp, trim_ent, trim_grads) = results
    assert trim_logp.shape == logp.shape == rm.shape
    torch.testing.assert_close(trim_logp, logp, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(trim_ent, ent, atol=1e-12, rtol=1e-10)
    assert len(grads) == len(trim_grads)
    for a, b in zip(trim_grads, grads):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_trim_columns_reach():
    """The trimmed span: from the first column any row attends to, up to the last response token
    of any row, less that token's column."""
    from gspo.core.logprobs import trim_columns
    ids, am, rm = _padded_batch()                 # 2 + 7 prompt columns, 6 + 3 response columns
    assert trim_columns(am, rm) == (2, 9 + 6 - 1, 6)
    assert trim_columns(am, torch.zeros_like(rm))[2] == 0


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_row_equals_padded_rows(attn):
    """One packed row (positions restarting per sequence, no attention mask) gives each response
    token the log-prob, and the gradient, of the padded rows, within float32 rounding."""
    model = _tiny_qwen3()
    model.config._attn_implementation = attn
    ids, attention_mask, response_mask = _batch()
    P, T = max(PROMPT_LENS), max(RESPONSE_LENS)
    padded = response_logprobs(model, ids, attention_mask, response_mask, chunk_size=4).logp  # [N, T]
    rows = [ids[i, P - p : P + r] for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS))]
    packed_ids = torch.cat(rows)[None]  # [1, S]
    positions = torch.cat([torch.arange(len(r)) for r in rows])[None]  # [1, S]
    target = torch.cat([torch.arange(len(r)) >= p for r, p in zip(rows, PROMPT_LENS)])[None].long()
    model.zero_grad()
    logp = packed_logprobs(model, packed_ids, positions, target, chunk_size=4)  # [1, S]
    logp.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    _close(logp[target.bool()], padded[response_mask.bool()])
    assert (logp[~target.bool()] == 0).all()
    model.zero_grad()
    response_logprobs(model, ids, attention_mask, response_mask, chunk_size=4).logp.sum().backward()
    for got, want in zip(grads, (p.grad for p in model.parameters())):
        _close(got, want, atol=1e-5)


def _multiturn_batch():
    """`_padded_batch` with observation holes: response tokens 2..3 of rows 0 and 2 are tool
    output (attended, loss mask 0), and row 1's last two attended tokens come after its last
    policy token (an observation that ends the episode)."""
    ids, am, rm = _padded_batch()
    L, T = am.shape[1], rm.shape[1]
    rm = rm.clone()
    rm[0, 2:4] = 0
    rm[2, 2:3] = 0
    am = am.clone()
    am[1, L - T + 2 : L - T + 4] = 1                        # row 1: 2 response tokens, then 2 more
    ids = ids.clone()
    ids[1, L - T + 2 : L - T + 4] = torch.tensor([11, 12])
    return ids, am, rm


def _packed_equals_padded(model, ids, am, rm, packed):
    """The log-probs, entropies and gradients of ``packed`` rows equal the padded rows' (1e-5,
    float32); the packed log-probs [N, T]."""
    results = []
    for layout in (None, packed):
        model.zero_grad(set_to_none=True)
        out = response_logprobs(model, ids, am, rm, chunk_size=5, packed=layout)
        (out.logp.sum() + 0.3 * out.entropy.sum()).backward()
        results.append((out.logp.detach(), out.entropy, [p.grad.clone() for p in model.parameters()]))
    (logp, ent, grads), (p_logp, p_ent, p_grads) = results
    _close(p_logp, logp)
    _close(p_ent, ent)
    for a, b in zip(p_grads, grads):
        _close(a, b, atol=1e-5)
    return p_logp


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("max_tokens", [None, 6])        # one packed row | two (of 2 to 4 rows, two computes fewest)
@pytest.mark.parametrize("holes", [False, True])
def test_packed_rows_equal_padded_rows(attn, max_tokens, holes):
    """`response_logprobs(packed=pack_rows(...))`: the log-probs, entropies and gradients of the
    padded rows within 1e-5 in float32, for one packed row and for two (of 10 + 4 and 10 tokens:
    a padding tail),
    and for multi-turn rows whose loss mask has holes (every attended token up to the last
    response token is fed, the tool output inside included)."""
    model = _tiny_qwen3()
    model.config._attn_implementation = attn
    ids, am, rm = _multiturn_batch() if holes else _padded_batch()
    packed = pack_rows(am, rm, max_tokens)
    p_logp = _packed_equals_padded(model, ids, am, rm, packed)
    assert (p_logp[rm == 0] == 0).all()
    # rows' tokens: prompt + response up to the last response token, less that token
    reach = (rm * torch.arange(1, rm.shape[1] + 1)).amax(-1)
    assert packed.real == int((am[:, : am.shape[1] - rm.shape[1]].sum(-1) + reach - 1).sum())
    assert packed.index.shape[0] == (1 if max_tokens is None else 2)     # 2 x 14 < 3 x 10


def test_packed_layout_counts_what_each_forward_computed():
    """`DecoderLayout.tokens` / `needed`: padded rows compute rows × columns (trimmed: the span
    some row needs), packed rows their own tokens and a padding tail; both need the same."""
    model = _tiny_qwen3()
    ids, am, rm = _padded_batch()                           # 3 rows, 9 + 9 columns
    with torch.no_grad():
        full = response_logprobs(model, ids, am, rm).layout
        trim = response_logprobs(model, ids, am, rm, trim=True).layout
        packed = response_logprobs(model, ids, am, rm, packed=pack_rows(am, rm)).layout
    # rows: prompts 5, 3, 7 and responses 6, 2, 4 -> 10 + 4 + 10 = 24 tokens needed
    assert int(full.needed) == int(trim.needed) == packed.needed == 24
    assert full.tokens == 3 * 18
    assert trim.tokens == 3 * (7 + 6 - 1)                   # longest prompt + response, less one
    assert packed.tokens == 24


def test_packing_honoured_by_the_presets_not_by_a_decoder_that_drops_positions():
    """The tiny presets (Qwen3, Qwen3-MoE) read restarting positions as packed sequences under
    sdpa and eager; a decoder that ignores `position_ids` attends across sequences: refused."""
    from gspo.models.presets import build_model
    for preset in ("tiny-dense", "tiny-moe"):
        model, _ = build_model(preset, 0)
        for attn in ("sdpa", "eager"):
            model.config._attn_implementation = attn
            assert packing_honoured(model) and packing_honoured(model, several_rows=False)
    model = _tiny_qwen3()
    forward = model.model.forward
    model.model.forward = lambda position_ids=None, **kw: forward(**kw)  # noqa: E731
    assert not packing_honoured(model)


def test_pack_rows_refuses_a_response_after_an_unattended_column():
    ids, am, rm = _padded_batch()
    am = am.clone()
    am[0, am.shape[1] - rm.shape[1]] = 0                    # row 0's first response column
    with pytest.raises(ValueError, match="does not attend"):
        pack_rows(am, rm)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("max_tokens", [None, 16, 8])    # 8: each group in parts of one row
@pytest.mark.parametrize("holes", [False, True])
def test_packed_groups_share_their_prompt_and_equal_padded_rows(attn, max_tokens, holes):
    """`pack_rows(groups=...)`: a group's prompt packed once (once per part of a group longer
    than a packed row), its rows' responses after it, each attending to the prompt and itself (a
    4D mask): the padded rows' log-probs, entropies and gradients within 1e-5, with fewer tokens
    than packing every row's prompt."""
    model = _tiny_qwen3()
    model.config._attn_implementation = attn
    ids, am, rm = _multiturn_batch() if holes else _padded_batch()
    rows = torch.tensor([0, 2, 0, 1, 2, 0])                           # groups share prompts
    g = torch.Generator().manual_seed(6)
    ids, am, rm = ids[rows].clone(), am[rows], rm[rows]
    T = rm.shape[1]
    ids[:, -T:] = torch.where(am[:, -T:].bool(), torch.randint(1, V, (len(rows), T), generator=g), PAD)
    packed = pack_rows(am, rm, max_tokens, groups=rows)
    _packed_equals_padded(model, ids, am, rm, packed)
    if max_tokens == 8:   # every part a single row: as many tokens as packing each row alone
        assert packed.real == pack_rows(am, rm).real
    else:
        assert packed.real < pack_rows(am, rm).real
    assert packed.attention is not None and pack_rows(am, rm).attention is None
