"""Tokenizers of the presets: the character tokenizer (default) or a byte-level BPE trained on the
task's own text, and the end-of-turn token of a chat template.

``model.tokenizer: bpe`` builds a subword tokenizer with the ``tokenizers`` library the way
Qwen's is laid out: byte-level BPE (every byte string encodes, nothing maps to an unknown token),
digits split one per token, special tokens ``<|endoftext|>`` (padding) and ``<|im_start|>`` /
``<|im_end|>`` (ChatML turns, ``<|im_end|>`` the EOS), ``<think>`` / ``</think>`` as added
tokens, and a ChatML chat template. It is trained on the training split's prompts and answers
(plus the template's role words), deterministically: the same text gives the same
``tokenizer.json``. Saved with ``save_pretrained`` it is a standard tokenizer directory that
``AutoTokenizer.from_pretrained`` loads without this package.

With ``task.chat: true`` the EOS of the run is the template's end-of-turn token
(``use_end_of_turn``): rollouts stop on it, the response mask ends at it, demonstrations end with
it, and decoded completions leave it out, exactly as EOS does without chat.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers import models as tk_models
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from gspo.errors import UserError
from gspo.hub import TOKENIZER_FILES, local_path
from gspo.models.presets import build_char_tokenizer
from gspo.registry import Registry
from gspo.tasks import Example

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
BPE_SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2
THINK_TOKENS = ("<think>", "</think>")  # ordinary added tokens: kept when decoding
ROLES = ("system", "user", "assistant")

# ChatML, as Qwen's instruct models use: each turn is <|im_start|>role\ncontent<|im_end|>\n, and
# the generation prompt opens an assistant turn.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Pre-tokenization: single digits (as Qwen does, so numbers keep a per-digit code), words with
# their leading space, punctuation runs, whitespace runs.
SPLIT_PATTERN = r"\p{N}| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

DEFAULT_BPE_VOCAB = 4096


def build_bpe_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_BPE_VOCAB,
                        min_frequency: int = 2) -> PreTrainedTokenizerFast:
    """A byte-level BPE with ChatML special tokens and chat template, trained on ``texts``.

    ``vocab_size`` is an upper bound: a small corpus runs out of pairs seen ``min_frequency``
    times before it. No BOS is added when encoding (the template carries the turn markers).
    """
    tok = Tokenizer(tk_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
        special_tokens=list(BPE_SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT, padding_side="left",
        model_max_length=4096, chat_template=CHATML_TEMPLATE)


def training_text(examples: list[Example]) -> list[str]:
    """What the BPE learns from: each prompt, answer and chat message of the rows, behind its role
    word as in a chat turn (so "user" and "assistant" become tokens too)."""
    texts = [text for ex in examples for text in (f"user\n{ex.prompt}", f"assistant\n{ex.answer}")]
    texts += [f"{m['role']}\n{m['content']}" for ex in examples for m in ex.data.get("messages") or []
              if isinstance(m, dict) and isinstance(m.get("content"), str)
              and isinstance(m.get("role"), str)]
    return texts + [f"{role}\n" for role in ROLES]


# model.tokenizer name -> builder(training examples, vocab size)
TOKENIZERS: Registry[Callable[[list[Example], int], PreTrainedTokenizerFast]] = Registry("tokenizer")
TOKENIZERS.add("char", lambda examples, vocab_size: build_char_tokenizer())
TOKENIZERS.add("bpe", lambda examples, vocab_size: build_bpe_tokenizer(training_text(examples), vocab_size))


def preset_tokenizer(name: str, examples: list[Example], vocab_size: int = DEFAULT_BPE_VOCAB
                     ) -> PreTrainedTokenizerBase:
    """The tokenizer ``model.tokenizer`` names: a builder of ``TOKENIZERS`` (char, bpe: from the
    training ``examples``), else a tokenizer's folder or hub id (the cache first; of a download only
    the tokenizer files), loaded with ``AutoTokenizer`` and its chat template."""
    if name in TOKENIZERS:
        return TOKENIZERS.get(name)(examples, vocab_size)
    from transformers import AutoTokenizer
    folder = local_path(name, key="model.tokenizer", files=TOKENIZER_FILES)
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(f"model.tokenizer: {name!r} is none of {', '.join(TOKENIZERS.names())} and "
                        f"not a tokenizer folder or hub id ({reason})") from None


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The token the chat template closes an assistant turn with (<|im_end|>, <|eot_id|>...).

    Found by rendering a one-turn conversation and taking the first token after the assistant's
    text; the tokenizer's EOS where that token is not a special one. ValueError without a template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template")
    marker = "gspo-end-of-turn-probe"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "?"}, {"role": "assistant", "content": marker}], tokenize=False)
    after = text[text.rindex(marker) + len(marker):]
    ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    special = (set(tokenizer.all_special_ids) | {
        i for i, t in tokenizer.added_tokens_decoder.items() if t.special}) - {tokenizer.unk_token_id}
    if ids and ids[0] in special:
        return ids[0]
    if tokenizer.eos_token_id is None:
        raise ValueError("the chat template closes a turn with no special token and the tokenizer has no EOS")
    return tokenizer.eos_token_id


def use_end_of_turn(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Make the chat template's end-of-turn token the tokenizer's EOS (in place; returned)."""
    eot = end_of_turn_id(tokenizer)
    if tokenizer.eos_token_id != eot:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eot)
    return tokenizer
