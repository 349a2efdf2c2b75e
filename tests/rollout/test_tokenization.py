"""The BPE preset tokenizer (deterministic, standard files, ChatML template), chat-rendered
prompts, and the end-of-turn token as EOS for the response mask, generation and decoding."""

import hashlib
import subprocess
import sys

import types

import pytest
import torch
from tokenizers import Tokenizer, models as tk_models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from gspo import tasks
from gspo.rollout.chat import ChatTask, conversation
from gspo.tasks.base import message_problem
from gspo.cli import main
from gspo.config import ConfigError, load_config
from gspo.models.presets import build_char_tokenizer, build_model
from gspo.rollout.generate import SamplingParams, demonstration_batch, generate, response_mask_from_ids
from gspo.tasks import Example
from gspo.rollout.tokenization import (IM_END, IM_START, build_bpe_tokenizer, end_of_turn_id,
                               preset_tokenizer, use_end_of_turn)

TEXTS = ["user\nhow many apples are there?", "assistant\nthere are 12 apples", "user\nhow many pears?",
         "assistant\nthere are 7 pears"] * 5


@pytest.fixture(scope="module")
def bpe():
    return preset_tokenizer("bpe", tasks.build("arithmetic", n_train=200, n_test=10).split("train"))


def _tokenizer_hash(out) -> str:
    return hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()


DETERMINISM_TEXTS = ["user\nhow many apples are there?", "assistant\nthere are 12 apples"] * 9
BUILD = ("import sys; from gspo.rollout.tokenization import build_bpe_tokenizer; "
         f"build_bpe_tokenizer({DETERMINISM_TEXTS!r}, 300).save_pretrained(sys.argv[1])")


def test_bpe_is_deterministic_across_processes(tmp_path):
    """Rust hash maps are seeded per process: the same text must still give the same file."""
    subprocess.run([sys.executable, "-c", BUILD, str(tmp_path / "a")], check=True)
    build_bpe_tokenizer(DETERMINISM_TEXTS, 300).save_pretrained(tmp_path / "b")
    assert _tokenizer_hash(tmp_path / "a") == _tokenizer_hash(tmp_path / "b")


def test_bpe_saves_standard_files_that_auto_tokenizer_loads(tmp_path):
    tok = build_bpe_tokenizer(TEXTS, 320)
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert (again.eos_token, again.pad_token, again.bos_token) == (IM_END, "<|endoftext|>", None)
    assert again.padding_side == "left"
    text = "there are 12 apples <think>ok</think>"
    assert again(text)["input_ids"] == tok(text)["input_ids"]
    chat = [{"role": "user", "content": "how many apples?"}]
    rendered = again.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == f"{IM_START}user\nhow many apples?{IM_END}\n{IM_START}assistant\n"
    assert rendered == tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_bpe_merges_words_splits_digits_and_encodes_any_text():
    tok = build_bpe_tokenizer(TEXTS, 320)
    assert len(tok) <= 320 + 2                                   # + <think> </think>
    assert tok.convert_ids_to_tokens(tok("there are 12 apples")["input_ids"]) == \
        ["there", "Ġare", "Ġ", "1", "2", "Ġapples"]              # words merged, digits one each
    for text in ("héllo wörld €5", "<think>x</think> 3", "\t\n  "):  # byte level: no unknown token
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    ids = tok(f"12{IM_END}", add_special_tokens=False)["input_ids"]
    assert ids[-1] == tok.eos_token_id and tok.decode(ids, skip_special_tokens=True) == "12"
    assert tok.convert_ids_to_tokens(tok("<think>", add_special_tokens=False)["input_ids"]) == ["<think>"]


def test_bpe_vocabulary_bound_is_reached_on_rich_text():
    words = [f"w{chr(97 + i % 26)}{chr(97 + i // 26 % 26)}{chr(97 + i // 676)}x" for i in range(3000)]
    tok = build_bpe_tokenizer([" ".join(words[i:i + 20]) for i in range(0, 3000, 5)] * 2, 2000)
    assert len(tok) == 2000 + 2


