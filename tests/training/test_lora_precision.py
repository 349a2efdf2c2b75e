"""LoRA adapters (peft), activation checkpointing and bfloat16 on the tiny-dense preset.

Precision: bfloat16 log-probs against float32 ones of the same weights, float32 loss, gradients
that reach bfloat16 parameters. Activation checkpointing: the same gradients as without (float32,
gradients before any optimizer step), with the shared-prompt forward the trainer uses. LoRA: only
adapters train, the KL reference is the base with the adapter off, checkpoints are peft adapter
directories that plain transformers + peft load to the same greedy tokens as gspo's eval path,
exact resume, and a target that matches no module is one line, exit 2, before anything is built.
"""

import copy
import json
import shutil
from dataclasses import replace

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from gspo import tasks
from gspo.training import lora
from gspo.core import objectives
from gspo.cli import main
from gspo.config import ConfigError, LoRAConfig, load_config
from gspo.core.logprobs import response_logprobs
from gspo.observe.metrics import read_metrics
from gspo.models.presets import build_model, enable_activation_checkpointing, load_model
from gspo.rollout.data import build_task, eval_examples
from gspo.rollout.generate import SamplingParams, demonstration_batch, generate
from gspo.training.trainer import Trainer
from conftest import parity_rewards


@pytest.fixture(scope="module")
def grouped_batch(arith):
    """3 prompts x 2 different answers each (rows of a prompt consecutive, like a rollout group)."""
    _, tok = build_model("tiny-dense", 0)
    examples = arith.split("train")[:3]
    rows = [replace(ex, answer=ans) for ex in examples for ans in (ex.answer, ex.answer[::-1] + "7")]
    return demonstration_batch(tok, rows, "cpu"), torch.arange(6) // 2  # groups [N]


def _logprobs(model, batch, groups=None, **kw):
    return response_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_mask,
                             prompt_groups=groups, trim=groups is not None, **kw)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _gspo_loss(logp, batch):
    """GSPO's loss at π_old = π_θ (detached), advantages +1/-1 alternating: float32 throughout."""
    adv = torch.tensor([1.0, -1.0] * (len(logp) // 2))
    loss, _ = objectives.get("gspo")(logp, logp.detach(), adv, batch.response_mask)
    return loss


# ------------------------------------------------------------------------------- bfloat16

def test_bfloat16_logprobs_match_float32_within_bf16_rounding(grouped_batch):
    """Same weights, cast to bfloat16: log-probs come out float32 and differ from float32's only
    by bfloat16 rounding (8 significant bits, relative 2^-8 ~ 0.004 per operation). Measured here:
    max |Δ| 0.0046 nat, mean 0.0017, on log-probs of about -4.5 nats; the bound is 10x the max."""
    batch, groups = grouped_batch
    model, _ = build_model("tiny-dense", 0)
    half = copy.deepcopy(model).to(torch.bfloat16)
    with torch.no_grad():
        full, low = _logprobs(model.eval(), batch, groups), _logprobs(half.eval(), batch, groups)
    assert low.logp.dtype == torch.float32 and low.entropy.dtype == torch.float32
    mask = batch.response_mask.bool()
    diff = (low.logp - full.logp)[mask].abs()
    assert diff.max() < 0.05, diff.max()
    assert full.logp[mask].abs().mean() > 1.0           # the values compared are not near zero
    assert (low.logp[~mask] == 0).all()


def test_bfloat16_loss_is_float32_and_gradients_reach_the_weights(grouped_batch):
    batch, _ = grouped_batch
    model, _ = build_model("tiny-dense", 0, dtype=torch.bfloat16)
    model.train()
    out = _logprobs(model, batch)
    loss = _gspo_loss(out.logp, batch)
    assert loss.dtype == torch.float32
    loss.backward()
    grads = _grads(model)
    assert len(grads) == len(list(model.parameters()))
    assert all(g.dtype == torch.bfloat16 and torch.isfinite(g).all() for g in grads.values())
    assert sum(float(g.float().abs().sum()) for g in grads.values()) > 0


def test_lora_over_a_bfloat16_base_trains_float32_adapters(grouped_batch):
    batch, _ = grouped_batch
    model, _ = build_model("tiny-dense", 0, dtype=torch.bfloat16)
    model = lora.attach(model, LoRAConfig(r=4), seed=0, base="unused").train()
    loss = _gspo_loss(_logprobs(model, batch).logp, batch)
    assert loss.dtype == torch.float32
    loss.backward()
    grads = _grads(model)
    assert grads and all("lora_" in n for n in grads)
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads.values())
    assert any(g.abs().max() > 0 for n, g in grads.items() if "lora_B" in n)  # B = 0: A's grad is 0
    frozen = [p.dtype for n, p in model.named_parameters() if "lora_" not in n]
    assert frozen and set(frozen) == {torch.bfloat16}


# ------------------------------------------------------------------------------- activation checkpointing

@pytest.mark.parametrize("shared", [False, True], ids=["one-forward", "shared-prompts"])
@pytest.mark.parametrize("with_lora", [False, True], ids=["full", "lora"])
def test_activation_checkpointing_gives_the_same_gradients(grouped_batch, shared, with_lora):
    """float32, before any optimizer step: log-probs and every gradient equal to 1e-6. With shared
    prompts (the trainer's update forward) checkpointing drops the KV cache, so the forward must
    fall back to one pass; a prompt-less response pass would be off by far more than 1e-6."""
    batch, groups = grouped_batch
    plain, _ = build_model("tiny-dense", 0)
    if with_lora:
        plain = lora.attach(plain, LoRAConfig(r=4), seed=0, base="unused")
        with torch.no_grad():    # B = 0 at init: give the adapters a value so they matter
            for name, p in plain.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
    checkpointed = copy.deepcopy(plain)
    enable_activation_checkpointing(checkpointed.get_base_model() if with_lora else checkpointed)
    results = []
    for model in (plain, checkpointed):
        model.train()
        out = _logprobs(model, batch, groups if shared else None)
        _gspo_loss(out.logp, batch).backward()
        results.append((out.logp.detach(), _grads(model)))
    (lp_a, g_a), (lp_b, g_b) = results
    torch.testing.assert_close(lp_b, lp_a, atol=1e-6, rtol=0)
    assert g_a.keys() == g_b.keys() and g_a
    if with_lora:
        assert all("lora_" in n for n in g_a)               # only adapters get gradients
    for name in g_a:
        torch.testing.assert_close(g_b[name], g_a[name], atol=1e-6, rtol=1e-5, msg=name)


def test_checkpointing_with_grad_drops_the_cache_so_the_prompt_split_is_skipped(grouped_batch):
    """The precondition of the fall-back: under checkpointing, a training forward with grad
    returns an unfilled cache (transformers sets each layer's cache to None)."""
    batch, _ = grouped_batch
    model, _ = build_model("tiny-dense", 0)
    enable_activation_checkpointing(model)
    model.train()
    out = model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=True)
    cache = out.get("cache", out.get("past_key_values"))
    assert cache is None or cache.get_seq_length() == 0


