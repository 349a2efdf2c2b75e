"""How near-tied the first answer token is, before and after RL: a run's cold start vs its final weights.

    python benchmarks/first_tokens.py RUN_DIR [RUN_DIR ...]

For every prompt of the run's test file (task.test_file of its config.yaml, a custom task with a
``target`` column as benchmarks/short_answers.py writes), the next-token distribution after the
prompt: the share of prompts whose first answer token's top two probabilities lie within 0.1 of
each other (``tied``), the share whose greedy first token is the target's (``first ok``), and the
share of prompts whose greedy first token differs between the cold start and the final weights
(``flipped``). Reads the cold start's folder from summary.json (``cold_start.checkpoint``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import yaml

from gspo.models.presets import load_model

TIE = 0.1  # top-1 minus top-2 probability below this: near-tied


def first_token_probs(folder: str, prompts: list[str]) -> tuple[torch.Tensor, object]:
    """[P, V] next-token probabilities after each prompt, and the model's tokenizer."""
    model, tokenizer = load_model(folder)
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        logits = model(**enc).logits[:, -1, :].float()          # [P, V]
    return logits.softmax(-1), tokenizer


def stats(probs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    top = probs.topk(2, dim=-1)                                  # values, indices: [P, 2]
    return {"tied": (top.values[:, 0] - top.values[:, 1] < TIE).float().mean().item(),
            "first ok": (top.indices[:, 0] == targets).float().mean().item()}


def main(run_dir: str) -> None:
    run = Path(run_dir)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(line) for line in Path(cfg["task"]["test_file"]).read_text().splitlines()]
    prompts = [r["prompt"] for r in rows]
    cold, tokenizer = first_token_probs(summary["cold_start"]["checkpoint"], prompts)
    final, _ = first_token_probs(summary["final_checkpoint"], prompts)
    targets = torch.tensor([tokenizer(r["target"], add_special_tokens=False)["input_ids"][0] for r in rows])
    flipped = (cold.argmax(-1) != final.argmax(-1)).float().mean().item()
    before, after = stats(cold, targets), stats(final, targets)
    print(f"{run_dir}: tied {before['tied']:.3f} -> {after['tied']:.3f}  first ok "
          f"{before['first ok']:.3f} -> {after['first ok']:.3f}  flipped {flipped:.3f}")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        main(arg)
