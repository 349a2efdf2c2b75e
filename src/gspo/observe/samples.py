"""Samples: what the model writes, every ``run.samples_every`` RL steps, beside the numbers.

    RUN/samples.jsonl   one row per sampled prompt and step:
        {"step", "prompt", "answer", "completions": [{"text", "reward", "advantage", "ratio",
         "clip_frac", "tokens", "truncated"}, ...]}   (the G completions of the prompt)

``text`` is the completion as decoded for the rewards; in a multi-turn run, the whole transcript
after the prompt — the policy's turns and the environment's observations, special tokens kept.
``advantage`` is the row's (its mean over tokens for a per-token estimator), ``ratio`` and
``clip_frac`` the objective's own per-row ratio mean and clipped-token share in the update (null
for rows the update skipped, or without a policy loss). The first ``run.samples_prompts`` prompts
of the step's batch are kept (on rank 0: its share of the batch). The same rows go to the
trackers (TensorBoard text, W&B tables); ``gspo samples RUN [--step N]`` prints them
(``format_samples``), and the report shows the best and the worst completion of the last step.
This module writes and reads the rows; it decides nothing about training.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from gspo.observe.records import per_row_stats
from gspo.storage import append_line, write_atomic, writing

FILE = "samples.jsonl"


@dataclass
class SampleWriter:
    """Writes ``prompts`` prompts' groups every ``every``-th RL step (the step calls ``finish``)."""
    every: int
    prompts: int
    run_dir: Path
    tokenizer: object
    group_size: int
    objective: Callable | None
    objective_kwargs: dict
    transcripts: bool
    """Multi-turn: the whole transcript after the prompt, not only the final turn."""
    log: Callable[[list[dict], int], None] | None = None
    """Also hand the rows to the trackers (``MetricsWriter.log_samples``)."""

    def due(self, step: int) -> bool:
        """``step`` 0-based; rows carry the logged (1-based) step."""
        return self.every > 0 and self.prompts > 0 and (step + 1) % self.every == 0

    @torch.no_grad()
    def finish(self, step: int, batch, rewards: Tensor, advantages: Tensor, old_logp: Tensor,
               record) -> list[dict]:
        """The rows of step ``step`` written to samples.jsonl (none when not due)."""
        if not self.due(step):
            return []
        n = min(len(rewards), self.prompts * self.group_size)
        ratio, clip = self.row_stats(batch, advantages, old_logp, record, n)
        rows = []
        for start in range(0, n, self.group_size):
            example = batch.examples[start]
            rows.append({"step": step + 1, "prompt": example.prompt, "answer": example.answer,
                         "completions": [self.completion(batch, i, rewards, advantages, ratio, clip)
                                         for i in range(start, min(start + self.group_size, n))]})
        path = Path(self.run_dir) / FILE
        with writing(f"the samples of step {step + 1}", path):
            for row in rows:
                append_line(path, json.dumps(row, ensure_ascii=False))
        if self.log is not None:
            self.log(rows, step + 1)
        return rows

    def row_stats(self, batch, advantages: Tensor, old_logp: Tensor, record, n: int):
        """Per-row ratio mean and clipped-token share [n] (None without a policy loss)."""
        if self.objective is None or record is None:
            return None, None
        self._minibatch = record.minibatch[:n].tolist()
        mask = batch.loss_mask[:n].float()
        return per_row_stats(self.objective, record.logp[:n], old_logp[:n], advantages[:n], mask,
                             self.objective_kwargs)

    def completion(self, batch, i: int, rewards, advantages, ratio, clip) -> dict:
        trained = ratio is not None and int(self._minibatch[i]) >= 0   # the update used the row
        adv = advantages[i]
        adv = adv[batch.response_mask[i].bool()].mean() if adv.dim() and adv.numel() > 1 else adv
        return {"text": self.text(batch, i), "reward": float(rewards[i]), "advantage": float(adv),
                "ratio": float(ratio[i]) if trained else None,
                "clip_frac": float(clip[i]) if trained else None,
                "tokens": int(batch.response_mask[i].sum()),
                "truncated": bool(batch.truncated[i])}

    def text(self, batch, i: int) -> str:
        if not self.transcripts:
            return batch.completions[i]
        T = batch.response_mask.shape[1]
        ids = batch.input_ids[i, -T:][batch.attention_mask[i, -T:].bool()]
        return self.tokenizer.decode(ids.tolist(), skip_special_tokens=False)


# ------------------------------------------------------------------------------------ reading
def read_samples(run_dir: str | Path, step: int | None = None) -> list[dict]:
    """The rows of samples.jsonl (of ``step`` only, when given; -1: the last step written)."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if step == -1 and rows:
        step = rows[-1]["step"]
    return [r for r in rows if step is None or r["step"] == step]


def truncate_samples(run_dir: str | Path, step: int) -> None:
    """On resume or roll-back: drop rows past ``step`` (and a line cut short by a kill)."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    with writing(f"{FILE} cut back to step {step}", path):
        write_atomic(path, "".join(r + "\n" for r in keep))


def _num(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_samples(rows: list[dict]) -> str:
    """The rows as plain text: each prompt, then each completion with its numbers."""
    out = []
    for row in rows:
        out += [f"=== step {row['step']} · prompt (answer: {row['answer']!r})", row["prompt"], ""]
        for k, c in enumerate(row["completions"]):
            out += [f"--- {k}: reward {_num(c['reward'])}  advantage {_num(c['advantage'])}  "
                    f"ratio {_num(c['ratio'])}  clip {_num(c['clip_frac'])}  {c['tokens']} tokens"
                    + ("  (truncated)" if c["truncated"] else ""), c["text"], ""]
    return "\n".join(out)


def as_markdown(rows: list[dict]) -> str:
    """The rows as a markdown table (TensorBoard text)."""
    lines = ["| prompt | completion | reward | advantage | ratio | clip |", "|---|---|---|---|---|---|"]
    for row in rows:
        for c in row["completions"]:
            cells = [row["prompt"], c["text"]]
            cells = [x.replace("|", "\\|").replace("\n", "<br>") for x in cells]
            lines.append(f"| {cells[0]} | {cells[1]} | {_num(c['reward'])} | {_num(c['advantage'])} "
                         f"| {_num(c['ratio'])} | {_num(c['clip_frac'])} |")
    return "\n".join(lines)


def best_and_worst(rows: list[dict]) -> tuple[dict, dict] | None:
    """(prompt row, completion) pairs of the highest and the lowest reward among ``rows``."""
    flat = [(row, c) for row in rows for c in row["completions"]]
    if not flat:
        return None
    return max(flat, key=lambda rc: rc[1]["reward"]), min(flat, key=lambda rc: rc[1]["reward"])
