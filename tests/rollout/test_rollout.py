"""Rollout layout: the response mask, generate() on the tiny preset, demonstrations, select()."""

import pytest
import torch

from gspo.core.logprobs import response_logprobs
from gspo.models.presets import build_model
from gspo.rollout.generate import (
    InverseCDFDraw,
    draw_rows,
    RolloutBatch,
    SamplingParams,
    demonstration_batch,
    generate,
    response_mask_from_ids,
)

EOS = 2

# ------------------------------------------------------------------------------- response mask


def test_response_mask_hand_cases():
    ids = torch.tensor([
        [EOS, 7, 8, 9],     # EOS first: |y| = 1 (the EOS itself counts)
        [5, 6, EOS, 9],     # EOS mid: 1 up to and including it, |y| = 3
        [5, 6, 7, 8],       # no EOS: truncated, |y| = T = 4
        [5, EOS, 6, EOS],   # several EOS: only the first one ends the response, |y| = 2
        [5, 6, 7, EOS],     # EOS on the last column: complete, not truncated
    ])
    mask, truncated = response_mask_from_ids(ids, EOS)
    assert mask.dtype == torch.float32
    assert mask.tolist() == [
        [1, 0, 0, 0],
        [1, 1, 1, 0],
        [1, 1, 1, 1],
        [1, 1, 0, 0],
        [1, 1, 1, 1],
    ]
    assert truncated.tolist() == [False, False, True, False, False]


def test_response_mask_pad_equal_to_eos():
    # Models that pad with EOS: trailing EOS padding after the first EOS stays masked out.
    mask, truncated = response_mask_from_ids(torch.tensor([[4, EOS, EOS, EOS]]), EOS)
    assert mask.tolist() == [[1, 1, 0, 0]] and truncated.tolist() == [False]


# ------------------------------------------------------------------------------- generate

@pytest.fixture(scope="module")
def eos_model():
    """tiny-dense with an output bias: EOS is likely (~27% at τ=0.7: e^(2.5/0.7) / (e^(2.5/0.7) + 96)),
    pad/bos/unk are never sampled, so responses end early, mid-way, or get truncated."""
    model, tok = build_model("tiny-dense", 0)
    bias = torch.zeros(len(tok))
    bias[tok.eos_token_id] = 2.5
    bias[[tok.pad_token_id, tok.bos_token_id, tok.unk_token_id]] = -1e4
    model.lm_head.bias = torch.nn.Parameter(bias)
    return model.eval(), tok


@pytest.fixture(scope="module")
def prompts(arith):
    """Three prompts, the first shorter than the others (e.g. '70+1=', '55-40='): padding varies."""
    train = arith.split("train")
    short = min(train, key=lambda ex: len(ex.prompt))
    longer = [ex for ex in train if len(ex.prompt) > len(short.prompt)][:2]
    return [short, *longer]


G, MAX_NEW = 4, 5


@pytest.fixture(scope="module")
def batch(eos_model, prompts):
    model, tok = eos_model
    return generate(model, tok, prompts, SamplingParams(MAX_NEW, temperature=0.7), group_size=G,
                    with_logprobs=True, seed=1)


def test_generate_shapes_and_groups(batch, prompts):
    N = len(prompts) * G
    T = batch.response_mask.shape[1]
    assert T == MAX_NEW  # some row is truncated, so generation ran to the limit
    assert batch.input_ids.shape == batch.attention_mask.shape
    assert batch.input_ids.shape[0] == N and batch.response_ids.shape == (N, T)
    assert batch.truncated.shape == (N,) and len(batch.completions) == N
    assert batch.rollout_logp.shape == (N, T)
    # rows of a group are consecutive: prompt i occupies rows i*G .. i*G+G-1
    assert batch.examples == [ex for ex in prompts for _ in range(G)]


