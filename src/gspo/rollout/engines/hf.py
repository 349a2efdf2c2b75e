"""The ``hf`` engine: transformers ``generate`` (``rollout.sample``) on the policy itself
(``samples_on``: its weights are the policy's, nothing to update), or on a copy of it in another
``dtype`` (e.g. bfloat16 sampling for a float32 policy) or quantised, updated in place."""

from __future__ import annotations

import copy
from typing import Mapping

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gspo.core.quantize import quantize_weights
from gspo.rollout.engines.base import Capabilities, Engine, register
from gspo.rollout.generate import Samples, SamplingParams, left_pad, sample


@register("hf")
class HFEngine(Engine):
    """transformers ``generate`` (``rollout.sample``) on the policy, or on a copy in ``dtype``.
    It has no seed of its own (each ``generate`` seeds torch's generator with its ``seed``) and no
    sleep mode (the policy's memory is the trainer's): it takes neither option.
    ``share_prompts=False``: every forward sees all N rows (MoE routing captured at generation)."""

    capabilities = Capabilities(trainer_logprobs=True, adapters=True)

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *,
                 dtype: torch.dtype | None = None, share_prompts: bool = True,
                 quantize: str | None = None, sampler: str = "multinomial"):
        self.pad_id, self.eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
        self.sampler = sampler
        """How a token is drawn (gspo.rollout.generate.SAMPLERS)."""
        self.share_prompts = share_prompts
        self.quantize = quantize
        """A format of gspo.core.quantize.FORMATS (int8 | int4 | fp8): the copy's weight matrices
        rounded to it."""
        own = (dtype is not None and dtype != next(model.parameters()).dtype) or quantize is not None
        self.model = copy.deepcopy(model).to(dtype).requires_grad_(False) if own else model
        self.owns_copy = own
        """True when ``model`` is a copy (another dtype, or quantised) that ``update_weights`` refreshes."""
        if quantize is not None:
            self.update_weights(model.state_dict(), None)

    @property
    def module(self) -> PreTrainedModel:
        return self.model

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int | None) -> None:
        if self.quantize is not None:
            weights = quantize_weights(weights, self.quantize)
        self.model.load_state_dict(weights)          # in place (a copy: cast to its dtype)
        self.version = version

    def generate(self, prompt_ids: list[list[int]], group_size: int, params: SamplingParams,
                 seed: int | None = None, with_logprobs: bool = True) -> Samples:
        device = next(self.model.parameters()).device
        ids, mask = left_pad(prompt_ids, self.pad_id, device)                      # [P, Lp]
        return sample(self.model, ids, mask, params, pad_id=self.pad_id, eos_id=self.eos_id,
                      group_size=group_size, with_logprobs=with_logprobs, seed=seed,
                      share_prompts=self.share_prompts, sampler=self.sampler)
