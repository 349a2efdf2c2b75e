"""Presets, the character tokenizer, and the transformers round-trip of saved checkpoints."""

import shutil
import string

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gspo.errors import UserError
from gspo.models.presets import (
    CHARACTERS,
    available_presets,
    build_char_tokenizer,
    build_model,
    count_parameters,
    load_model,
    preset_config,
    save_model,
)
from gspo.rewards.sources import ModelReward

# ------------------------------------------------------------------------------- tokenizer

PRINTABLE = "".join(chr(c) for c in range(32, 127)) + "\n"   # printable ASCII (95) + newline


def test_char_tokenizer_vocabulary():
    tok = build_char_tokenizer()
    assert len(tok) == 4 + 96 == len(CHARACTERS) + 4          # <pad> <bos> <eos> <unk> + 96 chars
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert set(CHARACTERS) == set(PRINTABLE)
    assert tok.padding_side == "left"


def test_char_tokenizer_covers_printable_ascii_and_newline():
    tok = build_char_tokenizer()
    ids = tok(PRINTABLE)["input_ids"]
    assert ids[0] == tok.bos_token_id                          # bos prepended
    assert len(ids) == 1 + len(PRINTABLE)                      # one id per character
    assert tok.unk_token_id not in ids
    assert len(set(ids[1:])) == len(PRINTABLE)                 # distinct ids
    assert all(4 <= i < len(tok) for i in ids[1:])
    # outside the alphabet: unknown
    assert tok("\t")["input_ids"] == [tok.bos_token_id, tok.unk_token_id]


@pytest.mark.parametrize("text", [PRINTABLE, "37+45=82", "a  b\n c ", " ", ""])
def test_char_tokenizer_round_trip(text):
    tok = build_char_tokenizer()
    ids = tok(text)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert len(ids) == 1 + len(text)


def test_char_tokenizer_special_token_text_is_plain_characters():
    tok = build_char_tokenizer()
    ids = tok("a<eos>b")["input_ids"]
    assert len(ids) == 1 + 7 and tok.eos_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == "a<eos>b"


def test_char_tokenizer_batch_pads_left():
    tok = build_char_tokenizer()
    enc = tok(["1+2=", "10+20="], padding=True)
    assert enc["input_ids"][0][:2] == [tok.pad_token_id] * 2
    assert enc["attention_mask"][0] == [0, 0, 1, 1, 1, 1, 1]


# ------------------------------------------------------------------------------- presets

def test_available_presets():
    assert available_presets() == ["deep-moe", "tiny-dense", "tiny-moe", "wide-moe"]


def test_tiny_dense_parameter_count(tiny):
    model, tok = tiny
    # V=100, H=128, 4 layers, 4 query heads / 2 kv heads of 32, MLP 384, tied embeddings:
    #   embedding 100*128 = 12,800 (shared with the head) + final norm 128
    #   per layer: q 128*128 + k 128*64 + v 128*64 + o 128*128 = 49,152
    #              q_norm 32 + k_norm 32 + 2 layer norms 2*128   = 320
    #              MLP gate/up/down 3 * 128*384                  = 147,456   -> 196,928
    #   total 12,800 + 128 + 4 * 196,928 = 800,640
    assert count_parameters(model) == 800_640
    assert model.config.model_type == "qwen3"
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_tiny_moe_parameter_count():
    model, _ = build_model("tiny-moe", 0)
    # as tiny-dense, but the MLP is a router 128*8 = 1,024 + 8 experts * 3 * 128*96 = 294,912
    #   per layer 49,152 + 320 + 1,024 + 294,912 = 345,408
    #   total 12,800 + 128 + 4 * 345,408 = 1,394,560
    assert count_parameters(model) == 1_394_560
    assert model.config.model_type == "qwen3_moe"
    assert (model.config.num_experts, model.config.num_experts_per_tok) == (8, 2)


def test_deep_moe_parameter_count():
    model, _ = build_model("deep-moe", 0)
    # 8 layers; the MLP is a router 128*16 = 2,048 + 16 experts * 3 * 128*48 = 294,912
    #   per layer 49,152 + 320 + 2,048 + 294,912 = 346,432
    #   total 12,800 + 128 + 8 * 346,432 = 2,784,384
    assert count_parameters(model) == 2_784_384
    assert (model.config.num_hidden_layers, model.config.num_experts,
            model.config.num_experts_per_tok) == (8, 16, 2)