def test_generate_prompts_left_padded(batch, eos_model):
    _, tok = eos_model
    T = batch.response_mask.shape[1]
    Lp = batch.input_ids.shape[1] - T
    lengths = set()
    for row, am, ex in zip(batch.input_ids, batch.attention_mask, batch.examples):
        ids = tok(ex.prompt)["input_ids"]                   # <bos> + one id per character
        assert ids[0] == tok.bos_token_id and len(ids) == len(ex.prompt) + 1
        pad = Lp - len(ids)
        lengths.add(len(ids))
        assert row[:Lp].tolist() == [tok.pad_token_id] * pad + ids
        assert am[:Lp].tolist() == [0] * pad + [1] * len(ids)
    assert len(lengths) > 1, "prompts of different lengths, so padding is exercised"


def test_generate_eos_mask_and_padding(batch, eos_model):
    _, tok = eos_model
    ids, mask = batch.response_ids, batch.response_mask
    T = mask.shape[1]
    kinds = set()
    for i in range(len(ids)):
        row = ids[i].tolist()
        if tok.eos_token_id in row:
            end = row.index(tok.eos_token_id) + 1           # |y_i| includes the EOS
            kinds.add("eos first" if end == 1 else "eos mid")
            assert not batch.truncated[i]
            assert row[end:] == [tok.pad_token_id] * (T - end)   # after the first EOS: pad
            assert batch.completions[i] == tok.decode(row[:end - 1])
        else:
            end = T
            kinds.add("truncated")
            assert batch.truncated[i]
            assert batch.completions[i] == tok.decode(row)
        assert mask[i].tolist() == [1.0] * end + [0.0] * (T - end)
        assert batch.attention_mask[i, -T:].tolist() == [1] * end + [0] * (T - end)
        assert len(batch.completions[i]) == end - (0 if batch.truncated[i] else 1)  # chars
    assert kinds == {"eos first", "eos mid", "truncated"}, "seed must cover every case"
    assert batch.lengths.tolist() == mask.sum(-1).tolist()


def test_generate_same_seed_same_samples(eos_model, prompts, batch):
    model, tok = eos_model
    again = generate(model, tok, prompts, SamplingParams(MAX_NEW, temperature=0.7), group_size=G,
                     with_logprobs=True, seed=1)
    assert torch.equal(again.input_ids, batch.input_ids)
    assert again.completions == batch.completions
    other = generate(model, tok, prompts, SamplingParams(MAX_NEW, temperature=0.7), group_size=G,
                     seed=2)
    assert other.completions != batch.completions


def test_generator_logprobs_match_recomputed(batch, eos_model):
    """log π at τ=0.7 from generate's own logits equals the trainer's recomputation."""
    model, _ = eos_model
    with torch.no_grad():
        ref = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_mask,
                                temperature=0.7, with_entropy=False).logp
    assert torch.allclose(batch.rollout_logp, ref, atol=1e-4, rtol=0)
    assert (batch.rollout_logp[batch.response_mask == 0] == 0).all()
    assert (batch.rollout_logp[batch.response_mask == 1] < 0).all()
    # and the temperature matters: at τ=1 the numbers differ
    with torch.no_grad():
        tau1 = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_mask,
                                 temperature=1.0, with_entropy=False).logp
    assert not torch.allclose(batch.rollout_logp, tau1, atol=1e-2)


