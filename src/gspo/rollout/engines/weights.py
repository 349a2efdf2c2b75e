"""Weights as an engine receives them: the policy's tensors in the checkpoint's layout
(``policy_weights``), and laid end to end in byte buckets for a transfer to another process
(``buckets`` / ``pack`` / ``unpack``: the Ray generators' gloo broadcasts; any out-of-process
engine can ship the same way). Plain tensors in, plain tensors out: no engine, no transport."""

from __future__ import annotations

import dataclasses
from typing import Iterator, Mapping

import torch
from transformers import PreTrainedModel

try:  # transformers 5 keeps some weights in fused in-memory layouts (a MoE's experts)
    from transformers.core_model_loading import revert_weight_conversion
except ImportError:  # transformers 4: the in-memory layout is the checkpoint's
    def revert_weight_conversion(model, state_dict):
        return state_dict

BUCKET_BYTES = 64 << 20
"""Most bytes one broadcast carries: per-tensor overhead, not bandwidth, is what a sync of many
small tensors costs (docs/results/performance/weight-sync.md)."""
ALIGN = 64
"""Each tensor's bytes start at a multiple of this in its bucket (a dtype view needs it)."""


def policy_weights(model: PreTrainedModel, weights: Mapping[str, torch.Tensor] | None = None
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight of ``weights`` (a ``state_dict`` of ``model``'s
    architecture; None: ``model``'s own) as a checkpoint stores it (transformers' in-memory
    layouts reverted, e.g. a MoE's fused experts back to one tensor per expert, as
    ``save_pretrained`` writes them), ``lm_head.weight`` included even when the embeddings are
    tied (an engine that unties them would otherwise keep a stale head).

    One weight at a time: ``weights[name]`` is read only when its turn comes, so a mapping that
    gathers each tensor as it is read (FSDP's shards, ``gspo.training.distributed``) never holds
    a second whole model. Each in-memory tensor is reverted on its own (a fused tensor splits
    into checkpoint tensors; none is merged from several)."""
    weights = model.state_dict() if weights is None else weights
    names = list(weights.keys())
    head = model.get_output_embeddings()
    tied = None
    if "lm_head.weight" not in names and head is not None:
        shares = [n for n, p in model.named_parameters(remove_duplicate=False) if p is head.weight]
        tied = next((n for n in shares if n in weights), None)
    for name in names:
        for out, tensor in revert_weight_conversion(model, {name: weights[name]}).items():
            yield out, tensor.detach()
            if name == tied:
                yield "lm_head.weight", tensor.detach()
    if tied is None and "lm_head.weight" not in names and head is not None:
        yield "lm_head.weight", head.weight.detach()


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of the weights, as both sides lay it out."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int                 # in its bucket, bytes
    nbytes: int


def aliases(weights: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """name -> the earlier name of the same tensor (tied embeddings: ``lm_head.weight`` is
    ``model.embed_tokens.weight``): sent once, set under both names."""
    seen, out = {}, {}
    for name, t in weights.items():
        key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if key in seen:
            out[name] = seen[key]
        else:
            seen[key] = name
    return out


def buckets(weights: Mapping[str, torch.Tensor], limit: int | None = None
            ) -> list[list[Entry]]:
    """The weights' tensors in order (an alias left out), dealt into buckets of at most
    ``limit`` bytes (default ``BUCKET_BYTES``; a larger tensor alone in one), each tensor at an
    ``ALIGN``-ed offset."""
    limit = BUCKET_BYTES if limit is None else limit
    skip = aliases(weights)
    out, current, size = [], [], 0
    for name, t in weights.items():
        if name in skip:
            continue
        nbytes = t.numel() * t.element_size()
        offset = -(-size // ALIGN) * ALIGN
        if current and offset + nbytes > limit:
            out.append(current)
            current, offset = [], 0
        current.append(Entry(name, tuple(t.shape), t.dtype, offset, nbytes))
        size = offset + nbytes
    return out + ([current] if current else [])


def bucket_bytes(bucket: list[Entry]) -> int:
    return bucket[-1].offset + bucket[-1].nbytes


def pack(bucket: list[Entry], weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The bucket's tensors as one uint8 CPU tensor (a lone tensor: its own bytes, no copy)."""
    if len(bucket) == 1:
        return weights[bucket[0].name].detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    buf = torch.empty(bucket_bytes(bucket), dtype=torch.uint8)
    for e in bucket:
        buf[e.offset:e.offset + e.nbytes] = weights[e.name].detach().cpu().contiguous() \
            .reshape(-1).view(torch.uint8)
    return buf


def unpack(bucket: list[Entry], buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of ``buf`` as the bucket's tensors."""
    return {e.name: buf[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in bucket}