def _template_tokenizer(template: str, specials: list[str], eos: str) -> PreTrainedTokenizerFast:
    vocab = {t: i for i, t in enumerate(specials + list("abcdefghijklmnopqrstuvwxyz?-: \n"))}
    tok = Tokenizer(tk_models.WordLevel(vocab=vocab, unk_token=specials[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=specials[0], eos_token=eos,
                                   chat_template=template)
    fast.add_special_tokens({"additional_special_tokens": specials[1:]})
    return fast


def test_end_of_turn_of_other_templates():
    llama = ("{% for m in messages %}<|start|>{{ m['role'] }}: {{ m['content'] }}<|eot|>{% endfor %}"
             "{% if add_generation_prompt %}<|start|>assistant: {% endif %}")
    tok = _template_tokenizer(llama, ["<unk>", "<|start|>", "<|eot|>", "<|end_of_text|>"], "<|end_of_text|>")
    assert tok.convert_ids_to_tokens(end_of_turn_id(tok)) == "<|eot|>"
    use_end_of_turn(tok)
    assert tok.eos_token == "<|eot|>"
    plain = "{% for m in messages %}{{ m['content'] }}\n\n{% endfor %}"  # ends a turn with text
    tok = _template_tokenizer(plain, ["<unk>", "<eos>"], "<eos>")
    assert end_of_turn_id(tok) == tok.eos_token_id
    with pytest.raises(ValueError, match="no chat template"):
        end_of_turn_id(build_char_tokenizer())


def test_use_end_of_turn_replaces_a_base_models_eos(bpe):
    base = PreTrainedTokenizerFast(tokenizer_object=bpe.backend_tokenizer, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", chat_template=bpe.chat_template)
    assert base.eos_token == "<|endoftext|>"
    assert use_end_of_turn(base).eos_token == IM_END and base.eos_token_id == bpe.convert_tokens_to_ids(IM_END)


def test_chat_task_renders_prompts_and_keeps_scoring(bpe):
    arith = tasks.build("arithmetic", n_train=20, n_test=5)
    chat = ChatTask(arith, bpe, system_prompt="Add.")
    raw, rendered = arith.split("train")[0], chat.split("train")[0]
    assert rendered.prompt == (f"{IM_START}system\nAdd.{IM_END}\n{IM_START}user\n{raw.prompt}{IM_END}\n"
                               f"{IM_START}assistant\n")
    assert (rendered.answer, rendered.data) == (raw.answer, {"question": raw.prompt, **raw.data})
    own = ChatTask(types.SimpleNamespace(name="t", split=lambda _: [Example("p", "a", {"question": "Q"})]), bpe)
    assert own.split("train")[0].data == {"question": "Q"}          # a row's own question is kept
    assert chat.is_correct(raw.answer, rendered) and not chat.is_correct(raw.answer + "1", rendered)
    row = Example("q", "a", {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]})
    assert conversation(row, "ignored") == row.data["messages"]   # a system turn already present


@pytest.mark.parametrize("messages, problem", [
    ([{"role": "system", "content": "s"}], "no user message"),
    ([{"role": "assistant", "content": "a"}], "no user message"),
    ([], "non-empty list"),
    ("hi", "non-empty list"),
    ([{"role": "user"}], "string 'role' and 'content'"),
    ([{"role": "robot", "content": "x"}], "unknown role 'robot'"),
])
def test_message_problems(messages, problem):
    assert problem in message_problem(messages)


def test_end_of_turn_is_the_eos_of_mask_demonstrations_and_decoding(bpe):
    ex = [ChatTask(tasks.build("arithmetic", n_train=20, n_test=5), bpe).split("train")[i] for i in range(3)]
    batch = demonstration_batch(bpe, ex, "cpu")
    eot = bpe.convert_tokens_to_ids(IM_END)
    for row, mask, e in zip(batch.response_ids, batch.response_mask, ex):
        n = int(mask.sum())
        assert row[n - 1] == eot and n == len(bpe(e.answer, add_special_tokens=False)["input_ids"]) + 1
    assert batch.completions == [e.answer for e in ex]            # decoded without <|im_end|>
    ids = torch.tensor([[5, eot, 7, eot], [5, 6, 7, 8]])
    mask, truncated = response_mask_from_ids(ids, bpe.eos_token_id)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]] and truncated.tolist() == [False, True]