def test_step_by_step_logprobs_equal_generates_stacked_logits(eos_model, prompts):
    """SampledLogProbs keeps one step's log-softmax, not every step's logits: the log-probs it
    records equal those of generate's own output_logits (the [N, T, V] reference), also under
    top-k, where they stay the temperature's full distribution, not the truncated one."""
    model, tok = eos_model
    params = SamplingParams(MAX_NEW, temperature=0.7, top_k=5)
    batch = generate(model, tok, prompts, params, group_size=G, with_logprobs=True, seed=3)
    enc = tok([ex.prompt for ex in prompts], return_tensors="pt", padding=True, padding_side="left")
    torch.manual_seed(3)
    out = model.generate(**{k: v.repeat_interleave(G, 0) for k, v in enc.items() if k != "token_type_ids"},
                         **params.generate_kwargs(), pad_token_id=tok.pad_token_id,
                         eos_token_id=EOS, return_dict_in_generate=True, output_logits=True)
    ids = out.sequences[:, enc["input_ids"].shape[1]:]                                   # [N, T]
    assert torch.equal(torch.where(batch.response_mask.bool(), ids, tok.pad_token_id),
                       batch.input_ids[:, enc["input_ids"].shape[1]:])
    logits = torch.stack(out.logits, 1).float() / 0.7                                    # [N, T, V]
    ref = torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1) * batch.response_mask
    torch.testing.assert_close(batch.rollout_logp, ref, atol=1e-6, rtol=0)
    cut = logits.masked_fill(logits < logits.topk(5, -1).values[..., -1:], float("-inf"))
    top5 = torch.log_softmax(cut, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    policy = batch.response_mask == 1
    assert (batch.rollout_logp[policy] - top5[policy]).abs().min() > 1e-2


def test_inverse_cdf_draws_from_the_warped_softmax():
    """rollout.sampler=inverse_cdf: 40,000 draws from softmax([0, 1, 2, 3] / 0.5) land within 4
    standard errors of each probability; top-k=2 never draws outside the two largest; top-p=0.5
    keeps the smallest set reaching 0.5 (here the largest alone); the scores returned select the
    draw under argmax."""
    torch.manual_seed(0)
    n, logits = 40_000, torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    scores = InverseCDFDraw(0.5)(torch.zeros(n, 1, dtype=torch.long), logits.expand(n, 4))   # [n, 4]
    assert ((scores == 0).sum(-1) == 1).all() and (scores != 0).eq(scores == float("-inf")).all()
    freq = torch.bincount(scores.argmax(-1), minlength=4).double() / n
    p = torch.softmax(logits[0].double() / 0.5, -1)          # 0.0021, 0.0158, 0.1171, 0.8650
    assert ((freq - p).abs() <= 4 * (p * (1 - p) / n).sqrt()).all(), (freq, p)
    top2 = InverseCDFDraw(1.0, top_k=2)(torch.zeros(n, 1, dtype=torch.long), logits.expand(n, 4))
    assert set(top2.argmax(-1).tolist()) == {2, 3}
    top_p = InverseCDFDraw(0.5, top_p=0.5)(torch.zeros(n, 1, dtype=torch.long), logits.expand(n, 4))
    assert set(top_p.argmax(-1).tolist()) == {3}


def test_draw_rows_across_blocks_and_a_short_tail():
    """draw_rows with blocks of 3 over 10 entries (a tail block of 1): 60,000 draws land within 4
    standard errors of weight / total, and entries of weight 0 (a whole block of them too) are
    never drawn."""
    torch.manual_seed(0)
    w = torch.tensor([0.5, 0.0, 1.0, 0.0, 0.0, 0.0, 2.0, 0.25, 0.0, 3.0])
    n = 60_000
    freq = torch.bincount(draw_rows(w.expand(n, 10), block=3).squeeze(1), minlength=10).double() / n
    p = w.double() / w.sum()
    assert (freq[p == 0] == 0).all()
    assert ((freq - p).abs() <= 4 * (p * (1 - p) / n).sqrt()).all(), (freq, p)


def test_inverse_cdf_sampler_in_generate(eos_model, prompts):
    """The hf engine with rollout.sampler=inverse_cdf: the same seed draws the same responses, the
    sampler's log-probs equal the trainer's recomputation at the temperature, and the draws are
    not greedy's."""
    model, tok = eos_model
    params = SamplingParams(MAX_NEW, temperature=0.7)
    run = lambda seed: generate(model, tok, prompts, params, group_size=G, with_logprobs=True,
                                seed=seed, sampler="inverse_cdf")
    batch, again = run(1), run(1)
    assert torch.equal(batch.input_ids, again.input_ids)
    assert run(2).completions != batch.completions
    with torch.no_grad():
        ref = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_mask,
                                temperature=0.7, with_entropy=False).logp
    torch.testing.assert_close(batch.rollout_logp, ref, atol=1e-4, rtol=0)
    greedy = generate(model, tok, prompts, SamplingParams(MAX_NEW, greedy=True), group_size=G,
                      sampler="inverse_cdf")
    assert len(set(batch.completions)) > len(set(greedy.completions))


