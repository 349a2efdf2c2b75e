"""Sections for the policy model (``gspo.models``, built by ``gspo.training``): model, its LoRA
adapters, and the MoE switches."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from gspo.config.base import Section, one_of
from gspo.models.presets import available_presets


class LoRAConfig(Section):
    r: int = Field(16, ge=1)
    """Rank of each adapter (A: r x in, B: out x r)."""
    alpha: float = Field(32.0, gt=0)
    """Scaling numerator: the adapter adds (alpha / r) * B A x to the frozen layer's output."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input during training."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Layers that get an adapter: all-linear or module names, e.g. [q_proj, v_proj] (docs/real-models.md)."""

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, targets: list[str] | str) -> list[str] | str:
        if isinstance(targets, list) and not targets:
            raise ValueError("needs at least one module name (or all-linear)")
        return targets


class ModelConfig(Section):
    preset: str = "tiny-dense"
    """Built-in architecture to initialise from scratch: tiny-dense | tiny-moe."""
    path: str | None = None
    """A local transformers causal-LM checkpoint to start from instead of a preset."""
    overrides: dict[str, Any] = {}
    """Fields set on the preset's transformers config (e.g. {num_hidden_layers: 2})."""
    tokenizer: str = Field("char", min_length=1)
    """Tokenizer of a preset: char (one per ASCII character) | bpe (byte-level BPE, ChatML) | a tokenizer's folder or hub id; docs/real-models.md."""
    tokenizer_vocab: int = Field(4096, ge=300)
    """bpe: the most tokens it may have (256 bytes + special tokens + merges); a small corpus stops earlier."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype: float32 | bfloat16 | float16 (float32 masters, dynamic loss scaling); log-probs, ratios and the loss are always float32 (docs/real-models.md)."""
    device: str = "auto"
    """cpu | cuda | cuda:N | auto (cuda when available)."""
    lora: LoRAConfig | None = None
    """LoRA adapters through peft for RL, e.g. {r: 16, alpha: 32} (None: the whole model trains); docs/real-models.md."""

    @field_validator("preset")
    @classmethod
    def _preset(cls, name: str) -> str:
        return one_of("model preset", name, available_presets())


class MoEConfig(Section):
    routing_replay: Literal["none", "old", "rollout"] = "none"
    """Force π_old's experts when computing π_θ: none | old (captured in the old-log-prob pass, paper's R2) | rollout (captured at generation, R3)."""
    aux_loss_coef: float = Field(0.0, ge=0)
    """Weight of the router load-balancing loss (0: off)."""
