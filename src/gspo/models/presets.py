"""Tiny model presets, the character tokenizer, and loading of local checkpoints.

Every model here is a plain transformers model and every checkpoint a standard transformers
directory (``config.json`` + ``model.safetensors`` + tokenizer files) that
``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained`` load without this
package, or a peft LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``
+ tokenizer files) over such a base, which ``load_model`` returns merged into its base. Nothing is downloaded: presets are built from configurations, weights are random until
trained.

This module deliberately does not know about training; it only builds, loads and saves.
"""

from __future__ import annotations

import contextlib
import json
import string
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from peft import PeftModel
from safetensors import SafetensorError
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers import models as tk_models
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3MoeConfig,
)

from gspo.errors import UserError
from gspo.hub import local_path
from gspo.registry import Registry

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
# All printable ASCII (letters, digits, punctuation, space) and newline: 96 characters.
CHARACTERS = tuple(string.ascii_letters + string.digits + string.punctuation + " \n")


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one id per printable ASCII character and newline.

    Ids 0..3 are ``<pad> <bos> <eos> <unk>``; encoding prepends ``<bos>``. Saved with
    ``save_pretrained`` it is a standard ``tokenizer.json`` that ``AutoTokenizer`` loads.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(tk_models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK,
        padding_side="left", model_max_length=4096, split_special_tokens=True,
    )


# ---------------------------------------------------------------------------------------------
# Presets: name -> config builder. Sizes are chosen so a step of RL runs in about a second on a
# 2-core CPU; the MoE preset keeps the dense preset's depth and width so they compare fairly.

PRESETS: Registry[Callable[..., PretrainedConfig]] = Registry("model preset", valid="valid presets")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""model.dtype names -> torch dtypes."""


def resolve_device(name: str) -> torch.device:
    """model.device: cpu | cuda | cuda:N, or auto (cuda when available)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


register_preset = PRESETS.register
"""Decorator: ``@register_preset(name)`` on ``fn(vocab_size, **overrides) -> PretrainedConfig``."""