def test_greedy_is_deterministic_and_restores_train_mode(eos_model, prompts):
    model, tok = eos_model
    model.train()
    try:
        a = generate(model, tok, prompts, SamplingParams(MAX_NEW, greedy=True), seed=0)
        assert model.training
    finally:
        model.eval()
    b = generate(model, tok, prompts, SamplingParams(MAX_NEW, greedy=True), seed=123)
    assert torch.equal(a.input_ids, b.input_ids) and a.rollout_logp is None


# ------------------------------------------------------------------------------- demonstrations

def test_demonstration_batch_layout(tiny, arith):
    _, tok = tiny
    examples = arith.split("train")[:4]
    b = demonstration_batch(tok, examples, "cpu")
    width = max(len(ex.answer) for ex in examples) + 1       # answer characters + EOS
    assert b.response_mask.shape == (4, width)
    Lp = b.input_ids.shape[1] - width
    for i, ex in enumerate(examples):
        answer = [tok.convert_tokens_to_ids(c) for c in ex.answer] + [tok.eos_token_id]
        n = len(answer)
        assert b.response_ids[i].tolist() == answer + [tok.pad_token_id] * (width - n)
        assert b.response_mask[i].tolist() == [1.0] * n + [0.0] * (width - n)
        prompt = tok(ex.prompt)["input_ids"]
        assert b.input_ids[i, :Lp].tolist() == [tok.pad_token_id] * (Lp - len(prompt)) + prompt
        assert b.attention_mask[i].tolist() == ([0] * (Lp - len(prompt)) + [1] * len(prompt)
                                                + [1] * n + [0] * (width - n))
    assert b.completions == [ex.answer for ex in examples]
    assert not b.truncated.any()
    assert len({len(ex.answer) for ex in examples}) > 1, "answers of different lengths"


def test_demonstration_batch_cut_is_truncated(tiny, arith):
    _, tok = tiny
    ex = next(e for e in arith.split("train") if len(e.answer) >= 2)
    b = demonstration_batch(tok, [ex], "cpu", max_new_tokens=2)
    assert b.response_mask.tolist() == [[1.0, 1.0]]
    assert b.truncated.tolist() == [True]


# ------------------------------------------------------------------------------- select

def test_select_rows(batch):
    tag = torch.arange(len(batch.completions))
    b = RolloutBatch(**{**batch.__dict__, "dropped": tag % 2 == 0, "loss_mask": tag[:, None] * 1.0,
                        "version": 3})
    idx = torch.tensor([5, 0, 7])
    s = b.select(idx)
    assert torch.equal(s.input_ids, b.input_ids[idx])
    assert torch.equal(s.attention_mask, b.attention_mask[idx])
    assert torch.equal(s.response_mask, b.response_mask[idx])
    assert torch.equal(s.truncated, b.truncated[idx])
    assert torch.equal(s.rollout_logp, b.rollout_logp[idx])
    assert s.completions == [b.completions[i] for i in (5, 0, 7)]
    assert s.examples == [b.examples[i] for i in (5, 0, 7)]
    assert s.dropped.tolist() == [False, True, False] and s.loss_mask[:, 0].tolist() == [5, 0, 7]
    assert s.version == 3 and s.routing is None and s.behaviour_logp is None
    empty = b.select(torch.tensor([], dtype=torch.long))
    assert empty.input_ids.shape[0] == 0 and empty.completions == []


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_shared_prompt_prefill_samples_the_same_tokens(preset, prompts):
    """Each prompt run once and its cache repeated G times: the same batch as G prefills."""
    model, tok = build_model(preset, 0)
    params = SamplingParams(max_new_tokens=10)
    shared = generate(model, tok, prompts, params, group_size=4, seed=3, with_logprobs=True)
    plain = generate(model, tok, prompts, params, group_size=4, seed=3, with_logprobs=True,
                     share_prompts=False)
    assert len({len(ex.prompt) for ex in prompts}) > 1          # left padding is exercised
    assert torch.equal(shared.input_ids, plain.input_ids)
    assert torch.equal(shared.attention_mask, plain.attention_mask)
    torch.testing.assert_close(shared.rollout_logp, plain.rollout_logp, rtol=0, atol=1e-5)