def test_wide_moe_parameter_count():
    model, _ = build_model("wide-moe", 0)
    # 4 layers; the MLP is a router 128*64 = 8,192 + 64 experts * 3 * 128*16 = 393,216
    #   per layer 49,152 + 320 + 8,192 + 393,216 = 450,880
    #   total 12,800 + 128 + 4 * 450,880 = 1,816,448
    assert count_parameters(model) == 1_816_448
    assert (model.config.num_experts, model.config.num_experts_per_tok,
            model.config.moe_intermediate_size) == (64, 8, 16)


def test_build_is_deterministic_in_seed_and_leaves_global_rng(tiny):
    state = torch.random.get_rng_state()
    a, _ = build_model("tiny-dense", 0)
    b, _ = build_model("tiny-dense", 1)
    assert torch.equal(torch.random.get_rng_state(), state)
    pa, pb, p0 = (dict(m.named_parameters()) for m in (a, b, tiny[0]))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(pa[name], p0[name])
    assert not torch.equal(pa[name], pb[name])


def test_overrides_and_dtype():
    model, _ = build_model("tiny-dense", 0, {"num_hidden_layers": 1}, dtype=torch.bfloat16)
    assert model.config.num_hidden_layers == 1 and len(model.model.layers) == 1
    assert next(model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="no field 'not_a_field'"):
        preset_config("tiny-dense", 100, {"not_a_field": 1})


def test_overridden_preset_saves_and_loads(tmp_path):
    model, tok = build_model("tiny-dense", 0, {"num_hidden_layers": 1})
    save_model(model, tok, tmp_path)
    loaded, _ = load_model(tmp_path)
    assert loaded.config.num_hidden_layers == 1 and len(loaded.model.layers) == 1


def test_unknown_preset_lists_presets():
    with pytest.raises(ValueError, match="unknown model preset 'huge'.*tiny-dense, tiny-moe"):
        build_model("huge", 0)


def test_generation_config_ids(tiny):
    model, tok = tiny
    gc = model.generation_config
    assert (gc.pad_token_id, gc.eos_token_id, gc.bos_token_id) == (0, 2, 1)


# ------------------------------------------------------------------------------- save / load

TEXTS = ["37+45=", "9-3=", PRINTABLE]


def test_round_trip_with_plain_transformers(tiny, saved_tiny):
    """The saved folder loads with transformers alone: same logits, same tokenization."""
    model, tok = tiny
    loaded = AutoModelForCausalLM.from_pretrained(saved_tiny, local_files_only=True).eval()
    loaded_tok = AutoTokenizer.from_pretrained(saved_tiny, local_files_only=True)
    for text in TEXTS:
        assert loaded_tok(text)["input_ids"] == tok(text)["input_ids"]
        assert loaded_tok.decode(loaded_tok(text)["input_ids"], skip_special_tokens=True) == text
    assert loaded_tok.padding_side == "left"
    enc = tok(TEXTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        expected = model(**enc).logits
        got = loaded(**enc).logits
    assert torch.equal(got, expected)
    assert (saved_tiny / "model.safetensors").is_file()


def test_load_model(tiny, saved_tiny):
    model, _ = tiny
    loaded, tok = load_model(saved_tiny)
    assert tok.padding_side == "left" and tok.pad_token_id == 0
    assert loaded.generation_config.eos_token_id == tok.eos_token_id == 2
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    half, _ = load_model(saved_tiny, torch.bfloat16)
    assert next(half.parameters()).dtype == torch.bfloat16


def test_load_model_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "missing")


def test_unreadable_weights_are_a_user_error_naming_the_key(saved_tiny, tmp_path):
    """What preflight cannot see still ends in one line: a load that fails names the key and folder
    (here a corrupt file, which preflight would have caught first)."""
    bad = tmp_path / "bad"
    shutil.copytree(saved_tiny, bad)
    (bad / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(UserError, match=f"^model.path: cannot load the checkpoint '{bad}' "
                                        r"\(SafetensorError: .*header"):
        load_model(bad, key="model.path")
    with pytest.raises(UserError, match=r"^reward model 'model_bad': cannot load the checkpoint"):
        ModelReward(str(bad))


def test_character_set_is_exactly_printable():
    assert "".join(sorted(CHARACTERS)) == "".join(sorted(PRINTABLE))
    assert set(string.whitespace) & set(CHARACTERS) == {" ", "\n"}
