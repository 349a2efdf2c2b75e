"""Rollouts: batched sampling of G responses per prompt with transformers ``generate``.

Produces a ``RolloutBatch`` in the layout every other module uses: prompt tokens left-padded,
response tokens right-padded, ``response_mask`` = 1 for generated tokens up to and including
the first EOS (docs/math.md, The rollout batch). It does not score or train; it only samples.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace

import torch
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from gspo.core.logprobs import position_ids_from_mask
from gspo.core.trajectory import Trajectories
from gspo.tasks import Example
from gspo.tasks.record import EpisodeRecord


@dataclass
class SamplingParams:
    """What the generator was asked for; logged with every run."""
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False

    def generate_kwargs(self) -> dict:
        if self.greedy:
            return dict(do_sample=False, max_new_tokens=self.max_new_tokens,
                        temperature=None, top_p=None, top_k=None)
        return dict(do_sample=True, max_new_tokens=self.max_new_tokens,
                    temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


@dataclass
class RolloutBatch(Trajectories):
    """A ``Trajectories`` batch (gspo.core.trajectory: the tensors) with its per-row text beside
    it: the decoded responses, the prompts' examples, each row's episode record (multi-turn) and,
    once scored, their correctness."""
    completions: list[str]         # N decoded responses (without EOS)
    examples: list[Example]        # N, the prompt's example repeated G times
    records: list[EpisodeRecord] | None = field(default=None, kw_only=True)
    """N episode records (transcript, tool calls, info, the environment's reward) for the
    rewards; None for single-turn rows (each is its completion, ``EpisodeRecord.single``)."""
    correct: torch.Tensor | None = field(default=None, kw_only=True)
    """[N] bool on CPU, task.is_correct once scored (not kept by ``select``)."""

    def rows(self, index: torch.Tensor) -> dict:
        idx = index.tolist()
        records = None if self.records is None else [self.records[i] for i in idx]
        return {**super().rows(index), "completions": [self.completions[i] for i in idx],
                "examples": [self.examples[i] for i in idx], "records": records, "correct": None}


def response_mask_from_ids(response_ids: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask up to and including the first EOS; truncated rows have no EOS.

    >>> response_mask_from_ids(torch.tensor([[5, 2, 0], [5, 6, 7]]), eos_id=2)
    (tensor([[1., 1., 0.], [1., 1., 1.]]), tensor([False,  True]))
    """
    is_eos = response_ids == eos_id                                  # [N, T]
    seen_before = (is_eos.cumsum(-1) - is_eos.long()) > 0            # an EOS strictly earlier
    mask = (~seen_before).float()                                    # [N, T]
    return mask, ~is_eos.any(-1)


def encode_prompts(tokenizer: PreTrainedTokenizerBase, prompts: list[str], device) -> dict:
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    return {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}


def shared_prompt_cache(model: PreTrainedModel, enc: dict, group_size: int) -> dict:
    """The KV cache of every prompt but its last token, computed once per prompt and repeated
    ``group_size`` times: ``generate`` then prefills one token per row instead of the whole prompt
    G times (the sampled tokens are the same). {} where the model's cache cannot be repeated."""
    ids, mask = enc["input_ids"][:, :-1], enc["attention_mask"][:, :-1]            # [P, Lp-1]
    if group_size < 2 or ids.shape[1] == 0:
        return {}
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                use_cache=True, **keep)
    name = "cache" if "cache" in out else "past_key_values"  # transformers 5 renamed it `cache`
    cache = out[name] if name in out else None
    if not hasattr(cache, "batch_repeat_interleave"):
        return {}
    cache.batch_repeat_interleave(group_size)                                      # [P·G, ...]
    return {name: cache}


@dataclass
class Samples:
    """What a generation engine returns for P prompts x G responses (rows grouped by prompt,
    N = P·G): the response part of a ``RolloutBatch`` (gspo.rollout.engines)."""
    response_ids: torch.Tensor          # [N, T] long, pad_id after the first EOS
    response_mask: torch.Tensor         # [N, T] float, 1 up to and including EOS
    truncated: torch.Tensor             # [N] bool, no EOS within max_new_tokens
    logp: torch.Tensor | None = None    # [N, T] sampler log-probs at the temperature, 0 past the mask