def _common(vocab_size: int) -> dict:
    return dict(
        vocab_size=vocab_size, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rope_theta=10000.0,
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


@register_preset("tiny-dense")
def tiny_dense(vocab_size: int, **overrides) -> PretrainedConfig:
    """Qwen3 architecture, 4 layers x 128 wide, ~0.8M parameters."""
    return Qwen3Config(**{**_common(vocab_size), "intermediate_size": 384, **overrides})


@register_preset("tiny-moe")
def tiny_moe(vocab_size: int, **overrides) -> PretrainedConfig:
    """Qwen3-MoE architecture, 4 layers x 128 wide, 8 experts, top-2 routing, every layer MoE."""
    return Qwen3MoeConfig(**{
        **_common(vocab_size), "intermediate_size": 384, "moe_intermediate_size": 96,
        "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
        "norm_topk_prob": True, "router_aux_loss_coef": 0.0, "output_router_logits": False,
        **overrides})


@register_preset("deep-moe")
def deep_moe(vocab_size: int, **overrides) -> PretrainedConfig:
    """Qwen3-MoE, 8 layers x 128 wide, 16 experts (48 wide), top-2 routing, every layer MoE: twice
    tiny-moe's depth and experts, for routing that moves more per step (configs/compare/moe-long.yaml)."""
    return tiny_moe(vocab_size, **{"num_hidden_layers": 8, "num_experts": 16,
                                   "moe_intermediate_size": 48, **overrides})


@register_preset("wide-moe")
def wide_moe(vocab_size: int, **overrides) -> PretrainedConfig:
    """Qwen3-MoE, 4 layers x 128 wide, 64 experts (16 wide), top-8 routing, every layer MoE: many
    narrow experts and a wide top-k, as Qwen3-30B-A3B routes (128 experts, top-8), so that a small
    change of the router's logits changes more of the chosen sets (the stability study)."""
    return tiny_moe(vocab_size, **{"num_experts": 64, "num_experts_per_tok": 8,
                                   "moe_intermediate_size": 16, **overrides})


available_presets = PRESETS.names
"""Sorted names of the model presets."""


def preset_config(name: str, vocab_size: int, overrides: dict | None = None) -> PretrainedConfig:
    """The transformers config of preset ``name``, with ``overrides`` applied on top."""
    known = PRESETS.get(name)(vocab_size)
    unknown = sorted(set(overrides or {}) - set(known.to_dict()))
    if unknown:
        raise ValueError(f"model.overrides: the {name} config has no field {', '.join(map(repr, unknown))}")
    return PRESETS.get(name)(vocab_size, **(overrides or {}))


def build_model(preset: str, seed: int, overrides: dict | None = None,
                dtype: torch.dtype = torch.float32, tokenizer: PreTrainedTokenizerBase | None = None
                ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A freshly initialised preset model, deterministic in ``seed``, sized for ``tokenizer``
    (default: the character tokenizer) and given its special token ids."""
    tokenizer = tokenizer or build_char_tokenizer()
    ids = {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
           "eos_token_id": tokenizer.eos_token_id}
    config = preset_config(preset, len(tokenizer), {**ids, **(overrides or {})})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model, tokenizer


# What safetensors / transformers raise on a checkpoint they cannot read: a corrupt or truncated
# weights file, a config.json or tokenizer file that does not parse, weights that do not fit the
# architecture config.json describes.
LOAD_ERRORS = (SafetensorError, OSError, ValueError, RuntimeError)
ADAPTER_CONFIG = "adapter_config.json"


@contextlib.contextmanager
def reading_checkpoint(key: str, path: str | Path):
    """Within: a checkpoint load that fails is the user's input, one line naming ``key`` (the
    config key or flag that gave ``path``), the folder and what the library said."""
    try:
        yield
    except UserError:
        raise
    except LOAD_ERRORS as err:
        lines = str(err).strip().splitlines()
        reason = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
        raise UserError(f"{key}: cannot load the checkpoint {str(path)!r} ({reason})") from None


def is_adapter_dir(path: str | Path) -> bool:
    """A peft adapter directory (LoRA checkpoint) rather than a full transformers checkpoint."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_base(path: str | Path) -> Path:
    """The base checkpoint an adapter directory was trained on (its ``base_model_name_or_path``)."""
    base = json.loads((Path(path) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base:
        raise FileNotFoundError(f"{path}: {ADAPTER_CONFIG} names no base_model_name_or_path")
    return Path(base)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32,
               tokenizer: PreTrainedTokenizerBase | None = None, key: str = "checkpoint"
               ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Any causal-LM checkpoint directory (transformers format), or a hub id from the Hugging Face
    cache (``gspo.models.hub``: downloaded only when not cached and not offline). A LoRA
    adapter directory is loaded onto its base (``adapter_base``) and merged: a plain model. One
    that cannot be read is a UserError naming ``key`` (e.g. model.path). ``tokenizer``: use this
    one (e.g. with its EOS set to the chat end-of-turn) instead of the checkpoint's own."""
    path = Path(local_path(path, key))
    if is_adapter_dir(path):
        base, _ = load_model(adapter_base(path), dtype, key=key)
        with reading_checkpoint(key, path), warnings.catch_warnings():
            # peft 0.21 asks transformers 5 a deprecated question
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            model = PeftModel.from_pretrained(base, path, is_trainable=False,
                                              local_files_only=True).merge_and_unload()
    elif (path / "config.json").is_file():
        with reading_checkpoint(key, path):
            # safetensors only: a pickled pytorch_model.bin is refused, never unpickled
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True,
                                                         use_safetensors=True)
    else:
        raise FileNotFoundError(f"{key}: {path} is not a transformers checkpoint (no config.json)")
    with reading_checkpoint(key, path):
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token_id is None:  # many causal LMs ship without one; EOS is the usual stand-in
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path,
               state_dict: dict | None = None) -> None:
    """Write a standard transformers directory (safetensors weights; ``state_dict`` instead of the
    model's own, e.g. the full weights gathered from FSDP shards)."""
    model.save_pretrained(path, safe_serialization=True, state_dict=state_dict)
    tokenizer.save_pretrained(path)


def enable_activation_checkpointing(model: PreTrainedModel, dropout: bool = False) -> None:
    """Recompute decoder-layer activations in backward (non-reentrant torch checkpointing), in
    training mode with gradients on; forwards without gradients run as usual, cache included.
    torch's RNG state is saved for the recompute only when the layers draw dropout masks (the
    model's own, or ``dropout``: adapters to be added with a dropout), which must repeat; otherwise
    a recompute leaves the global RNG alone (a rollout worker thread samples from it)."""
    preserve = dropout or dropout_rates(model) != {}
    model.activation_checkpointing_enable({"use_reentrant": False, "preserve_rng_state": preserve})


def dropout_rates(model: torch.nn.Module) -> dict[str, float]:
    """The model's non-zero dropout rates, by name: ``nn.Dropout`` modules, and config fields
    named *dropout* or *pdrop* (transformers attention applies its rate functionally). {}: its
    training forward draws no random number."""
    rates = {name: m.p for name, m in model.named_modules()
             if isinstance(m, torch.nn.Dropout) and m.p > 0}
    config = getattr(model, "config", None)
    for key, value in (vars(config) if config is not None else {}).items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float) and value > 0:
            rates[f"config.{key}"] = value
    return rates


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