def _steer(model, token_id: int, vocab: int) -> None:
    """A head bias that makes ``token_id`` the greedy choice at every position."""
    bias = torch.full((vocab,), -30.0)
    bias[token_id] = 30.0
    model.lm_head.bias = torch.nn.Parameter(bias)


def test_generation_stops_at_the_end_of_turn(bpe):
    model, tok = build_model("tiny-dense", 0, tokenizer=bpe)
    assert model.config.vocab_size == len(bpe) and model.config.eos_token_id == bpe.eos_token_id
    ex = ChatTask(tasks.build("arithmetic", n_train=20, n_test=5), bpe).split("train")[:2]
    greedy = SamplingParams(max_new_tokens=6, greedy=True)
    five = bpe.convert_tokens_to_ids("5")
    _steer(model, five, len(bpe))                                  # never the end of turn
    out = generate(model.eval(), tok, ex, greedy)
    assert out.truncated.all() and out.response_mask.sum(-1).tolist() == [6.0, 6.0]
    assert out.completions == ["555555"] * 2
    _steer(model, bpe.convert_tokens_to_ids(IM_END), len(bpe))     # the end of turn at once
    out = generate(model.eval(), tok, ex, greedy)
    assert not out.truncated.any() and out.response_mask.sum(-1).tolist() == [1.0, 1.0]
    assert out.response_ids[:, 0].tolist() == [bpe.eos_token_id] * 2 and out.completions == ["", ""]


def test_chat_needs_a_chat_template():
    with pytest.raises(ConfigError, match="task.chat: true needs a tokenizer with a chat template"):
        load_config(None, ["task.chat=true"])
    assert load_config(None, ["task.chat=true", "model.tokenizer=bpe"]).task.chat


def test_model_path_without_template_under_chat_is_one_line_exit_2(capsys, tmp_path, saved_tiny):
    argv = ["train", f"model.path={saved_tiny}", "task.chat=true", f"run.dir={tmp_path / 'run'}",
            "task.n_train=20", "task.n_test=5"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "task.chat: true: the tokenizer has no chat template (model.path" in err
    assert not (tmp_path / "run").exists()


def test_model_path_base_tokenizer_gets_the_end_of_turn_as_eos(tmp_path, bpe, make_cfg, reward_module):
    """A Qwen-base-like checkpoint (EOS <|endoftext|>, ChatML template): under task.chat the run's
    EOS is <|im_end|>, in the trainer, in rollouts and in the checkpoints it writes."""
    from conftest import parity_rewards
    from gspo.models.presets import save_model
    from gspo.training.trainer import Trainer
    base = PreTrainedTokenizerFast(tokenizer_object=bpe.backend_tokenizer, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", chat_template=bpe.chat_template,
                                   padding_side="left")
    model, _ = build_model("tiny-dense", 0, tokenizer=base)
    save_model(model, base, tmp_path / "base")
    trainer = Trainer(make_cfg(f"model.path={tmp_path / 'base'}", "task.chat=true", "sft.enabled=false",
                               parity_rewards(reward_module)), log=lambda m: None)
    trainer.setup()
    eot = bpe.convert_tokens_to_ids(IM_END)
    assert trainer.tokenizer.eos_token_id == eot and trainer.tokenizer.pad_token == "<|endoftext|>"
    assert trainer.train_set[0].prompt.startswith(f"{IM_START}user\n")
    batch = trainer.collector.generate(trainer.train_set[:2], seed=0)
    for row, mask, truncated in zip(batch.response_ids, batch.response_mask, batch.truncated):
        n = int(mask.sum())
        assert truncated or (row[n - 1] == eot and eot not in row[:n - 1].tolist())
    trainer.run()
    saved = AutoTokenizer.from_pretrained(trainer.run_dir / "checkpoints" / "step_000002")
    assert saved.eos_token == IM_END