def left_pad(prompt_ids: list[list[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id prompts left-padded: (input_ids [P, Lp], attention_mask [P, Lp])."""
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompt_ids), width, dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        if p:
            ids[i, -len(p):], mask[i, -len(p):] = torch.tensor(p), 1
    return ids.to(device), mask.to(device)


class SampledLogProbs(LogitsProcessor):
    """Records, step by step, the log-prob of each row's sampled token at the temperature,
    keeping one step's log-softmax [N, V] instead of ``output_logits``' [N, T, V] (a 151,669-token
    vocabulary: 600 KB per row per token; 128 rows x 40 tokens were 3 GB a turn).

    ``generate`` calls it with the raw scores of step t, after the processors a model's generation
    config may add and before the temperature / top-k / top-p warpers; the token sampled at step t
    is the last of ``input_ids`` at step t + 1 (the last step's token: ``finish``). It changes no
    score."""

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.last: torch.Tensor | None = None          # [N, V] log-softmax of the latest step
        self.taken: list[torch.Tensor] = []            # T-1 x [N] log-probs of the tokens taken

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.last is not None:
            self.taken.append(self.last.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.last = torch.log_softmax(scores.float() / self.temperature, -1)
        return scores

    def finish(self, response_ids: torch.Tensor) -> torch.Tensor:
        """[N, T] log-probs of ``response_ids`` [N, T] (the generated part of the sequences)."""
        taken = self.taken + [self.last.gather(-1, response_ids[:, -1:]).squeeze(-1)]
        self.last, self.taken = None, []
        return torch.stack(taken, dim=1)


def draw_rows(weights: torch.Tensor, block: int = 2048) -> torch.Tensor:
    """[N, 1] one index per row of ``weights`` [N, V] (unnormalised, >= 0, a positive entry per
    row), drawn with probability proportional to its weight from one uniform per row: the block
    whose float64 cumulative sum first exceeds it, then the entry within that block. Two short
    cumulative sums instead of one over V (each a pass over memory at V = 151,669)."""
    n, v = weights.shape
    full = v // block * block
    sums = weights[:, :full].view(n, -1, block).sum(-1)                              # [N, V // block]
    if full < v:
        sums = torch.cat([sums, weights[:, full:].sum(-1, keepdim=True)], dim=1)     # [N, B]
    cdf = sums.double().cumsum(-1)                                                   # [N, B]
    u = torch.rand(n, 1, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]
    b = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[1] - 1)          # [N, 1]
    u = u - torch.where(b > 0, cdf.gather(1, (b - 1).clamp(min=0)), 0.0)             # within block b
    idx = b * block + torch.arange(block, device=weights.device)                     # [N, block]
    inner = (weights.gather(1, idx.clamp(max=v - 1)) * (idx < v)).double().cumsum(-1)
    u = torch.minimum(u, inner[:, -1:] * (1 - 1e-12))          # float32 block sum vs float64 cumsum
    return b * block + torch.searchsorted(inner, u, right=True)


class InverseCDFDraw(LogitsProcessor):
    """Draws each row's next token from softmax(scores / temperature), top-k and top-p applied as
    transformers applies them, with one uniform per row (``draw_rows``), and returns scores that are
    0 at the drawn token and -inf elsewhere, so that ``generate``'s greedy argmax takes it
    (``rollout.sampler=inverse_cdf``). The same distribution as ``torch.multinomial``, another
    random stream; on a CPU multinomial draws an exponential per vocabulary entry: 0.81 s a token
    for 128 rows of Qwen3's 151,669 tokens on a 2-core Xeon, this 0.16 s (benchmarks/hf_sampler.py).
    Must be the last processor."""

    def __init__(self, temperature: float, top_k: int = 0, top_p: float = 1.0):
        self.warpers = LogitsProcessorList(
            [TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k > 0 else [])
            + ([TopPLogitsWarper(top_p)] if top_p < 1.0 else []))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        warped = self.warpers(input_ids, scores)              # [N, V], a new tensor (scores / T)
        token = draw_rows((warped - warped.amax(-1, keepdim=True)).exp_())            # [N, 1]
        return warped.fill_(float("-inf")).scatter_(1, token, 0.0)


SAMPLERS = ("multinomial", "inverse_cdf")
"""rollout.sampler: how the hf engine draws a token (``generate``'s multinomial, or ``InverseCDFDraw``)."""


def draw_kwargs(params: SamplingParams, sampler: str) -> tuple[dict, list[LogitsProcessor]]:
    """``generate``'s sampling arguments for ``params`` and the processors that go last."""
    if sampler == "multinomial" or params.greedy:
        return params.generate_kwargs(), []
    greedy = replace(params, greedy=True).generate_kwargs()
    return greedy, [InverseCDFDraw(params.temperature, params.top_k, params.top_p)]


@torch.no_grad()
def sample(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
           params: SamplingParams, *, pad_id: int, eos_id: int, group_size: int = 1,
           with_logprobs: bool = False, seed: int | None = None, share_prompts: bool = True,
           sampler: str = "multinomial") -> Samples:
    """``group_size`` responses to each left-padded prompt of ``input_ids`` [P, Lp] with
    transformers ``generate`` (rows grouped consecutively), each token drawn by ``sampler``
    (``SAMPLERS``).

    ``share_prompts``: run each prompt through the model once, not G times (``shared_prompt_cache``);
    off when every forward must see all N rows (routing capture at generation)."""
    was_training = model.training
    model.eval()
    enc = {"input_ids": input_ids, "attention_mask": attention_mask}                # [P, Lp]
    cache = shared_prompt_cache(model, enc, group_size) if share_prompts else {}
    enc = {k: v.repeat_interleave(group_size, dim=0) for k, v in enc.items()}    # [N, Lp]
    if seed is not None:
        torch.manual_seed(seed)
    recorder = SampledLogProbs(params.temperature) if with_logprobs else None
    kwargs, draw = draw_kwargs(params, sampler)
    out = model.generate(**enc, **cache, **kwargs, use_cache=True,
                         pad_token_id=pad_id, eos_token_id=eos_id, return_dict_in_generate=True,
                         logits_processor=LogitsProcessorList([recorder] * bool(recorder) + draw),
                         synced_gpus=False)  # FSDP: weights are gathered first (gspo.training.distributed)
    model.train(was_training)
    response_ids = out.sequences[:, input_ids.shape[1]:]                          # [N, T]
    mask, truncated = response_mask_from_ids(response_ids, eos_id)
    response_ids = torch.where(mask.bool(), response_ids, pad_id)
    logp = None
    if with_logprobs:
        logp = recorder.finish(out.sequences[:, input_ids.shape[1]:]) * mask          # [N, T]
    return Samples(response_ids, mask, truncated, logp)


def rollout_batch(tokenizer: PreTrainedTokenizerBase, input_ids: torch.Tensor,
                  attention_mask: torch.Tensor, samples: Samples, examples: list[Example],
                  group_size: int) -> RolloutBatch:
    """The ``RolloutBatch`` of left-padded prompts [P, Lp] and their ``samples`` (N = P·G rows)."""
    prompt_ids = input_ids.repeat_interleave(group_size, dim=0)                     # [N, Lp]
    prompt_mask = attention_mask.repeat_interleave(group_size, dim=0)               # [N, Lp]
    mask = samples.response_mask.to(prompt_ids.device)
    return RolloutBatch(
        input_ids=torch.cat([prompt_ids, samples.response_ids.to(prompt_ids.device)], dim=1),
        attention_mask=torch.cat([prompt_mask, mask.long()], dim=1),
        response_mask=mask, truncated=samples.truncated.to(prompt_ids.device),
        completions=decode(tokenizer, samples.response_ids, mask),
        examples=[ex for ex in examples for _ in range(group_size)],
        rollout_logp=None if samples.logp is None else samples.logp.to(prompt_ids.device),
    )


def generate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, examples: list[Example],
             params: SamplingParams, *, group_size: int = 1, with_logprobs: bool = False,
             seed: int | None = None, share_prompts: bool = True, sampler: str = "multinomial"
             ) -> RolloutBatch:
    """Sample ``group_size`` responses for each example (rows grouped consecutively) with ``sample``."""
    device = next(model.parameters()).device
    enc = encode_prompts(tokenizer, [ex.prompt for ex in examples], device)        # [P, Lp]
    samples = sample(model, enc["input_ids"], enc["attention_mask"], params,
                     pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
                     group_size=group_size, with_logprobs=with_logprobs, seed=seed,
                     share_prompts=share_prompts, sampler=sampler)
    return rollout_batch(tokenizer, enc["input_ids"], enc["attention_mask"], samples, examples,
                         group_size)


def decode(tokenizer: PreTrainedTokenizerBase, response_ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """Response text without EOS and padding."""
    ids = [row[m.bool()].tolist() for row, m in zip(response_ids.cpu(), mask.cpu())]
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def demonstration_batch(tokenizer: PreTrainedTokenizerBase, examples: list[Example], device,
                        max_new_tokens: int | None = None) -> RolloutBatch:
    """Prompt + demonstration answer + EOS in rollout layout (for SFT and tests).

    With ``max_new_tokens`` a longer demonstration is cut like a generation would be: its EOS
    is lost and the row is marked truncated.
    """
    enc = encode_prompts(tokenizer, [ex.prompt for ex in examples], device)
    full = [tokenizer(ex.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            for ex in examples]
    limit = max_new_tokens or max(len(a) for a in full)
    answers = [a[:limit] for a in full]
    width = max(len(a) for a in answers)
    ids = torch.full((len(examples), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(examples), width)
    for i, a in enumerate(answers):
        ids[i, :len(a)] = torch.tensor(a)
        mask[i, :len(a)] = 1.0
    ids, mask = ids.to(device), mask.to(device)
    truncated = torch.tensor([len(a) > limit for a in full], device=device)
    return RolloutBatch(
        input_ids=torch.cat([enc["input_ids"], ids], dim=1),
        attention_mask=torch.cat([enc["attention_mask"], mask.long()], dim=1),
        response_mask=mask, truncated=truncated,
        completions=decode(tokenizer, ids, mask), examples=list(examples),
    )
