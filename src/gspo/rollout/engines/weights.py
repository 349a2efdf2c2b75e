"""Weights as an engine receives them: the policy's tensors in the checkpoint's layout
(``policy_weights``), a LoRA policy's with its adapters merged (``merged_adapters``: what an
engine that samples whole weights only is handed), and laid end to end in byte buckets for a
transfer to another process (``buckets`` / ``pack`` / ``unpack``: the Ray generators' gloo
broadcasts; any out-of-process engine can ship the same way). Plain tensors in, plain tensors
out: no engine, no transport."""

from __future__ import annotations

import dataclasses
from typing import Iterator, Mapping

import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer
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


def adapted(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a peft (LoRA) policy: adapters over a frozen base."""
    return isinstance(model, PeftModel)


def architecture(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model an engine is built from: a LoRA policy's base (its config, its
    layouts; the adapters reach the engine merged into ``merged_adapters``' weights), else
    ``model`` itself. No copy: the base's weights are the policy's."""
    return model.get_base_model() if adapted(model) else model


class MergedAdapters(Mapping):
    """A LoRA policy's weights under its base model's names, each adapted layer's weight merged
    out of place: W + ΔW, ΔW = B·A·(alpha/r) by peft's own ``get_delta_weight`` (peft's
    ``merge(safe_merge=True)`` without writing into the layer); the adapter tensors left out.
    The trainer's weights are never changed. Lazy: each merged tensor is computed when it is read
    (one at a time for ``policy_weights``, as ``Gathered`` is), from the layer's adapters as they
    are then and the base weight ``weights`` holds (the policy's ``state_dict``: peft's names).
    Shapes: W [out, in], A [r, in], B [out, r]."""

    def __init__(self, model: PeftModel, weights: Mapping[str, torch.Tensor] | None = None):
        self.weights = model.state_dict() if weights is None else weights
        self.adapter = model.active_adapter
        base = model.get_base_model()
        prefix = next(n for n, m in model.named_modules() if m is base) + "."   # base_model.model.
        layers = {prefix + n: m for n, m in base.named_modules() if isinstance(m, LoraLayer)}
        for name, layer in layers.items():
            check_mergeable(name.removeprefix(prefix), layer, self.adapter, base)
        self.names: dict[str, tuple[str, LoraLayer | None]] = {}
        """base name -> (the policy's name, the layer whose delta it gets, or None)."""
        for name in self.weights:
            owner = next((n for n in layers if name.startswith(n + ".")), None)
            if owner is None:
                self.names[name.removeprefix(prefix)] = (name, None)
                continue
            leaf = name[len(owner) + 1:]
            if leaf.startswith("base_layer."):        # else lora_A / lora_B: left out
                leaf = leaf.removeprefix("base_layer.")
                delta = layers[owner] if leaf == "weight" else None
                self.names[f"{owner.removeprefix(prefix)}.{leaf}"] = (name, delta)

    def __getitem__(self, name: str) -> torch.Tensor:
        own, layer = self.names[name]
        w = self.weights[own]
        if layer is None:
            return w
        with torch.no_grad():
            return w.detach() + layer.get_delta_weight(self.adapter).to(w.dtype)   # [out, in]

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def check_mergeable(name: str, layer: LoraLayer, adapter: str, base: torch.nn.Module) -> None:
    """ValueError (one line) for an adapted layer whose merge is not W + B·A·scale into a weight
    of its own: a peft variant (DoRA...), an adapter bias, an adapter merged already, or a base
    weight tied to another (embeddings tied to the output head: one tensor, two meanings)."""
    if adapter in getattr(layer, "lora_variant", {}) or getattr(layer, "lora_bias", {}).get(adapter):
        raise ValueError(f"model.lora: {name}'s adapter is not plain LoRA (a variant or a bias): "
                         f"its merge is not built")
    if layer.merged:
        raise ValueError(f"model.lora: {name}'s adapter is merged into its base already")
    weight = layer.get_base_layer().weight
    if sum(p is weight for _, p in base.named_parameters(remove_duplicate=False)) > 1:
        raise ValueError(f"model.lora: {name} is tied to another weight (embeddings and output "
                         f"head): merging its adapter would change both")


def merged_adapters(model: torch.nn.Module, weights: Mapping[str, torch.Tensor] | None = None
                    ) -> Mapping[str, torch.Tensor]:
    """The weights an engine that samples whole weights only takes from ``model``: a LoRA
    policy's merged (``MergedAdapters``), else ``weights`` (None: the model's own) as they are."""
    if adapted(model):
        return MergedAdapters(model, weights)
    return model.state_dict() if weights is None else weights


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
    ``model.embed_tokens.weight``): sent once, set under both names. Every tensor read is held
    until the end: a mapping that computes each as it is read (``MergedAdapters``) would free it,
    and the next could get its address."""
    seen, out, held = {}, {}, []
    for name, t in weights.items():
        held.append(t)
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