# ------------------------------------------------------------------------------- LoRA: config, preflight

def test_lora_is_off_by_default_and_validated():
    assert load_config(None, []).model.lora is None
    cfg = load_config(None, ["model.lora.r=8"])
    assert cfg.model.lora == LoRAConfig(r=8) and cfg.model.lora.target_modules == "all-linear"
    with pytest.raises(ConfigError, match="model.lora.target_modules: needs at least one"):
        load_config(None, ["model.lora.target_modules=[]"])
    with pytest.raises(ConfigError, match="model.lora.dropout"):
        load_config(None, ["model.lora.dropout=1.5"])
    with pytest.raises(ConfigError, match="not supported with objective.name=ppo"):
        load_config(None, ["model.lora.r=8", "objective.name=ppo"])


def test_unmatched_targets_follow_peft_matching():
    model, _ = build_model("tiny-dense", 0)
    cfg = LoRAConfig(target_modules=["q_proj", "self_attn.v_proj", "qkv_proj", "mlp"])
    assert lora.unmatched_targets(model, cfg) == ["qkv_proj"]
    assert lora.unmatched_targets(model, LoRAConfig()) == []          # all-linear


def test_a_lora_target_matching_nothing_is_one_line_exit_2_before_anything_is_built(tmp_path, capsys):
    run = tmp_path / "run"
    code = main(["train", f"run.dir={run}", f"sft.cache_dir={tmp_path / 'sft'}",
                 "model.lora={target_modules: [q_proj, qkv]}"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.count("\n") == 0 and "model.lora.target_modules: 'qkv' matches no module" in err
    assert not run.exists() and not (tmp_path / "sft").exists()       # nothing built or written


def test_unsupported_combinations_are_refused_before_anything_is_built(tmp_path, capsys):
    code = main(["train", f"run.dir={tmp_path / 'a'}", "model.preset=tiny-moe", "model.lora.r=4"])
    assert code == 2 and "model.lora: LoRA on Mixture-of-Experts models" in capsys.readouterr().err
    code = main(["train", f"run.dir={tmp_path / 'b'}", "model.preset=tiny-moe",
                 "train.activation_checkpointing=true", "moe.routing_replay=old"])
    assert code == 2 and "train.activation_checkpointing does not work with moe" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_lora_target_peft_cannot_adapt_is_one_line(tmp_path, capsys):
    code = main(["train", f"run.dir={tmp_path / 'run'}", "model.lora={target_modules: [input_layernorm]}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "model.lora.target_modules:" in err


# ------------------------------------------------------------------------------- LoRA: training run

LORA = ["model.lora={r: 4, alpha: 8}", "train.activation_checkpointing=true", "train.beta=0.05",
        "run.save_every=1", "run.keep_checkpoints=3", "train.lr=1e-2"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, small_config, reward_module):
    """SFT 5 steps, then 2 GSPO steps of LoRA r=4 with activation checkpointing and a KL term."""
    root = tmp_path_factory.mktemp("lora")
    overrides = [*LORA, parity_rewards(reward_module)]
    cfg = small_config(root, *overrides)
    trainer = Trainer(cfg, log=lambda m: None)
    summary = trainer.run()
    return dict(root=root, cfg=cfg, overrides=overrides, summary=summary, trainer=trainer,
                rows=read_metrics(cfg.run.dir))


def test_only_adapter_parameters_train(lora_run):
    trainer = lora_run["trainer"]
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    assert sum(len(g["params"]) for g in trainer.optimizer.param_groups) == len(trainable)
    # the frozen base is bit for bit the cold start (no optimizer ever held it)
    cold, _ = load_model(lora_run["summary"]["cold_start"]["checkpoint"])
    base = {n.replace(".base_layer", ""): p for n, p in trainer.model.get_base_model().named_parameters()
            if "lora_" not in n}
    cold_params = dict(cold.named_parameters())
    assert base.keys() == cold_params.keys()
    assert all(torch.equal(base[n], cold_params[n]) for n in base)
    # ... and the adapters moved: B started at 0
    moved = [p for n, p in trainer.model.named_parameters() if "lora_B" in n]
    assert any(p.abs().max() > 0 for p in moved)
    assert trainer.ref_model is trainer.model                        # no second copy for the KL
    assert all("policy/kl_ref" in r for r in lora_run["rows"][1:])


def test_kl_reference_is_the_base_with_the_adapter_off(lora_run, grouped_batch):
    trainer, (batch, _) = lora_run["trainer"], grouped_batch
    cold, _ = load_model(lora_run["summary"]["cold_start"]["checkpoint"])
    with torch.no_grad():
        on = _logprobs(trainer.model, batch).logp
        with lora.reference(trainer.model):
            off = _logprobs(trainer.model, batch).logp
        base = _logprobs(cold.eval(), batch).logp
        again = _logprobs(trainer.model, batch).logp
    torch.testing.assert_close(off, base, atol=1e-6, rtol=0)
    assert (on - off).abs().max() > 1e-4                             # the adapter does change π
    assert torch.equal(again, on)                                    # and is back on afterwards


def test_checkpoint_is_a_peft_adapter_directory(lora_run):
    ckpt = lora_run["root"] / "run" / "checkpoints" / "step_000002"
    names = {p.name for p in ckpt.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "scheduler.pt",
            "trainer_state.json", "checksums.json", "tokenizer.json"} <= names
    assert "model.safetensors" not in names and "config.json" not in names
    config = json.loads((ckpt / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    base = lora_run["root"] / "run" / "base"
    assert config["base_model_name_or_path"] == str(base.absolute())
    assert (base / "model.safetensors").is_file()


def test_plain_transformers_and_peft_generate_what_gspo_eval_generates(lora_run, arith):
    """AutoModelForCausalLM + PeftModel.from_pretrained (no gspo code) against gspo's eval path
    (load_model merges the adapter; rollout.generate greedy): the same greedy tokens."""
    ckpt = lora_run["root"] / "run" / "checkpoints" / "step_000002"
    base = json.loads((ckpt / "adapter_config.json").read_text())["base_model_name_or_path"]
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), ckpt).eval()
    tok = AutoTokenizer.from_pretrained(ckpt)
    examples = arith.split("test")[:8]
    enc = tok([ex.prompt for ex in examples], return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        out = plain.generate(**enc, do_sample=False, max_new_tokens=6, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
    plain_tokens = out[:, enc["input_ids"].shape[1]:]
    merged, merged_tok = load_model(ckpt)
    assert not isinstance(merged, PeftModel)                           # merged: a plain model
    ours = generate(merged, merged_tok, examples, SamplingParams(max_new_tokens=6, greedy=True))
    assert plain_tokens.shape == ours.response_ids.shape
    keep = ours.response_mask.bool()                                     # up to and including EOS
    assert torch.equal(torch.where(keep, plain_tokens, -1), torch.where(keep, ours.response_ids, -1))
    # the adapter matters: the merged model is not the base
    cold = AutoModelForCausalLM.from_pretrained(base).eval()
    with torch.no_grad():
        assert not torch.allclose(merged(**enc).logits, cold(**enc).logits, atol=1e-4)


@pytest.fixture(scope="module")
def lora_chat_run(tmp_path_factory, small_config, reward_module):
    """As ``lora_run``, with the BPE preset and chat prompts (ChatML, <|im_end|> the EOS)."""
    root = tmp_path_factory.mktemp("lora_chat")
    cfg = small_config(root, *LORA, parity_rewards(reward_module), "model.tokenizer=bpe",
                       "task.chat=true", "sft.steps=40", "sft.lr=1e-2")
    summary = Trainer(cfg, log=lambda m: None).run()
    return dict(root=root, cfg=cfg, summary=summary)


def test_a_bpe_chat_adapter_generates_in_plain_transformers_what_gspo_eval_generates(lora_chat_run):
    """The BPE + chat + LoRA checkpoint with plain transformers + peft: the saved tokenizer's chat
    template renders the prompts gspo trained on, its EOS is <|im_end|>, and greedy generation
    stops there with the tokens gspo's eval path generates."""
    cfg = lora_chat_run["cfg"]
    ckpt = lora_chat_run["root"] / "run" / "checkpoints" / "step_000002"
    base = json.loads((ckpt / "adapter_config.json").read_text())["base_model_name_or_path"]
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), ckpt).eval()
    tok = AutoTokenizer.from_pretrained(ckpt)
    assert tok.eos_token == "<|im_end|>"
    ours_examples = eval_examples(build_task(cfg), cfg)            # rendered by gspo
    raw = tasks.build(cfg.task.name, seed=cfg.seed, n_train=cfg.task.n_train, n_test=cfg.task.n_test,
                      **cfg.task.params).split("test")[:len(ours_examples)]
    texts = [tok.apply_chat_template([{"role": "user", "content": ex.prompt}], tokenize=False,
                                     add_generation_prompt=True) for ex in raw]
    assert texts == [ex.prompt for ex in ours_examples]
    assert texts[0].startswith("<|im_start|>user\n") and texts[0].endswith("<|im_start|>assistant\n")
    enc = tok(texts, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        out = plain.generate(**enc, do_sample=False, max_new_tokens=8, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
    plain_tokens = out[:, enc["input_ids"].shape[1]:]
    merged, merged_tok = load_model(ckpt)
    ours = generate(merged, merged_tok, ours_examples, SamplingParams(max_new_tokens=8, greedy=True))
    assert plain_tokens.shape[1] <= ours.response_ids.shape[1]
    keep = ours.response_mask.bool()[:, :plain_tokens.shape[1]]
    assert torch.equal(torch.where(keep, plain_tokens, -1),
                       torch.where(keep, ours.response_ids[:, :plain_tokens.shape[1]], -1))
    assert not ours.truncated.all()                                # some responses end at <|im_end|>
    ends = ours.response_ids[~ours.truncated, (ours.lengths[~ours.truncated] - 1).long()]
    assert (ends == tok.convert_tokens_to_ids("<|im_end|>")).all()
    assert tok.batch_decode(plain_tokens, skip_special_tokens=True) == ours.completions


def test_gspo_eval_reads_the_adapter_checkpoint(lora_run, capsys):
    ckpt = lora_run["root"] / "run" / "checkpoints" / "step_000002"
    code = main(["eval", *[o for o in lora_run["overrides"] if o.startswith(("task.", "eval."))],
                 "task.n_train=50", "task.n_test=10", "eval.n=8", "eval.k=2", "--checkpoint", str(ckpt)])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["n"] == 8 and result["checkpoint"] == str(ckpt)


def test_lora_resume_is_exact(lora_run, small_config):
    """Resume from the step-1 adapter checkpoint: step 2 reproduces the uninterrupted run."""
    root = lora_run["root"]
    run = root / "exact"
    shutil.copytree(root / "run", run)
    shutil.rmtree(run / "checkpoints" / "step_000002")
    (run / "summary.json").unlink()
    cfg = small_config(root, *lora_run["overrides"], run="exact")
    logs = []
    Trainer(cfg, resume=True, log=logs.append).run()
    assert any("(step 1)" in line for line in logs)
    strip = lambda row: {k: v for k, v in row.items() if not k.startswith("time/")}  # noqa: E731
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert strip(rows[2]) == strip(lora_run["rows"][2])
    a = (run / "checkpoints" / "step_000002" / "adapter_model.safetensors").read_bytes()
    b = (root / "run" / "checkpoints" / "step_000002" / "adapter_model.safetensors").read_bytes()
    assert a == b
