"""Fake quantisation of a sampler's weights: each weight matrix rounded to what an int8, int4 or
fp8 format can hold, then computed with in the trainer's precision, as a quantised inference engine's
weights differ from the trainer's (``rollout.quantize``: a larger sampler/trainer mismatch than
bf16, on a CPU, for the stability study).

* ``int8``: symmetric, one scale per output channel (a row of ``[out, in]``): s = max|w_row| / 127,
  w ↦ s · clamp(round(w / s), −127, 127) (round half to even, as ``torch.round``). This is the
  weight-only int8 of W8A16 inference kernels.
* ``int4``: the same with 15 levels, s = max|w_row| / 7, w ↦ s · clamp(round(w / s), −7, 7): the
  weight-only int4 of W4A16 kernels (GPTQ / AWQ), with one scale per row where those use one per
  group of 32-128 inputs (the presets' rows have 16-128 inputs, so a row is at most one group of
  128): the coarsest rounding offered.
* ``fp8``: e4m3 (3 mantissa bits, largest finite 448) with one scale per matrix:
  s = max|w| / 448, w ↦ s · fp8(w / s) (round to nearest even by the cast).

A fused expert tensor ``[E, out, in]`` is E matrices (a scale per expert's row for int8 / int4,
per expert for fp8). Left in full precision, as inference engines leave them: vectors (norms, biases), the
token embedding and LM head, and an MoE router (``….mlp.gate.weight``). Activations are not
quantised. This module is pure torch: it returns new tensors and never touches a module.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import Tensor

from gspo.registry import Registry

__all__ = ["FORMATS", "KEEP_FULL", "fake_quantize", "quantize_weights", "quantized"]

INT8_MAX = 127.0
INT4_MAX = 7.0  # symmetric: -7..7 (the code -8 unused, as symmetric int4 kernels do)
FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
KEEP_FULL = ("embed", "lm_head", ".mlp.gate.weight")
"""Name parts of weights left in full precision: embeddings, the LM head, an MoE router."""

FORMATS: Registry[Callable[[Tensor], Tensor]] = Registry("rollout quantisation format")


def _wide(w: Tensor) -> Tensor:
    """``w`` in float32 at least (bf16 / fp16 weights are rounded from float32 values)."""
    return w.to(torch.promote_types(w.dtype, torch.float32))


def _safe(scale: Tensor) -> Tensor:
    """An all-zero row or matrix keeps scale 1 (it rounds to zeros either way)."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def symmetric_per_channel(w: Tensor, qmax: float) -> Tensor:
    """[..., out, in] -> the same shape: each row rounded to 2·qmax + 1 levels of its own scale."""
    x = _wide(w)
    scale = _safe(x.abs().amax(dim=-1, keepdim=True) / qmax)                    # [..., out, 1]
    return (torch.round(x / scale).clamp(-qmax, qmax) * scale).to(w.dtype)


@FORMATS.register("int8")
def int8_per_channel(w: Tensor) -> Tensor:
    """[..., out, in] -> the same shape: each row rounded to 255 levels of its own scale."""
    return symmetric_per_channel(w, INT8_MAX)


@FORMATS.register("int4")
def int4_per_channel(w: Tensor) -> Tensor:
    """[..., out, in] -> the same shape: each row rounded to 15 levels of its own scale."""
    return symmetric_per_channel(w, INT4_MAX)


@FORMATS.register("fp8")
def fp8_e4m3_per_matrix(w: Tensor) -> Tensor:
    """[..., out, in] -> the same shape: each matrix scaled to e4m3's range and cast through it."""
    x = _wide(w)
    scale = _safe(x.abs().amax(dim=(-2, -1), keepdim=True) / FP8_E4M3_MAX)      # [..., 1, 1]
    return ((x / scale).to(torch.float8_e4m3fn).to(x.dtype) * scale).to(w.dtype)


def quantized(name: str, tensor: Tensor) -> bool:
    """Whether weight ``name`` is quantised: a floating matrix (or stack of them) not in KEEP_FULL."""
    return (tensor.is_floating_point() and tensor.dim() >= 2
            and not any(part in name for part in KEEP_FULL))


def fake_quantize(w: Tensor, fmt: str) -> Tensor:
    """``w`` rounded by format ``fmt`` (``FORMATS``: int4 | int8 | fp8), in ``w``'s dtype."""
    return FORMATS.get(fmt)(w)


def quantize_weights(named: Mapping[str, Tensor], fmt: str) -> dict[str, Tensor]:
    """A state's tensors with each quantised weight (``quantized``) rounded by ``fmt``; the others
    are the same tensor objects (not copied)."""
    fn = FORMATS.get(fmt)
    with torch.no_grad():
        return {name: fn(t) if quantized(name, t) else t for name, t in named.items()}
