"""Tests for gspo.rewards.sources: sources, weighted combination, the config factory, a tiny reward model."""

import math
import sys

import pytest
import torch

from gspo.rewards import sources
from gspo import tasks
from gspo.rewards.sources import CombinedReward, FunctionReward, ModelReward, RewardSource, VerifierReward, build_rewards
from gspo.tasks import Example

EXAMPLES = [Example("37+45=", "82", {"target": 82}), Example("9-4=", "5", {"target": 5})]

REWARD_MODULE = """
def length(completion, prompt, answer, target, **row):
    return float(len(completion))

def echo_target(completion, **row):
    return row["target"] / 100

def bad(completion, **row):
    return None

def nan(completion, **row):
    return float("nan")
"""


@pytest.fixture
def reward_mod(tmp_path, monkeypatch):
    (tmp_path / "rw_mod.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "rw_mod"
    sys.modules.pop("rw_mod", None)


@pytest.fixture(scope="module")
def arithmetic():
    return tasks.build("arithmetic", n_train=1, n_test=1)


def test_verifier_reward(arithmetic):
    src = VerifierReward(arithmetic)
    assert isinstance(src, RewardSource) and src.name == "verifier"
    assert src(["82", "6"], EXAMPLES) == [1.0, 0.0]


def test_function_reward_from_spec_gets_columns(reward_mod):
    src = FunctionReward(f"{reward_mod}:length")
    assert src.name == "rw_mod.length" and isinstance(src, RewardSource)
    assert src(["82", "abc"], EXAMPLES) == [2.0, 3.0]
    assert FunctionReward(f"{reward_mod}:echo_target")(["", ""], EXAMPLES) == [0.82, 0.05]


def test_function_reward_from_callable():
    src = FunctionReward(lambda c, **row: float(c == row["answer"]), name="exact")
    assert src.name == "exact" and src(["82", "82"], EXAMPLES) == [1.0, 0.0]


def test_function_reward_non_number_names_function(reward_mod):
    with pytest.raises(TypeError, match="function 'rw_mod:bad' returned NoneType"):
        FunctionReward(f"{reward_mod}:bad")(["x"], EXAMPLES[:1])
    with pytest.raises(ValueError, match="rw_mod:nan.*non-finite"):
        FunctionReward(f"{reward_mod}:nan")(["x"], EXAMPLES[:1])


def test_function_reward_bad_spec():
    with pytest.raises(ValueError, match="module:function"):
        FunctionReward("no_colon")
    with pytest.raises(ValueError, match="cannot import module"):
        FunctionReward("surely_missing_mod_123:f")


class Const:
    def __init__(self, name, values):
        self.name, self.values = name, values

    def __call__(self, completions, examples):
        return list(self.values)


def test_combined_weights_by_hand():
    combo = CombinedReward([(Const("a", [1.0, 0.0, 0.5]), 1.0), (Const("b", [2.0, 4.0, -1.0]), 0.25)])
    out = combo(["x", "y", "z"], EXAMPLES + EXAMPLES[:1])
    # total = 1.0 * a + 0.25 * b = [1 + 0.5, 0 + 1, 0.5 - 0.25]
    assert torch.equal(out.total, torch.tensor([1.5, 1.0, 0.25]))
    assert out.total.dtype == torch.float32 and out.total.shape == (3,)
    assert torch.equal(out.per_source["a"], torch.tensor([1.0, 0.0, 0.5]))  # unweighted
    assert torch.equal(out.per_source["b"], torch.tensor([2.0, 4.0, -1.0]))
    assert combo.weights == {"a": 1.0, "b": 0.25}


def test_combined_errors():
    with pytest.raises(ValueError, match="at least one"):
        CombinedReward([])
    with pytest.raises(ValueError, match="unique, repeated: a"):
        CombinedReward([(Const("a", [1.0]), 1.0), (Const("a", [1.0]), 1.0)])
    with pytest.raises(ValueError, match="weight must be a finite number"):
        CombinedReward([(Const("a", [1.0]), math.inf)])
    with pytest.raises(ValueError, match="'a' returned 2 values for 1 completions"):
        CombinedReward([(Const("a", [1.0, 2.0]), 1.0)])(["x"], EXAMPLES[:1])
    with pytest.raises(ValueError, match="1 completions but 2 examples"):
        CombinedReward([(Const("a", [1.0]), 1.0)])(["x"], EXAMPLES)


def test_build_rewards_from_specs(reward_mod, arithmetic):
    specs = [
        {"type": "verifier", "weight": 1.0, "fn": None, "path": None},  # None = unset, as a config dumps it
        {"type": "function", "fn": f"{reward_mod}:length", "weight": 0.5},
    ]
    combo = build_rewards(specs, arithmetic)
    assert combo.weights == {"verifier": 1.0, "rw_mod.length": 0.5}
    out = combo(["82", "123"], EXAMPLES)
    # verifier [1, 0] + 0.5 * length [2, 3]
    assert torch.equal(out.total, torch.tensor([2.0, 1.5]))


def test_build_rewards_errors(arithmetic):
    assert sources.source_types() == ["env", "function", "math", "model", "think_format", "verifier"]
    valid = "valid types: env, function, math, model, think_format, verifier"
    with pytest.raises(ValueError, match=rf"rewards.sources\[0\]: unknown reward type 'llm'; {valid}"):
        build_rewards([{"type": "llm"}], arithmetic)
    with pytest.raises(ValueError, match=r"rewards.sources\[1\]: unknown reward type None"):
        build_rewards([{"type": "verifier"}, {"weight": 1.0}], arithmetic)
    with pytest.raises(ValueError, match=r"rewards.sources\[0\] \(type 'function'\).*fnn.*valid arguments: fn, name"):
        build_rewards([{"type": "function", "fnn": "m:f"}], arithmetic)
    with pytest.raises(ValueError, match=r"rewards.sources\[0\] \(type 'function'\).*'fn'"):
        build_rewards([{"type": "function"}], arithmetic)
    with pytest.raises(ValueError, match="needs a task"):
        build_rewards([{"type": "verifier"}], None)
    with pytest.raises(ValueError, match="at least one"):
        build_rewards([], arithmetic)


# ------------------------------------------------------------------------------ reward model


@pytest.fixture(scope="module")
def tiny_reward_model(tmp_path_factory):
    """A 1-layer GPT-2 sequence classifier with a char-level tokenizer, saved to disk."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2ForSequenceClassification, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("rm")
    vocab = {"<pad>": 0, "<unk>": 1, **{chr(i): i - 30 for i in range(32, 127)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", model_input_names=["input_ids", "attention_mask"]
    ).save_pretrained(path)
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=len(vocab), n_positions=64, n_embd=16, n_layer=1, n_head=2, num_labels=1, pad_token_id=0
    )
    GPT2ForSequenceClassification(cfg).save_pretrained(path)
    return str(path)


def test_model_reward_batched_matches_one_by_one(tiny_reward_model):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    completions = ["82", "a much longer completion", "", "5"]
    examples = EXAMPLES + EXAMPLES
    src = ModelReward(tiny_reward_model, batch_size=3)  # batches of 3 and 1, right-padded
    assert src.name.startswith("model_") and isinstance(src, RewardSource)
    scores = src(completions, examples)

    tok = AutoTokenizer.from_pretrained(tiny_reward_model)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model).eval()
    with torch.no_grad():
        ref = [model(**tok(e.prompt + c, return_tensors="pt")).logits[0, 0].item()
               for c, e in zip(completions, examples)]
    assert scores == pytest.approx(ref, abs=1e-5)
    assert len(set(scores)) == 4  # the scores depend on the text

    combo = build_rewards([{"type": "model", "path": tiny_reward_model, "name": "rm", "weight": 2.0}])
    assert torch.allclose(combo(completions, examples).total, 2 * torch.tensor(ref), atol=1e-5)


def test_model_reward_errors(tiny_reward_model, tmp_path):
    with pytest.raises(ValueError, match="not a local directory"):
        ModelReward(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="label 1 out of range"):
        ModelReward(tiny_reward_model, label=1)
